"""The paper-evaluation simulator's mechanisms on hand-computed cases (simulator/: testbed, setting,
mechanisms, run, skew, frozen, fit, measured). None of these checks uses the paper's results."""

import math
import re
from dataclasses import replace

import pytest

from baselines.intervals import checkfreq_overhead
from simulator.calibrated import MOC_PLT_BUDGET, Calibration
from simulator.ettr import main
from simulator.fit import coordinate_search, to_calibration, to_coordinates
from simulator.frozen import Ablation, frozen_fractions, ordered_operators
from simulator.measured import window_at_cap
from simulator.mechanisms import (
    checkfreq_cost,
    gemini_cost,
    moc_overhead,
    moevement_cost,
    network_stall_s,
    node_network,
)
from simulator.oracle import oracle_interval
from simulator.run import closed_form, finite, lost_per_failure, moc_run
from simulator.setting import Operator, Setting, gradient_exchange_bytes, pipeline_send_bytes
from simulator.skew import alpha_for_skew, expected_skew, popularity, round_robin_staleness
from simulator.testbed import MoEShape, iteration_from_cells
from tests.helpers import ROOT

GB = 1e9
# No interference, 10 GB/s line rate x 0.5 = 5 GB/s for bulk copies; restart 10 s + 30 s x log2(relaunched
# nodes): 10 s localized (one node), 130 s global (16 nodes); no failure-independent loss.
CAL = Calibration(
    nic_efficiency=0.5,
    persist_interference=0.0,
    restart_s=10.0,
    rejoin_s=30.0,
    zero_loss_checkfreq=0.0,
    zero_loss_gemini=0.0,
    zero_loss_moc=0.0,
    zero_loss_moevement=0.0,
    moc_loss_scale=1.0,
)
# 128 GPUs = 16 nodes; 4 stages, M = 12 (a stage iteration is 12/15 of T = 2 s); 20 GB of state per node,
# 80% in experts; training sends 10 GB a node per iteration: busy 10 GB / (10 GB/s x 2 s) = 0.5.
OPS = (Operator(12 * GB, 2 * GB, 1.0, (0, 0)), Operator(12 * GB, 2 * GB, 1.0, (0, 1)), Operator(6 * GB, 1 * GB, 2.0))
SETTING = Setting(
    name="hand",
    iteration_s=2.0,
    gpus=128,
    stages=4,
    micro_batches=12,
    experts=8,
    node_state_bytes=20 * GB,
    cluster_state_bytes=240 * GB,
    expert_state_share=0.8,
    operators=OPS,
    nic_train_bytes=10 * GB,
    log_bytes_gpu=0.0,
    moc_start_overhead=0.1,
)


# ---- testbed and setting -------------------------------------------------------------------------


def test_iteration_from_cells_is_the_middle_of_the_rounding_ranges():
    # 0.22 s (8%): T in [0.215/0.085, 0.225/0.075] = [2.529, 3.0]; 0.06 s (2%): [2.2, 4.33]
    assert iteration_from_cells([(0.22, 8), (0.06, 2)]) == pytest.approx((0.215 / 0.085 + 3.0) / 2)
    with pytest.raises(ValueError, match="no common"):
        iteration_from_cells([(0.22, 8), (0.01, 2)])  # [2.53, 3.0] and [0.2, 1.0]


def test_moe_shape_totals():
    shape = MoEShape(2, 2, 10, 4, 1, 100, 50, 1000, "hand")
    assert shape.total_params() == 2 * 4 * 100 + 2 * 50 + 1000
    assert shape.active_params() == 2 * 1 * 100 + 2 * 50 + 1000


def test_training_traffic_hand_cases():
    act = 65536 * 2048 * 2
    assert pipeline_send_bytes(3, 4, 2048, 65536) == 2 * 4 * act  # middle stage: forward and backward sends
    assert pipeline_send_bytes(2, 4, 2048, 65536) == 4 * act
    assert pipeline_send_bytes(1, 4, 2048, 65536) == 0
    assert gradient_exchange_bytes(4, 1e9) == pytest.approx(2 * 0.75 * 2e9)
    assert gradient_exchange_bytes(1, 1e9) == 0


