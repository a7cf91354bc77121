"""A run's record and TensorBoard events, from real train.py processes: one folder per run, a config that
loads back, every pipeline stage's expert load and snapshot figures, no warnings."""

import json
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import (
    BASE,
    DEBUG_CONFIG,
    DEMO_KINDS,
    MOEVEMENT,
    PP2,
    ROOT,
    accounting,
    assert_each_step_once,
    assert_recorded_as_printed,
    baseline,
    recoveries,
    run_cli,
    step_losses,
    steps,
    survivors,
)
from trainer.config import load_config

QUIET = ["--metrics.log_every", "1", "--training.val_every", "0"]


def events(folder):
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    return accumulator


@pytest.mark.slow
def test_two_runs_of_one_job_write_two_folders_with_a_config_that_loads_back(tmp_path):
    overrides = ["--training.steps", "2", "--training.lr", "0.002", "--job.output_dir", str(tmp_path)]
    outs = [run_cli("--config", DEBUG_CONFIG, *QUIET, *overrides).stdout for _ in range(2)]
    folders = sorted((tmp_path / "debug_moe").iterdir())
    assert len(folders) == 2, folders
    for folder, out in zip(folders, outs):
        assert f"run: {folder}" in out
        # the start resolved: from the initial state (`load_step 0`, not the default -1: the config reruns it)
        resolved = [*QUIET, *overrides, "--checkpoint.load_step", "0"]
        assert load_config(str(folder / "config.toml")) == load_config(str(ROOT / DEBUG_CONFIG), resolved)
        record = json.loads((folder / "run.json").read_text())
        assert "--training.lr 0.002" in record["command"] and record["torch"] == torch.__version__
        assert record["layout"] == {"pp": 1, "dp": 1, "ep": 1} and record["world_size"] == 1
        assert record["resumed_from"] is None and len(record["lineage"]) == 16
        if (ROOT / ".git").exists():
            assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", record["git_commit"] or ""), record
        assert [e.step for e in events(folder).Scalars("train/loss")] == [1, 2]  # each run its own steps


@pytest.mark.slow
def test_tensorboard_shows_every_stage_and_a_normal_run_warns_about_nothing(tmp_path):
    """pp=2: rank 0's events hold the expert load of both stages' MoE layers (layers 1 and 2 of the debug
    model, one per stage) as per-layer scalars and a heatmap, and each stage's snapshot figures."""
    proc = run_cli(
        "--config",
        DEBUG_CONFIG,
        *QUIET,
        *("--training.steps", "4", "--parallelism.pp", "2", "--metrics.tensorboard_every", "2"),
        *("--checkpoint.strategy", "moevement", "--checkpoint.window", "2"),
        *("--checkpoint.host_dir", str(tmp_path / "shm"), "--job.output_dir", str(tmp_path)),
        nproc=2,
        env={"PYTHONWARNINGS": "error::UserWarning"},
    )
    assert "Warning" not in proc.stderr, proc.stderr
    (folder,) = (tmp_path / "debug_moe").iterdir()
    tb = events(folder)
    for layer in (1, 2):
        loads = tb.Scalars(f"expert_load/layer_{layer}_max_over_mean")
        assert [e.step for e in loads] == [2, 4] and all(e.value >= 1 for e in loads)
    assert [e.step for e in tb.Images("expert_load/heatmap")] == [2, 4]
    for stage in (0, 1):
        assert tb.Scalars(f"snapshot/pp{stage}/window")[-1].value == 2
        assert tb.Scalars(f"snapshot/pp{stage}/host_mb")[-1].value > 0
        # host memory: the resident set of a rank running torch is tens of MB at least, and the peak >= it
        rss, peak = (tb.Scalars(f"memory/pp{stage}/{key}") for key in ("rss_mb", "peak_rss_mb"))
        assert [e.step for e in rss] == [e.step for e in peak] == [2, 4]
        assert all(50 < r.value <= p.value for r, p in zip(rss, peak)), [(r.value, p.value) for r, p in zip(rss, peak)]
        assert peak[0].value <= peak[1].value  # a peak so far never falls
    assert json.loads((folder / "run.json").read_text())["layout"]["pp"] == 2


