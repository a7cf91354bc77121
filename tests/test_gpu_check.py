"""The prepared GPU check (benchmarks/gpu_check) stays alive without a GPU: it exits 0 saying so, and the
parts that run on CPU (report arithmetic, the numerics and throughput code, section 2's overhead figures from
given step lines, the shared-GPU collectives on gloo, section 6's SIGKILL and in-place replacement on gloo)
are exercised here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.gpu_check import gil_profile, issue_cost, numerics, overhead, replacement, stage_snapshot, throughput
from benchmarks.gpu_check.__main__ import SECTIONS
from benchmarks.gpu_check.report import (
    Check,
    Section,
    bf16_peak_flops,
    compare,
    run_section,
    summary,
    throughput_fields,
)
from benchmarks.gpu_check.shared_gpu import LINE
from models.experts import GROUPED_MM_FLOPS
from parallelisms.distributed import default_backend
from tests.helpers import CHILD_ENV, ROOT
from trainer.event_writer import append_event
from trainer.records.event_lines import StepLine

SHARED_WHEELS = ROOT.parent / "shared" / "wheels"  # torchdata and py-spy for the lent GPU machine


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check runs for real (make gpu-check)")
def test_without_cuda_the_check_says_so_in_one_line_and_exits_0():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "gpu-check: no CUDA device (torch.cuda.is_available() is False): nothing to check here, exiting 0"
    ]


def test_seven_sections_within_nine_minutes_the_sixth_the_in_place_replacement():
    """Every section's budget together stays under the 10 minutes one command may run on a lent GPU."""
    assert [number for number, *_ in SECTIONS] == [1, 2, 3, 4, 5, 6, 7]
    assert sum(budget for _, _, budget, _ in SECTIONS) <= 9 * 60
    assert SECTIONS[5][3] is replacement.run


def test_section_6_skips_with_its_reason_while_the_trainer_joins_nccl_on_cuda():
    """Today's trainer: its CUDA default group names nccl, so section 6 says why in one line and runs nothing."""
    assert "nccl" in default_backend("cuda")
    section = run_section(Section(6, "replacement", 5), replacement.run)
    assert section.status == "SKIP" and not section.checks
    assert len(section.lines()) == 2 and section.lines()[-1].startswith("  SKIP train.py cannot run two ranks")
    assert replacement.blocker("cpu:gloo,cuda:gloo") == ""
    assert summary([section], 0.1) == "gpu-check PASS: [6]=SKIP (0 failed) in 0 s"


def test_gil_shares_count_snapshot_work_by_thread_during_iterations():
    """py-spy's raw lines: start-up samples of the training thread are left out; snapshot frames are counted
    for the training thread (told by its id: py-spy does not always name it) and for any other thread (a copy
    thread's work would fail the check)."""
    raw = "\n".join(
        [
            "thread (1): MainThread;<module> (train.py:10);_find_and_load (<frozen importlib._bootstrap>:1) 500",
            "thread (1): MainThread;main (train.py:9);iteration (train.py:337);forward (models/moe.py:5) 90",
            "thread (1);iteration (train.py:338);begin (moevement/checkpoint/checkpointer.py:130) 6",
            "thread (2): moevement-copy;_copy (moevement/checkpoint/in_flight.py:165);copy (x) 3",
            "thread (3): pin_memory;loop (torch/utils/data/x.py:1) 1",
        ]
    )
    counts, hotspots = gil_profile.gil_shares(raw)
    assert dict(counts) == {"iterations": 100, "other": 4, "training_snapshot": 6, "other_snapshot": 3}
    assert dict(hotspots) == {"begin (moevement/checkpoint/checkpointer.py:130)": 6}


def test_gil_section_skips_without_py_spy(monkeypatch):
    monkeypatch.setattr(gil_profile.shutil, "which", lambda name: None)
    section = run_section(Section(7, "gil", 45), gil_profile.run)
    assert section.status == "SKIP" and section.lines()[-1].startswith("  SKIP py-spy is not installed")