# ---- the node NIC and each strategy's mechanism -----------------------------------------------------


def test_node_network_shares_the_nic_with_training():
    net = node_network(SETTING, CAL)
    assert net.busy == pytest.approx(0.5) and net.full == pytest.approx(5 * GB) and net.idle == pytest.approx(2.5 * GB)
    # 10 GB: 5 GB go in the iteration's idle time (2.5 GB/s x 2 s), the other 5 GB stall at 5 GB/s
    assert network_stall_s(10 * GB, net, 2.0) == pytest.approx(1.0)
    assert network_stall_s(4 * GB, net, 2.0) == 0.0


def test_gemini_oracle_interval_and_global_recovery():
    # 20 GB: 5 GB overlapped, 15 GB at 5 GB/s -> 3 s stall; fixed = 130 s restart + 20 GB / 5 GB/s
    cost = gemini_cost(SETTING, CAL, 600.0)
    k = oracle_interval(3.0, 2.0, 134.0, 600.0)
    assert cost.stall_s == pytest.approx(3.0) and cost.interval == k
    assert cost.overhead == pytest.approx(3.0 / (k * 2.0))
    assert cost.recovery_s == pytest.approx(134.0 + (k / 2 + 1) * 2.0) and cost.restart_s == 10.0
    every = gemini_cost(SETTING, CAL, 600.0, interval=1)
    assert 1 + every.overhead == pytest.approx(2.5)  # (T + 3 s) / T


def test_global_restart_grows_with_relaunched_nodes_localized_does_not():
    assert CAL.restart_at(1) == pytest.approx(10.0) and CAL.restart_at(16) == pytest.approx(130.0)
    big = replace(SETTING, gpus=128 * 16)  # 256 nodes: log2 = 8, 4 more than 16 nodes
    assert gemini_cost(big, CAL, 600.0, 10).recovery_s - gemini_cost(SETTING, CAL, 600.0, 10).recovery_s == (
        pytest.approx(120.0)
    )
    assert moevement_cost(big, CAL).recovery_s == pytest.approx(moevement_cost(SETTING, CAL).recovery_s)


def test_checkfreq_interval_caps_overhead_at_three_percent():
    # persist 240 GB at 5 GB/s = 48 s; no snapshot stall (2.5 GB per GPU at PCIe speed) and no interference
    cost = checkfreq_cost(SETTING, CAL)
    assert cost.interval == 24  # the smallest k with max(0, 48 - 2k) / (2k) <= 3%: k >= 48 / 2.06 = 23.3
    assert cost.overhead == pytest.approx(checkfreq_overhead(24, 0.0, 48.0, 2.0))
    assert cost.recovery_s == pytest.approx(130.0 + 48.0 + (24 / 2 + 1) * 2.0 + 48.0)


def test_moc_overhead_scales_with_the_experts_it_saves():
    # bytes(f) = 20 GB (0.2 + 0.8 f); bandwidth gives f = 1/8 a 10% overhead: B = 6 GB / 2.2 s
    assert moc_overhead(SETTING, 1 / 8) == pytest.approx(0.1)
    assert moc_overhead(SETTING, 1.0) == pytest.approx((20 / (6 / 2.2) - 2.0) / 2.0)
    with pytest.raises(ValueError, match="first K"):
        moc_overhead(replace(SETTING, moc_start_overhead=None), 1.0)
    # no stated first-K overhead (a scale preset): the NIC's bulk rate, 5 GB/s: 20 GB take 4 s, 2 s over T
    assert moc_overhead(replace(SETTING, moc_start_overhead=None), 1.0, CAL) == pytest.approx(1.0)