@pytest.mark.parametrize(("strategy", "scope_ranks"), [("moevement", 1), ("gemini", 2)])
@pytest.mark.slow
def test_tensorboard_marks_each_recovery_at_the_step_it_struck(tmp_path, strategy, scope_ranks):
    """pp=2, rank 1 fails before iteration 6: rank 0's events hold one `fault/` point per figure at step 6,
    with the figures of the printed recovery line (MoEvement rolls back stage 1's one rank, gemini both)."""
    proc = run_cli(
        "--config",
        DEBUG_CONFIG,
        *QUIET,
        *("--training.steps", "7", "--parallelism.pp", "2", "--fault.at", "6:1", "--metrics.tensorboard_every", "2"),
        *("--checkpoint.strategy", strategy, "--checkpoint.window", "2", "--checkpoint.interval", "2"),
        *("--checkpoint.host_dir", str(tmp_path / "shm"), "--job.output_dir", str(tmp_path)),
        nproc=2,
    )
    found = recoveries(proc.stdout)
    assert found, proc.stdout
    line = found[0]
    wall = accounting(proc.stdout).recovery_s  # the loop's time of it
    (folder,) = (tmp_path / "debug_moe").iterdir()
    tb = events(folder)
    fault = {key: tb.Scalars(f"fault/{key}") for key in ("ranks_failed", "scope_ranks", "rollback_to", "replayed")}
    assert {key: [(e.step, e.value) for e in points] for key, points in fault.items()} == {
        "ranks_failed": [(6, 1)],
        "scope_ranks": [(6, scope_ranks)],
        "rollback_to": [(6, line.rollback_to)],
        "replayed": [(6, line.replayed)],
    }, proc.stdout
    assert (line.step, line.ranks) == (6, (1,)) and line.rollback_to < 6
    (seconds,) = tb.Scalars("fault/recovery_s")
    # the line's seconds (printed to 1 ms), within the loop's time of the recovery
    assert seconds.step == 6 and abs(seconds.value - line.seconds) <= 5e-4, (seconds, proc.stdout)
    assert seconds.value <= wall + 5e-4, (seconds, wall)
    scalars = tb.Tags()["scalars"]
    assert "memory/pp1/rss_mb" in scalars and "memory/pp1/cuda_max_allocated_mb" not in scalars  # a CPU run


@pytest.mark.slow
def test_tensorboard_marks_a_real_death_replaced_in_place(tmp_path):
    """pp=2 under torchrun: rank 1 SIGKILLs itself in the backward pass of step 5 and its standby replaces it;
    the next generation's rejoin is marked on rank 0's events at the step its recovery line names."""
    proc = run_cli(
        "--config",
        DEBUG_CONFIG,
        *QUIET,
        *("--training.steps", "7", "--parallelism.pp", "2", "--fault.kill", "5:1:backward"),
        *("--checkpoint.strategy", "moevement", "--checkpoint.window", "2", "--metrics.tensorboard_every", "2"),
        *("--checkpoint.host_dir", str(tmp_path / "shm"), "--job.output_dir", str(tmp_path)),
        nproc=2,
        torchrun=("--max-restarts=0",),
    )
    replaced = [r for r in recoveries(proc.stdout) if (r.ranks, r.scope, r.restart) == ((1,), (1,), "replaced")]
    assert replaced, proc.stdout
    (folder,) = (tmp_path / "debug_moe").iterdir()
    tb = events(folder)
    step, rollback_to = replaced[0].step, replaced[0].rollback_to
    points = {key: [(e.step, e.value) for e in tb.Scalars(f"fault/{key}")] for key in ("ranks_failed", "rollback_to")}
    assert points == {"ranks_failed": [(step, 1)], "rollback_to": [(step, rollback_to)]}, proc.stdout


# In the default suite: a later rank 0 logging late what its predecessor could not, each iteration once, in
# TensorBoard too (tests/test_event_records.py, the test named
# `test_each_iteration_is_logged_once_and_a_later_rank_0_logs_what_its_predecessor_could_not`), and a real
# death's run recorded as printed, each iteration once
# (tests/test_real_deaths.py::test_sigkill_in_backward_is_replaced_in_place).
@pytest.mark.slow
def test_rank_0s_death_logs_every_iteration_once_and_records_every_line(tmp_path):
    """Every iteration logged exactly once, whoever dies; the records are the truth.
    pp=2 under torchrun: rank 0, the logging rank, SIGKILLs itself in the optimizer step of iteration 6, after
    the gradient-norm all-reduce: rank 1 finishes 6 and its standby replaces rank 0, continuing the run folder.
    The replacement logs 6 (a late line of the scalars the survivors' log kept) once its recovery is done, and
    training goes on at 7 (the recovery's step). `events.jsonl` holds each iteration once, with the fault-free
    run's loss, and TensorBoard's `train/loss` too; every line printed of a recorded kind is one record, from
    whichever rank printed it, and reads back into that line byte for byte."""
    proc = run_cli(
        *BASE,
        *PP2,
        *MOEVEMENT,
        *("--metrics.tensorboard", "true", "--training.val_every", "4", "--fault.kill", "6:0:optimizer"),
        *("--checkpoint.host_dir", str(tmp_path / "shm"), "--job.output_dir", str(tmp_path)),
        nproc=2,
        torchrun=("--max-restarts=0",),
    )
    (folder,) = (tmp_path / "debug_moe").iterdir()  # the replacement continued the folder
    recorded = assert_recorded_as_printed(proc.stdout)
    assert_each_step_once(recorded, baseline(PP2, 2))
    assert {e.KIND for e in recorded} >= DEMO_KINDS | {"validation"}, recorded
    [recovery] = recoveries(recorded)
    late = [line for line in steps(recorded) if line.late]
    assert [line.step for line in late] == [6] and (recovery.step, recovery.fault_step) == (7, 6), proc.stdout
    assert recorded.index(late[0]) > recorded.index(recovery)  # logged once the survivors' scalars are back
    assert [(s.what, s.rank, s.step) for s in survivors(recorded)] == [("rejoins", 1, 7)], proc.stdout
    tensorboard = [(e.step, e.value) for e in events(folder).Scalars("train/loss")]
    assert [step for step, _ in tensorboard] == list(range(1, 13)), tensorboard
    assert [value for _, value in tensorboard] == pytest.approx(list(step_losses(recorded).values()), rel=1e-6)