def test_overhead_fields_median_and_spread_of_the_rounds():
    line = overhead.overhead_fields([1.05, 1.01, 1.10, 1.02, 1.04])
    assert line == "overhead=+0.0400 (median of 5 interleaved rounds, min +0.0100, max +0.1000)"


def recorded_run(folder: Path, steps: list[dict[str, float]]) -> str:
    """A run's stdout naming `folder`, whose events hold one `step` record per item of `steps` (from 1)."""
    folder.mkdir()
    for t, fields in enumerate(steps, 1):
        append_event(folder, StepLine(t, tuple(fields.items())))
    return f"run: {folder}\n"


def test_overhead_section_alternates_the_order_and_reports_every_round(monkeypatch, tmp_path):
    """Section 2's figures from given step records (no train.py): none and moevement alternate which runs
    first, and the line shows the median and spread of all five rounds (moevement 10% slower in each)."""
    order = []

    def fake_train(args: list[str], timeout_s: float) -> str:
        strategy = args[args.index("--checkpoint.strategy") + 1]
        order.append(strategy)
        ms, mb = (110.0, 5.0) if strategy == "moevement" else (100.0, 0.0)
        tok_per_s = overhead.BATCH * overhead.SEQ_LEN / ms * 1e3
        step = {"loss": 1.0, "tok_per_s": tok_per_s, "window": 1, "stall_ms": 0.1, "ckpt_mb": mb}
        return recorded_run(tmp_path / f"run{len(order)}", [step] * 18)

    monkeypatch.setattr(overhead, "train", fake_train)
    section = Section(2, "overhead", 10)
    checks = overhead.overhead_checks(SimpleNamespace(common=lambda job: []), section)
    assert order == ["none", "moevement", "moevement", "none"] * 2 + ["none", "moevement"]
    assert [c.ok for c in checks] == [True]
    assert "overhead=+0.1000 (median of 5 interleaved rounds, min +0.1000, max +0.1000)" in section.notes[0]


def test_in_process_block_pairs_give_the_snapshots_own_cost(monkeypatch, tmp_path):
    """Section 2's one-process run: snapshots in every other block of AB_BLOCK iterations, 5% slower there."""

    def fake_train(args: list[str], timeout_s: float) -> str:
        assert args[args.index("--checkpoint.ab_blocks") + 1] == str(overhead.AB_BLOCK)
        steps = []
        for t in range(1, overhead.AB_STEPS + 1):
            on = t > 2 and (t // overhead.AB_BLOCK) % 2 == 0
            tok_per_s = overhead.BATCH * overhead.SEQ_LEN / (105.0 if on else 100.0) * 1e3
            steps.append({"loss": 1.0, "tok_per_s": tok_per_s, "ckpt_mb": 5.0 if on else 0.0})
        return recorded_run(tmp_path / "ab", steps)

    monkeypatch.setattr(overhead, "train", fake_train)
    section = Section(2, "overhead", 10)
    checks = overhead.in_process_checks(SimpleNamespace(common=lambda job: []), section)
    assert [c.ok for c in checks] == [True]
    count = len(range(overhead.AB_START, overhead.AB_STEPS - 2 * overhead.AB_BLOCK + 2, 2 * overhead.AB_BLOCK))
    pairs = " ".join(["+0.050"] * count)
    assert section.notes == [
        f"ab_overhead=+0.0500 (median of {count} block pairs in one process, min +0.0500, max +0.0500) "
        f"iter_ms with=105.0 without=100.0 pairs: {pairs}"
    ]


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla T4", None),
    ],
)
def test_bf16_peak_by_device_name(name, peak):
    assert bf16_peak_flops(name) == peak