def test_moevement_window_stall_and_localized_recovery():
    # per-GPU bandwidth = idle line rate 5 GB/s / (8 GPUs x 2 replicas); budget 0.625 GB per 2 s: even one operator
    # per slot (12 GB + 3 GB of frozen weights) does not fit, so W = 3 slots of one and snapshots stall
    cost = moevement_cost(SETTING, CAL)
    assert cost.window == 3
    assert cost.stall_s == pytest.approx(15 * GB / (2.5 * GB / 8) - 2.0)
    sizes = (12 + 2 + 1, 12 + 1, 6)  # GB: slot 0 carries the later slots' compute weights
    frozen = (3 / 4, 2 / 4, 0.0)  # FLOPs 1, 1, 2: after slot 0, 3/4 frozen; after slot 1, 2/4
    # §3.6: about 3/2 W whole iterations: W conversion iterations (frozen operators skip 1/3) + (W - 1) / 2
    replay = sum(2.0 * (1 - f / 3) for f in frozen) + (3 - 1) / 2 * 2.0
    fetch = sum(sizes) * GB * 8 / (5 * GB)
    assert cost.recovery_s == pytest.approx(10.0 + fetch + replay + 1.0)
    ablated = moevement_cost(SETTING, CAL, ablation=Ablation(skip_bweight=False, localized=False))
    assert ablated.recovery_s == pytest.approx(130.0 + fetch + 3 * 2.0 + 2.0 + 1.0)


# ---- runs ------------------------------------------------------------------------------------------


def test_finite_and_closed_forms_hand_case():
    from simulator.mechanisms import Cost

    res = finite(Cost("x", 0.25, 60.0), 600.0, run_s=6000.0)  # Poisson failures, 60 s recoveries, MTBF 600 s
    assert res.ettr == pytest.approx(math.exp(-0.1) / 1.25)
    assert res.recovery_total_s == pytest.approx(6000.0 * (1 - math.exp(-0.1)))  # < 10 x 60 s: some overlap
    assert res.ettr_closed == pytest.approx(closed_form(0.25, 60.0, 600.0)) == pytest.approx(1 / (1.25 * 1.1))
    lossy = finite(Cost("x", 0.25, 60.0, zero_loss=0.02), 600.0, run_s=6000.0)
    assert lossy.ettr == pytest.approx(0.98 * res.ettr)
    assert finite(Cost("x", 0.25, 60.0), math.inf).ettr == pytest.approx(0.8)


def test_failures_during_recovery_hand_cases():
    # E[min(X, R)] for X ~ Exp(MTBF): MTBF (1 - exp(-R / MTBF))
    assert lost_per_failure(60.0, 600.0) == pytest.approx(600.0 * (1 - math.exp(-0.1)))
    assert lost_per_failure(6000.0, 600.0) == pytest.approx(600.0, rel=1e-4)  # never more than the MTBF
    assert lost_per_failure(60.0, math.inf) == 0.0


def test_moc_dynamic_k_doubles_once_plt_passes_the_budget():
    # Below the budget: 1 lost iteration (period 8: (8-1)/2 x 1/3.5) per failure over >= 500 iterations.
    quiet = moc_run(SETTING, replace(CAL, moc_loss_scale=1 / 3.5), 3600.0, run_s=7200.0)
    assert quiet.moc_fraction == pytest.approx(1 / 8) and quiet.plt < MOC_PLT_BUDGET
    # Above it at the first failure: the fraction doubles at each of the 4 failures, 1/8 -> 1 (capped).
    loud = moc_run(SETTING, replace(CAL, moc_loss_scale=100.0), 1800.0, run_s=7200.0)
    assert loud.moc_fraction == 1.0
    assert loud.overhead > moc_overhead(SETTING, 1 / 8)


# ---- skew and MoEvement's order -------------------------------------------------------------------


def test_dirichlet_skew_hand_cases():
    assert expected_skew(1.0, 2) == pytest.approx(1 / 3)  # HHI = 2/3
    assert expected_skew(alpha_for_skew(0.6, 16), 16) == pytest.approx(0.6)
    assert popularity(None, 4, 2) == [[0.25] * 4] * 2
    draw = popularity(0.01, 8, 3, seed=1)
    assert all(sum(p) == pytest.approx(1.0) for p in draw) and draw == popularity(0.01, 8, 3, seed=1)


