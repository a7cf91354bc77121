"""ETTR simulator (simulator.ettr): formulas on hand-computed cases, interval policies, CLI."""

import json
import math

import pytest

from baselines.intervals import checkfreq_interval, checkfreq_overhead, ettr, oracle_interval, periodic_ettr
from simulator.ettr import (
    PRESETS,
    ClusterShape,
    Hardware,
    MeasuredProfile,
    ModelShape,
    Preset,
    StageModel,
    main,
    pipeline_s,
    predict_from_profile,
    simulate,
    stage_model,
)

# One MoE layer, h=1000, 2 routed experts of 3e6 params (top-1), attention 4e6, router 2000;
# 2 GPUs: pp=1, dp=2, ep=2 (one expert per GPU, expert data-parallel degree 1); one micro-batch
# of 1000 tokens; 1 TFLOP/s at MFU 1, 1 GB/s collectives without latency, 1 GB/s to host.
TINY = Preset(
    "tiny",
    ModelShape(1, 0, 1000, 0, 2, 0, 1, 1000, 10),
    ClusterShape(gpus=2, pp=1, ep=2, micro_batches=1, seq_len=1000),
    Hardware(
        peak_flops=1e12,
        mfu=1.0,
        a2a_alpha_s=0.0,
        a2a_bw=1e9,
        dp_alpha_s=0.0,
        dp_bw=1e9,
        host_bw=1e9,
        nic_bw=1e15,
        disk_bw=1e9,
        restart_s=10.0,
        gpus_per_node=1,
    ),
)  # one GPU per node: the all-to-all crosses the network


# ---- ETTR formula ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overhead, recovery_s, mtbf_s, expected",
    [
        (0.25, 60.0, 600.0, 0.8 * 0.9),  # 0.72
        (0.0, 30.0, 600.0, 0.95),
        (0.1, 700.0, 600.0, 0.0),  # recovery longer than MTBF: no progress
        (0.25, 60.0, math.inf, 0.8),  # no failures: only the overhead
    ],
)
def test_ettr_hand_cases(overhead, recovery_s, mtbf_s, expected):
    assert ettr(overhead, recovery_s, mtbf_s) == pytest.approx(expected)


# ---- iteration time -------------------------------------------------------------------------------


def test_pipeline_1f1b_hand_cases():
    assert pipeline_s([3.0] * 3, 4) == pytest.approx(18.0)  # (M + S - 1) * (t_f + t_b)
    assert pipeline_s([1.0, 2.0, 3.0], 4) == pytest.approx(15.0)  # 1+2+3 fill/drain + 3 * 3 steady
    st = StageModel((), 0, 0, compute_s=0.3, t_f=0.15, t_b=0.25, dp_s=0.1, nic_s=0.0, stages=4, micro_batches=8)
    assert st.iteration_s == pytest.approx((8 + 4 - 1) * 0.4 + 0.1)
    assert st.replay_s() == pytest.approx(8 * 0.4 + 0.1)  # one stage, no bubble
    assert st.replay_s(frozen=1.0) == pytest.approx(8 * (0.4 - 0.1) + 0.1)  # weight grads = 1/3


def test_stage_model_hand_case():
    st = stage_model(TINY)
    # active per token = attn 4e6 + 1 expert 3e6 + router 2000; causal attention 2*seq*h = 2e6 FLOPs
    fwd = (2 * 7_002_000 + 2_000_000) * 1000 / 1e12  # 0.016004 s
    a2a = 2 * (1000 * 1 * 1000 * 2 * (1 / 2)) / 1e9  # dispatch + combine
    dp = 2 * (1 / 2) * 4_002_000 * 2 / 1e9  # RS + AG of non-expert grads
    assert st.operators == (3_000_000, 4_000_000, 2_000)  # expert, attention, router
    assert st.compute_s == pytest.approx(3 * fwd)
    assert st.t_f == pytest.approx(fwd + a2a) and st.t_b == pytest.approx(2 * fwd + a2a)
    assert st.dp_s == pytest.approx(dp)
    assert st.nic_s == pytest.approx(dp + 2 * a2a)  # a2a fwd + bwd, + DP
    assert st.iteration_s == pytest.approx(3 * fwd + 2 * a2a + dp)  # M = S = 1
    assert st.iteration_s == pytest.approx(0.060016)


# ---- strategies -----------------------------------------------------------------------------------


def test_moevement_window_and_recovery_hand_case():
    # Budget = T * B = 0.060016 s * 1 GB/s = 60.016 MB. Order: expert, attention, router.
    # O_active=3: SS0 = 12*(7.002e6) = 84.0 MB, too big; O_active=2: SS0 = 12*7e6 + 2*2000 > budget;
    # O_active=1: SS0 = 36e6 + 2*(4e6 + 2000), SS1 = 48e6 + 4000, SS2 = 24000 all fit -> W = 3.
    (res,) = simulate(TINY, 600.0, ["moevement"])
    assert res.window == 3 and res.overhead == 0.0
    t, fwd_bwd, compute, dp = 0.060016, 0.052012, 0.048012, 0.008004
    fetch = (44_004_000 + 48_004_000 + 24_000) / 1e9
    conversion = 3 * (fwd_bwd - compute * (1 / 3) / 3 + dp)  # (W-1)/(2W) = 1/3 frozen on average
    catch_up = (3 - 1) / 2 * (fwd_bwd + dp)
    assert res.recovery_s == pytest.approx(10.0 + fetch + conversion + catch_up + t / 2)
    assert res.ettr == pytest.approx(1 - res.recovery_s / 600.0)