def test_throughput_fields_mfu_against_the_peak_or_flops_only():
    line = throughput_fields(flops=989e12, tokens=8192, seconds=2.0, device_name="NVIDIA H100 80GB HBM3")
    assert line == "tokens_per_s=4096 tflops=494.5 mfu=0.500 (peak 989 TFLOP/s)"
    unknown = throughput_fields(flops=1e12, tokens=100, seconds=0.5, device_name="Tesla T4")
    assert unknown == "tokens_per_s=200 tflops=2.0 mfu=unknown (GPU not in the peak table)"


def test_compare_elementwise_and_relative_l2():
    ref = torch.linspace(1.0, 2.0, 100)
    assert compare("near", ref + 1e-7, ref, atol=1e-6).ok
    assert not compare("far", ref + 1e-3, ref, atol=1e-6, rtol=1e-4).ok
    outlier = ref.clone()
    outlier[0] += 0.5  # one element far off (a flipped routing decision), the vector close
    assert not compare("elementwise", outlier, ref, atol=1e-3).ok
    assert compare("l2", outlier, ref, rel_l2=0.05).ok
    assert not compare("nan", torch.full_like(ref, float("nan")), ref, rel_l2=0.05).ok
    assert not compare("shape", ref[:10], ref, atol=1.0).ok


def test_a_failing_section_reports_its_first_line_and_the_next_still_runs():
    def broken(section: Section) -> None:
        raise RuntimeError("No backend type associated with device type cpu\nlong traceback text")

    def fine(section: Section) -> None:
        section.checks.append(Check("ok", True, "fine"))

    first = run_section(Section(1, "broken", 10), broken)
    second = run_section(Section(2, "fine", 10), fine)
    assert first.status == "FAIL"
    assert first.lines()[-1] == "  FAIL error: RuntimeError: No backend type associated with device type cpu"
    assert second.status == "PASS"
    assert re.fullmatch(r"gpu-check FAIL: \[1\]=FAIL \[2\]=PASS \(1 failed\) in 3 s", summary([first, second], 3.2))
    slow = run_section(Section(3, "slow", 0.0), fine)
    assert slow.status == "FAIL" and "time budget" in slow.lines()[-1]


def test_numerics_section_code_runs_on_cpu():
    """Section 1's code on CPU: fp32 against itself is exact, bf16 against fp32 within its stated bound."""
    section = run_section(Section(1, "numerics", 120), lambda s: numerics.run(s, "cpu"))
    assert section.status == "PASS", "\n".join(section.lines())
    assert [c.name for c in section.checks] == [
        "fp32 loss",
        "fp32 grads",
        "bf16 loss",
        "bf16 grads",
        "grouped GEMM bfloat16 vs loop",
        "grouped GEMM float32 vs loop",
    ]


@pytest.mark.slow
def test_16b_stage_flop_count_is_six_times_active_parameters_per_token():
    """The counted FLOPs of a 16B-shaped MoE layer (short sequences: attention scores negligible) are 6 x its
    active parameters per token (norm scales aside): the routed experts' grouped GEMMs are counted
    (GROUPED_MM_FLOPS)."""
    stage, dim = throughput.moe_stage(1, torch.device("cpu"))
    moe = stage.moe_layers()["1"]
    idle = (moe.n_experts - moe.top_k) * moe.experts.params_per_expert()
    active = sum(p.numel() for p in stage.parameters()) - idle
    x = throughput.stage_input(dim, torch.device("cpu"), tokens=16)
    with FlopCounterMode(display=False, custom_mapping=GROUPED_MM_FLOPS) as counter:
        throughput.fwd_bwd(stage, x)
    assert 0.99 < counter.get_total_flops() / (6 * active * x.shape[0] * x.shape[1]) < 1.02