def test_round_robin_staleness_hand_case():
    # expert e saved at iterations = e mod 2; at phase 1, expert 0 is 1 iteration stale, expert 1 fresh
    assert round_robin_staleness([0.5, 0.5, 0.0, 0.0], 2, 1) == pytest.approx(0.5)
    assert round_robin_staleness([0.125] * 8, 4, 3) == pytest.approx(1.5)  # uniform: (period - 1) / 2


def test_frozen_fractions_and_popularity_order():
    ops = [Operator(1, 1, 1.0, (0, 0)), Operator(1, 1, 1.0, (0, 1)), Operator(1, 1, 2.0)]
    assert frozen_fractions(ops, [[0], [1], [2]]) == pytest.approx([3 / 4, 2 / 4, 0.0])
    shares = [[0.9, 0.1]]  # expert 0 is popular: reordering saves it after expert 1
    ordered = ordered_operators(ops, shares, reorder=True)
    assert [o.expert for o in ordered] == [(0, 1), (0, 0), None]
    assert [o.flops for o in ordered[:2]] == pytest.approx([0.2, 1.8])  # E x share
    assert [o.expert for o in ordered_operators(ops, shares, reorder=False)] == [(0, 0), (0, 1), None]


def test_own_table4_window_from_the_cap():
    # a dense snapshot takes 3 iterations: slot of a operators of 64: 12a + 2(64 - a) <= 12 * 64 / 3 -> a <= 12.8
    assert window_at_cap(3) == math.ceil(64 / 12)


# ---- the fit and the command line --------------------------------------------------------------------


def test_coordinate_search_and_coordinates_round_trip():
    x, fx = coordinate_search(lambda v: (v[0] - 1.3) ** 2 + (v[1] + 0.7) ** 2, [0.0, 0.0], sweeps=12)
    assert x == pytest.approx([1.3, -0.7], abs=1e-2) and fx < 1e-4
    back = to_calibration(to_coordinates(CAL))
    assert back.nic_efficiency == pytest.approx(0.5) and back.rejoin_s == pytest.approx(30.0)


