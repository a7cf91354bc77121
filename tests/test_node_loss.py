"""A whole node lost (docs/design/lifecycle/replacement.md, "A lost node"): the torchrun agent and every worker are
SIGKILLed at once, the node's host memory (`checkpoint.host_dir`) is gone, and the job is launched again: it restarts
from the sparse checkpoints it persisted to `checkpoint.persist_dir` and ends with the fault-free run's state."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from benchmarks.emulated_nodes import kill_all, process_tree
from tests.helpers import (
    BASE,
    CHILD_ENV,
    MOEVEMENT,
    PP2,
    ROOT,
    RUN_OUTPUTS,
    baseline,
    final_line,
    reached,
    run_cli,
    step_losses,
)

# windows of 6 iterations (3-8, 9-14), so that stage 0 has an empty slot (its persisted `s5.bin` has 0 bytes);
# the window 3-8 is persisted by iteration 12
LAYOUT = [*PP2, "--training.steps", "16"]
KILL_AFTER = 12  # the iteration recorded before the node is lost


def launch_and_lose_the_node(args: list[str]) -> str:
    """Run torchrun (agent + 2 workers) and SIGKILL the agent and every worker at once once the run has
    recorded iteration `KILL_AFTER` (rank 0 records each iteration before its line); the output until then."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    proc = subprocess.Popen(
        [*cmd, "train.py", *args, "--job.output_dir", str(RUN_OUTPUTS)],
        cwd=ROOT,
        env=CHILD_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if reached("".join(seen), KILL_AFTER):
                break
    finally:
        kill_all(process_tree(proc.pid))
        proc.wait(timeout=60)
    return "".join(seen)


@pytest.mark.slow
def test_a_relaunch_after_a_whole_node_loss_resumes_from_disk_bit_exactly(tmp_path):
    args = [
        *BASE,
        *LAYOUT,
        *MOEVEMENT,
        "--checkpoint.window",
        "6",
        "--checkpoint.host_dir",
        str(tmp_path / "shm"),
        "--checkpoint.persist_dir",
        str(tmp_path / "disk"),
    ]
    before = launch_and_lose_the_node(args)
    assert reached(before, KILL_AFTER), before
    shutil.rmtree(tmp_path / "shm")  # the node's memory went with it
    persisted = list((tmp_path / "disk").rglob("s*.bin"))
    assert any(p.stat().st_size == 0 for p in persisted), persisted  # an empty slot is among them

    out = run_cli(*args, nproc=2, torchrun=("--max-restarts=1",)).stdout
    reference = baseline(LAYOUT, 2)
    resumed = step_losses(out)
    assert 1 < min(resumed) <= 13, out  # restarted from a persisted window, not from step 1
    assert resumed == {s: v for s, v in step_losses(reference).items() if s in resumed}
    assert final_line(out) == final_line(reference)


def test_any_fault_of_one_copy_rejects_it_and_the_next_copy_is_used(capsys):
    """Whatever reading one copy raises (a malformed header's ValueError, a missing key, an I/O error), that
    copy is rejected with one line naming it and the next copy of the same window is loaded."""
    from moevement.recovery.restart import _Copy, _load_first_intact

    def failing(error: Exception):
        def load():
            raise error

        return _Copy(f"copy raising {type(error).__name__}", load, False, lambda h: "")

    good = _Copy("good copy", lambda: [], False, lambda h: "")
    errors = [ValueError("count (-1)"), KeyError("slot"), TypeError("bad"), OSError(5, "I/O error")]
    loaded = _load_first_intact(0, [*map(failing, errors), good], lambda header, source: None)
    assert loaded == ([], "good copy")
    rejected = capsys.readouterr().out.splitlines()
    for line, error in zip(rejected, errors, strict=True):
        assert line.startswith(f"restart: rank 0 rejected copy raising {type(error).__name__}: "), line