@pytest.mark.slow
def test_shared_gpu_collectives_run_on_two_gloo_processes():
    """Section 5's worker on CPU (plain gloo): the same trainer functions, two real processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, "-m", "benchmarks.gpu_check.shared_gpu", "cpu"],
        cwd=ROOT,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = sorted((int(rank), name, ok) for rank, name, ok, _ in LINE.findall(proc.stdout))
    names = ("boundary_logs", "scalars", "tensorboard")
    assert found == [(rank, name, "1") for rank in (0, 1) for name in names], proc.stdout


@pytest.mark.slow
def test_replacement_section_runs_on_two_gloo_processes(monkeypatch):
    """Section 6's real runs on CPU (plain gloo): rank 1 SIGKILLed in backward, its standby replaces it in
    place, and the run ends with the fault-free digest (45-100 s on two shared CPU cores)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    section = run_section(Section(6, "replacement", 600), replacement.run_replacement)
    assert section.status == "PASS", "\n".join(section.lines())
    assert len(section.checks) == 5


def test_issue_cost_layout_is_section_twos_snapshot_shape():
    """The layout section 2 times the issue of (per expert slice: FP32 weight, two moments, bf16 compute
    weight), on CPU with shorter slices: 2,688 entries, in the order a W=1 snapshot lays them out."""
    entries, sources, nbytes = issue_cost.stacked_layout(torch.device("cpu"), rows=2)
    assert len(entries) == len(sources) == 2688
    assert [e.role for e in entries[:3]] == ["master"] * 3 and entries[-1].role == "compute"
    assert nbytes == 7 * 3 * 32 * (3 * 2 * 512 * 4 + 2 * 512 * 2)


# ---- the device script and the 16B-shaped stage's snapshot experiment -----------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs every part for real")
@pytest.mark.parametrize("carried", [False, True], ids=["no-wheels", "wheels"])
def test_on_device_script_without_cuda_skips_each_part_in_one_line_and_writes_its_log(tmp_path, carried):
    """benchmarks/gpu_check/on_device.sh on this CPU machine: its setup installs the carried wheels into the
    carried folder (or says how to carry them), then every part says SKIP in one line, exit 0, and the log
    under $OUT holds what it printed."""
    wheels = tmp_path / "whl"
    if carried:
        if not SHARED_WHEELS.is_dir():
            pytest.skip(f"{SHARED_WHEELS} is not here")
        shutil.copytree(SHARED_WHEELS, wheels)
    out = tmp_path / "out"
    env = {**CHILD_ENV, "OUT": str(out), "WHEELS": str(wheels), "PYTHON": sys.executable}
    script = ROOT / "benchmarks" / "gpu_check" / "on_device.sh"
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line for line in lines if "SKIP" in line] == [
        f"on_device: {part} SKIP: no CUDA device (torch.cuda.is_available() is False)"
        for part in ("overhead", "checks", "stage16b")
    ]
    assert re.fullmatch(r"on_device: setup PASS in \d+ s \(budget 20 s; log .*/setup\.log\)", lines[-5])
    assert lines[-1].startswith("on_device: done in ") and "no CUDA device, nothing measured" in lines[-1]
    assert (out / "on_device.log").read_text() == proc.stdout
    if carried:
        site = wheels / "site"
        assert (site / "torchdata" / "__init__.py").is_file() and os.access(site / "bin" / "py-spy", os.X_OK)
        assert f"in {site}" in proc.stdout and "torchdata importable" in proc.stdout and "py-spy 0.4" in proc.stdout
    else:
        assert "mkdir -p .whl && cp ../shared/wheels/*.whl .whl/" in proc.stdout and 'carry=[".whl"]' in proc.stdout


FAKE_PYTHON = """#!/usr/bin/env bash
# stands for a python with CUDA: the setup's probe says so; a part prints its command (section 2's fails)
if [ "$1" = - ]; then cat >/dev/null; echo True; echo "torchdata importable torch x CUDA 13.0 GPU: Fake"; exit; fi
echo "ran $*"
[ "$*" != "-m benchmarks.gpu_check --only 2" ]
"""