def test_cli_paper_tables_prints_every_section_and_the_held_out_errors(tmp_path, capsys):
    main(["--paper-tables", "--no-figure", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.endswith(f"\n\nwrote: {tmp_path / 'paper_tables.txt'}\n")
    assert (tmp_path / "paper_tables.txt").read_text() in out
    for section in (
        "table3 ettr",
        "table4 sim-measured %",
        "fig1a",
        "fig11",
        "fig13",
        "fig16",
        "own table4 (recorded bench_moe, commit fbc45b1, 2026-11-26)",
    ):
        assert f"## {section}\n" in out
    summary = out.split("## held-out Table 3 ETTR per strategy")[1].strip().splitlines()[1:5]
    assert [line.split()[0] for line in summary] == ["checkfreq", "gemini", "moc", "moevement"]


def test_cli_paper_tables_writes_its_figure_under_out_and_nothing_in_the_repository(tmp_path, monkeypatch, capsys):
    """The figure that once went to docs/figures/ by default goes to --out; the tracked figures stay as they are
    and nothing lands in the working directory."""
    figures = ROOT / "docs" / "figures"
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in figures.iterdir()}
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    main(["--paper-tables", "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    figure = out / "paper_fig11_simulated.png"
    assert printed[-2:] == [f"wrote: {out / 'paper_tables.txt'}", f"wrote: {figure}"]
    assert figure.read_bytes().startswith(b"\x89PNG") and sorted(out.iterdir()) == [figure, out / "paper_tables.txt"]
    assert not any(cwd.iterdir())
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in figures.iterdir()} == before


def test_zero1_shards_the_state_over_data_parallel_ranks():
    from simulator.setting import from_testbed
    from simulator.testbed import TESTBEDS

    tb = TESTBEDS["GPT-MoE"]  # DP = 4 pipelines
    sharded, whole = from_testbed(tb, zero1=True), from_testbed(tb, zero1=False)
    assert whole.node_state_bytes == pytest.approx(4 * sharded.node_state_bytes)
    assert [o.fp32 for o in whole.operators] == pytest.approx([4 * o.fp32 for o in sharded.operators])
    assert whole.cluster_state_bytes == sharded.cluster_state_bytes == 12 * tb.shape.total_params()


def test_fit_command_prints_and_writes_fit_txt_under_out(tmp_path, capsys):
    from simulator.fit import main as fit_main

    fit_main(["--sweeps", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    written = (tmp_path / "fit.txt").read_text()
    assert written.startswith("fitted on Table 3 rows 2H, 1H (32 ETTR cells)\n") and written in out
    assert out.endswith(f"\n\nwrote: {tmp_path / 'fit.txt'}\n")


def test_recorded_constants_are_what_the_fit_prints():
    from simulator.calibrated import FITTED
    from simulator.fit import fit

    fitted, _ = fit()
    for name, value in vars(FITTED).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-4), name


def test_ablation_steps_hand_case():
    from simulator.ablation import ablation

    rows = ablation(SETTING, CAL, 600.0, skew=0.0)
    fetch, t = 34 * 8 / 5, 2.0  # W = 3 snapshots of 15 + 13 + 6 GB at 5 GB/s
    frozen = (3 / 4, 2 / 4, 0.0)
    expected = [
        130.0 + fetch + 3 * t + t + t / 2,  # sparse only: global restart, every stage replays with the bubble
        130.0 + fetch + sum(t * (1 - f / 3) for f in frozen) + t + t / 2,
        130.0 + fetch + sum(t * (1 - f / 3) for f in frozen) + t + t / 2,  # uniform popularity: same order
        10.0 + fetch + sum(t * (1 - f / 3) for f in frozen) + t + t / 2,  # localized: a local restart
    ]
    assert [r.recovery_s for r in rows] == pytest.approx(expected)
    assert [r.ettr for r in rows] == sorted(r.ettr for r in rows)


def test_skew_moves_moevement_and_moc_not_the_dense_baselines():
    from simulator.skew_study import skew_study

    rows = skew_study(SETTING, replace(CAL, moc_loss_scale=0.5), 1800.0, skews=(0.0, 0.9))
    for s in ("checkfreq", "gemini"):
        assert rows[0].ettr[s] == rows[1].ettr[s]
    assert rows[0].moc_plt != rows[1].moc_plt
    assert rows[1].ettr["moevement"] != rows[0].ettr["moevement"]


# ---- the profile, the failure-independent term and the constants' ranges ------------------------------


def test_snapshot_bandwidth_is_the_idle_nic_share_over_two_replicas_capped():
    from simulator.profile import snapshot_bandwidth

    assert snapshot_bandwidth(SETTING) == pytest.approx(10 * GB * 0.5 / 16)  # line rate x idle / (8 GPUs x 2)
    assert snapshot_bandwidth(replace(SETTING, pcie_bw=0.1 * GB)) == pytest.approx(0.1 * GB)
    assert snapshot_bandwidth(replace(SETTING, snapshot_cap_bw=0.2 * GB)) == pytest.approx(0.2 * GB)


def test_window_comes_from_the_profile_not_the_fitted_constants():
    """Algorithm 1 sees stated bandwidths only: W does not move when a fitted constant does."""
    from simulator.setting import from_testbed
    from simulator.testbed import TESTBEDS

    other = replace(CAL, nic_efficiency=0.9, restart_s=100.0)
    for tb in TESTBEDS.values():
        s = from_testbed(tb)
        assert moevement_cost(s, CAL).window == moevement_cost(s, other).window


def test_zero_loss_is_failure_independent_and_per_strategy():
    lossy = replace(CAL, zero_loss_gemini=0.03)
    for mtbf in (600.0, 7200.0, math.inf):
        a, b = finite(gemini_cost(SETTING, CAL, mtbf), mtbf), finite(gemini_cost(SETTING, lossy, mtbf), mtbf)
        assert b.ettr == pytest.approx(0.97 * a.ettr) and b.recovery_s == a.recovery_s
    assert finite(checkfreq_cost(SETTING, lossy), 600.0).ettr == finite(checkfreq_cost(SETTING, CAL), 600.0).ettr


def test_moc_persist_interval_hand_case():
    from simulator.moc_loss import persist_interval

    # 240 GB over Blob's 5 GB/s = 48 s = 24 iterations of 2 s
    assert persist_interval(SETTING) == pytest.approx(24.0)


def test_every_fitted_constant_lies_in_its_stated_range():
    from dataclasses import asdict

    from simulator.calibrated import FITTED, PLAUSIBLE

    assert set(PLAUSIBLE) == set(asdict(FITTED))
    for name, value in asdict(FITTED).items():
        lo, hi = PLAUSIBLE[name]
        assert lo <= value <= hi, name


@pytest.mark.parametrize(
    "case", [(30.0, 2.0, 60.0, 600.0), (5.0, 1.0, 60.0, 3600.0), (100.0, 3.0, 30.0, 1800.0), (500.0, 0.5, 10.0, 7200.0)]
)
def test_gemini_oracle_maximises_the_run_models_own_ettr(case):
    from simulator.oracle import oracle_interval, poisson_ettr

    best = max(range(1, 20_000), key=lambda k: poisson_ettr(k, *case))
    assert oracle_interval(*case) == best
    assert oracle_interval(0.0, 2.0, 60.0, 600.0) == 1  # a free checkpoint is taken every iteration


def test_window_profile_runs_algorithm_1_on_its_own_numbers(tmp_path, capsys):
    from simulator.profile import WindowProfile

    # 4 operators of 12 GB FP32 / 2 GB compute; 1 s iterations; 80 Gb/s = 10 GB/s, half busy, 1 GPU, 1 replica:
    # 5 GB/s -> budget 5 GB; a slot of one operator carries 12 GB: nothing fits, so W = 4 (one per slot)
    d = {"iteration_s": 1.0, "fp32_bytes": [12e9] * 4, "compute_bytes": [2e9] * 4, "copy_gbs": 100.0}
    d |= {"nic_gbps": 80.0, "nic_busy": 0.5, "gpus_per_node": 1, "replicas": 1}
    p = WindowProfile.from_json(d)
    assert p.bandwidth() == pytest.approx(5e9) and p.window() == (4, 1)
    # no NIC: the 100 GB/s copy alone -> budget 100 GB holds all 48 GB: W = 1
    assert WindowProfile.from_json({**d, "nic_gbps": None}).window() == (1, 4)
    with pytest.raises(ValueError, match="copy_gbs"):
        WindowProfile.from_json({k: v for k, v in d.items() if k != "copy_gbs"})
    path = tmp_path / "gpu.json"
    path.write_text(__import__("json").dumps(d))
    main(["--window-profile", str(path)])
    assert capsys.readouterr().out == "window=4 o_active=1 bandwidth_gbs=5.0000\n"


def test_paper_tables_label_what_derives_from_the_calibration_rows_as_fitted():
    from simulator.calibrated import FITTED
    from simulator.paper_tables import all_cells

    cells = all_cells(FITTED)
    table3 = [c for c in cells if c.section == "table3 ettr"]
    assert all((c.status == "fitted") == (c.label.split()[1] in ("2H", "1H")) for c in table3)
    fig13 = [c for c in cells if c.section == "fig13" and "upstream logging (" in c.label]
    assert len(fig13) == 4 and {c.status for c in fig13} == {"fitted"}  # the 1H row itself
    zero = [c for c in cells if c.section == "table3 zero failures"]
    assert {c.status for c in zero if " moc " not in c.label} == {"fitted"}
    windows = [re.search(r", W (\d+) vs (\d+)\)$", c.label) for c in table3 if " moevement " in c.label]
    assert len(windows) == 20 and all(w and int(w.group(2)) in (3, 5, 6) for w in windows)  # W beside every row
