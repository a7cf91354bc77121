"""Periodic dense checkpoints (`checkpoint.dense_interval`, trainer/checkpoint/periodic.py), through real
train.py processes and real files: each holds the state of its iteration exactly, the newest
`checkpoint.keep_latest` are kept, one killed mid-write leaves the earlier ones intact and loadable, and a
recovery in the same job deletes none."""

import os
import re

import pytest

from tests.helpers import BASE, MOEVEMENT, PP2, final_line, run_cli, step_losses


def train(*args: str, **kw):
    return run_cli(*BASE, "--training.steps", "6", *args, **kw)


def test_a_periodic_checkpoint_killed_mid_write_leaves_the_previous_ones_loadable(tmp_path):
    """Saves after steps 2 and 4 (keep_latest 2), then SIGKILL while step 6's files are written: step-2 and
    step-4 are published, step 6 is only a marked temporary. `--checkpoint.load_step -1` says it loads
    step 4 and trains to the uninterrupted run's digest; the dead writer's temporary is removed."""
    folder = tmp_path / "ck"
    saving = ["--checkpoint.dense_interval", "2", "--checkpoint.keep_latest", "2", "--checkpoint.folder", str(folder)]
    strategy = [*MOEVEMENT, "--checkpoint.host_dir", str(tmp_path / "shm")]  # fault.kill needs one
    killed = train(*saving, *strategy, "--fault.kill", "6:0:dense_save", check=False)
    assert killed.returncode == -9 and "fault: rank 0 killed (SIGKILL)" in killed.stdout, killed.stderr
    for step in (2, 4):
        assert f"checkpoint: saved step {step} to {folder / f'step-{step}'}" in killed.stdout
    entries = sorted(os.listdir(folder))
    assert entries[1:] == ["step-2", "step-4"] and entries[0].startswith(".step-6.tmp-"), entries
    assert len(entries) == 3 and "meta.json" not in os.listdir(folder / entries[0])
    resumed = train(*saving, "--checkpoint.load_step", "-1").stdout
    assert f"checkpoint: loaded step 4 from {folder / 'step-4'}" in resumed
    assert sorted(step_losses(resumed)) == [5, 6]
    assert final_line(resumed) == final_line(train().stdout)
    assert sorted(os.listdir(folder)) == ["step-4", "step-6"]  # the stale temporary went, step 2 was pruned


@pytest.mark.slow
def test_load_step_errors_are_one_line(tmp_path):
    """A step the folder does not hold, `load_step` beside `load`, and a `dense_save` kill on a step that is
    not saved: one `error:` line each, naming the key."""
    folder = ["--checkpoint.folder", str(tmp_path / "none")]
    cases = [
        (("--checkpoint.load_step", "3", *folder), r"checkpoint.load_step: no checkpoint of step 3 in .*none"),
        (("--checkpoint.load_step", "3", "--checkpoint.load", str(tmp_path)), r"checkpoint.load_step.*give one"),
        ((*MOEVEMENT, "--checkpoint.dense_interval", "4", "--fault.kill", "6:0:dense_save"), r"fault.kill.*step 6"),
    ]
    for args, pattern in cases:
        proc = train(*args, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1 and re.search(pattern, errors[0]), proc.stderr


@pytest.mark.slow
def test_periodic_checkpoints_of_a_pipeline_survive_a_recovery(tmp_path):
    """pp=2 under torchrun: every rank writes its own files in the background and rank 0 publishes each
    step once both ranks recorded theirs. Rank 1 dies at step 5 and is replaced in place; no checkpoint is
    deleted, and each loads to the uninterrupted run's digest."""
    folder = tmp_path / "ck"
    saving = ["--checkpoint.dense_interval", "3", "--checkpoint.folder", str(folder)]
    layout = [*BASE, *PP2, "--checkpoint.host_dir", str(tmp_path / "shm")]
    out = run_cli(*layout, *MOEVEMENT, *saving, "--fault.kill", "5:1:backward", nproc=2).stdout
    assert "replaces it in generation 1" in out, out
    assert sorted(os.listdir(folder)) == ["step-12", "step-3", "step-6", "step-9"], out
    reference = final_line(run_cli(*layout, nproc=2).stdout)
    assert final_line(out) == reference
    for step in (3, 9):
        resumed = run_cli(*layout, "--checkpoint.load", str(folder / f"step-{step}"), nproc=2).stdout
        assert f"checkpoint: loaded step {step} from" in resumed and final_line(resumed) == reference