def test_on_device_script_runs_each_part_within_its_budget_and_reports_it(tmp_path):
    """The script's CUDA path with a python that claims a GPU: each part's command runs with its timeout, its
    output lands in its own log and the whole log, and one failing part fails the script (exit 1)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**CHILD_ENV, "OUT": str(out), "WHEELS": str(tmp_path / "none"), "PYTHON": str(fake)}
    script = ROOT / "benchmarks" / "gpu_check" / "on_device.sh"
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    ran = {"overhead": "--only 2", "checks": "--only 1,3,4,5,6,7"}
    for part, args in ran.items():
        assert (out / f"{part}.log").read_text() == f"ran -m benchmarks.gpu_check {args}\n"
    assert (out / "stage16b.log").read_text() == "ran -m benchmarks.gpu_check.stage_snapshot\n"
    verdicts = re.findall(r"^on_device: (\w+) (PASS|FAIL \(exit 1\)) in \d+ s \(budget (\d+) s", proc.stdout, re.M)
    assert verdicts == [
        ("setup", "PASS", "20"),
        ("overhead", "FAIL (exit 1)", "300"),
        ("checks", "PASS", "145"),
        ("stage16b", "PASS", "75"),
    ]
    # each part may run until the 9 minutes planned so far are spent
    limits = [int(x) for x in re.findall(r"starts, timeout (\d+) s", proc.stdout)]
    assert all(planned - 30 < limit <= planned for limit, planned in zip(limits, [20, 320, 465, 540], strict=True))
    assert proc.stdout.rstrip().endswith(f"a part failed; log {out}/on_device.log")
    assert (out / "on_device.log").read_text() == proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU it runs the stage for real")
def test_stage_experiment_without_cuda_says_so_in_one_line(capsys):
    assert stage_snapshot.main([]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "stage16b: no CUDA device (torch.cuda.is_available() is False): nothing to measure here, exiting 0"
    ]


def test_stage_arithmetic_snapshot_bytes_copy_time_and_fitting_layers():
    """Each snapshot of a window recorded by metrics.profile: its slot's FP32 state and the later slots' compute
    weights; the copy time of the largest at the measured bandwidth; layers whose buffers fit the host."""
    profile = {"fp32_bytes": [12e9, 12e9, 12e9, 12e9, 6e9], "compute_bytes": [2e9] * 4 + [1e9], "window": 2}
    assert stage_snapshot.planned_snapshot_bytes(profile) == [36e9 + 3e9, 18e9]
    line = stage_snapshot.copy_fields([39e9, 18e9], copy_gbs=50.0, iteration_s=1.56)
    assert line == (
        "snapshot_gb planned largest=39.00 mean=28.50 copy_s largest=0.780 (0.50 of the planned iteration 1.560 s "
        "at 50.0 GB/s)"
    )
    per_layer = 588_000_000
    need = stage_snapshot.HOST_BYTES_PER_PARAM * per_layer  # 54 bytes a parameter: 31.8 GB
    assert [stage_snapshot.fitting_layers(2, per_layer, free) for free in (need, 1.25 * need, 2.5 * need)] == [0, 1, 2]


@pytest.mark.slow
def test_stage_dry_run_at_a_window_gives_the_host_and_pinned_bytes():
    """The stage's command line at W=2 under --dry-run (the arithmetic the experiment prints beside its run)."""
    args = [*stage_snapshot.stage_args(1, 8), "--checkpoint.strategy", "moevement", "--checkpoint.window", "2"]
    proc = subprocess.run(
        [sys.executable, "train.py", *args, "--dry-run"], cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(
        r"dry-run host_dir_gb=[\d.]+ snapshots_gb=[\d.]+ pinned_gb=[\d.]+", stage_snapshot.dry_run_fields(proc.stdout)
    )
    assert stage_snapshot.dry_run_fields("params total=1") == "dry-run printed no host/pinned lines"