@pytest.mark.parametrize(
    "stall_s, iteration_s, fixed_s, mtbf_s",
    [
        (30.0, 2.0, 60.0, 600.0),
        (5.0, 1.0, 60.0, 3600.0),
        (100.0, 3.0, 30.0, 1800.0),
        (0.0, 2.0, 60.0, 600.0),
        (1.0, 10.0, 60.0, 600.0),
        (500.0, 0.5, 10.0, 7200.0),
    ],
)
def test_gemini_oracle_interval_is_the_brute_force_optimum(stall_s, iteration_s, fixed_s, mtbf_s):
    def value(k):
        return periodic_ettr(k, stall_s, iteration_s, fixed_s, mtbf_s)

    best = max(range(1, 20_000), key=value)
    k = oracle_interval(stall_s, iteration_s, fixed_s, mtbf_s)
    assert value(k) == pytest.approx(value(best), rel=1e-12)
    assert k == best


def test_gemini_periodic_ettr_hand_case():
    # k=4, stall 2 s, T=10 s: overhead 2/40 = 0.05; R = 60 + (4/2 + 1) * 10 = 90 s
    assert periodic_ettr(4, 2.0, 10.0, 60.0, 600.0) == pytest.approx((1 - 90 / 600) / 1.05)


def test_checkfreq_interval_hand_case():
    # overhead(k) = (2 + max(0, 50 - 10k)) / 10k: k=6 -> 0.0333, k=7 -> 0.0286
    assert checkfreq_overhead(6, 2.0, 50.0, 10.0) == pytest.approx(2 / 60)
    assert checkfreq_interval(2.0, 50.0, 10.0) == 7
    assert checkfreq_interval(0.0, 0.0, 10.0) == 1


@pytest.mark.parametrize(
    "stall_s, persist_s, iteration_s",
    [
        (0.5, 5.0, 1.0),
        (3.0, 0.0, 2.0),
        (0.0, 40.0, 3.0),
        (10.0, 200.0, 0.7),
    ],
)
def test_checkfreq_interval_is_smallest_within_three_percent(stall_s, persist_s, iteration_s):
    k = checkfreq_interval(stall_s, persist_s, iteration_s)
    assert checkfreq_overhead(k, stall_s, persist_s, iteration_s) <= 0.03
    assert all(checkfreq_overhead(j, stall_s, persist_s, iteration_s) > 0.03 for j in range(1, k))


def test_671b_preset_moevement_beats_gemini_at_10_minutes():
    results = {r.strategy: r for r in simulate(PRESETS["671B-16384"], 600.0)}
    assert results["moevement"].ettr > results["gemini"].ettr
    assert 0 < results["gemini"].ettr < 1 and results["none"].ettr == 0.0


def test_slow_snapshots_stall_gemini_and_widen_the_window():
    preset = PRESETS["671B-16384"]
    slow = Preset(
        preset.name, preset.model, preset.layout, Hardware(host_bw=1e9)
    )  # 1 GB/s: a dense copy takes ~20 s, two iterations
    results = {r.strategy: r for r in simulate(slow, 600.0)}
    assert results["gemini"].interval > 1 and results["gemini"].overhead > 0
    assert results["moevement"].window > 1 and results["moevement"].overhead == 0.0
    assert results["moevement"].ettr > results["gemini"].ettr


# ---- calibration ----------------------------------------------------------------------------------

PROFILE = {
    "iteration_s": 2.0,
    "mtbf_s": 300.0,
    "steps": 100,
    "strategies": {
        "none": {"overhead": 0.0, "recovery_s": 0.0, "failures": 0},
        "moevement": {"overhead": 0.25, "recovery_s": 10.0, "failures": 2},
    },
}


def test_predict_from_profile_hand_case():
    # moevement: wall = 100 * 2 * 1.25 + 2 * 10 = 270 s, useful = 200 s
    predicted = predict_from_profile(PROFILE)
    assert predicted == pytest.approx({"none": 1.0, "moevement": 200 / 270})
    assert predicted["moevement"] == pytest.approx(1 / 1.25 * (1 - 20 / 270))
    assert MeasuredProfile.from_json(json.dumps(PROFILE)).steady_ettr("moevement") == pytest.approx(
        0.8 * (1 - 10 / 300)
    )


def test_profile_missing_key_is_named():
    with pytest.raises(ValueError, match="steps"):
        MeasuredProfile.from_json({k: v for k, v in PROFILE.items() if k != "steps"})


# ---- CLI ------------------------------------------------------------------------------------------


def test_cli_preset_lines(capsys):
    main(["--preset", "32B-512", "--mtbf-min", "10", "--strategies", "moevement,gemini"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("preset=32B-512 gpus=512 ") and "iter_s=" in lines[0]
    assert [ln.split()[0] for ln in lines[1:]] == ["strategy=moevement", "strategy=gemini"]
    assert lines[1].split()[1].startswith("ettr=") and "window=" in lines[1] and "interval=-" in lines[1]


def test_cli_profile(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    main(["--profile", str(path)])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"strategy=moevement predicted_ettr={200 / 270:.4f}")


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--preset", "nope", "--mtbf-min", "10"], "671B-16384"),
        (["--preset", "32B-512", "--mtbf-min", "10", "--strategies", "moevement,bogus"], "checkfreq"),
    ],
)
def test_cli_unknown_names_exit_2_with_allowed_values(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "allowed" in err and named in err
