"""Real deaths (docs/design.md §4): a worker process dies (SIGKILL, or an exit) under `torchrun --max-restarts`;
the survivors keep their live state, torchrun restarts every process, and only the dead ranks' stages replay.

Every case is compared with the fault-free run of its layout: every later `step=` loss and the final
`state_digest` are equal, and the healthy stages' `recovery work` lines show no forward or backward."""

from __future__ import annotations

import re

import pytest

from tests.conftest import final_line, run_cli, step_losses
from tests.test_recovery import BASE, INTERLEAVED, MOEVEMENT, PP2_DP2_EP2_BF16, PP4, WORK, baseline

PP2 = ["--parallelism.pp", "2"]
REJOIN = re.compile(
    r"^recovery step=(\d+) ranks=(\S+) scope=(\S+) rollback_to=(\d+) replayed=(\d+) seconds=\S+ "
    r"\(keep=\S+ restart=\S+ setup=\S+ fetch=\S+ convert=\S+ catchup=\S+\) restart=local detected_by=",
    re.M,
)


def death_run(tmp_path, layout: list[str], nproc: int, *fault: str, restarts: int = 1) -> str:
    return run_cli(
        *BASE,
        *layout,
        *MOEVEMENT,
        "--checkpoint.host_dir",
        str(tmp_path / "shm"),
        *fault,
        nproc=nproc,
        torchrun=(f"--max-restarts={restarts}",),
    ).stdout


def assert_local_and_exact(out: str, reference: str, dead: str, scope: str) -> list[tuple]:
    """The recoveries are local (dead ranks `dead`, stages `scope` of the first), healthy stages re-execute
    nothing, and the training after each recovery equals the fault-free run's."""
    recoveries = REJOIN.findall(out)
    assert recoveries and recoveries[0][1:3] == (dead, scope), out
    work = WORK.findall(out)
    healthy = [(f, b) for _, role, f, b in work if role == "healthy"]
    assert healthy and all(fb == ("0", "0") for fb in healthy), work
    after = out[[m.end() for m in REJOIN.finditer(out)][-1] :]
    assert final_line(after) == final_line(reference)
    resumed = step_losses(after)
    assert resumed and resumed == {s: v for s, v in step_losses(reference).items() if s in resumed}
    return recoveries


def test_sigkill_in_backward_recovers_only_its_stage(tmp_path):
    """pp=2: rank 1 SIGKILLs itself in the backward pass of step 9; rank 0 keeps its state and replays nothing."""
    out = death_run(tmp_path, PP2, 2, "--fault.kill", "9:1:backward")
    assert "fault: rank 1 killed (SIGKILL) in the backward phase of step 9" in out
    kept = (
        r"^(failure detected: rank 0 at step 9 by .*; kept "
        r"|preempted: rank 0 received SIGTERM at step 9; host state kept \()"
    )
    assert re.search(kept + r"live state of iteration 9, ", out, re.M), out
    [(step, *_)] = assert_local_and_exact(out, baseline(PP2, 2), "1", "1")
    assert step == "9"


def test_real_crash_recovers_locally(tmp_path):
    """`--fault.crash` kills rank 1 (stage 0, with rank 0) at the start of step 8; torchrun restarts every
    process; ranks 2 and 3 (stage 1) keep their state and serve logs while stage 0 replays."""
    reference = baseline(PP2_DP2_EP2_BF16, 4)
    out = death_run(tmp_path, PP2_DP2_EP2_BF16, 4, "--fault.crash", "8:1")
    assert "fault: rank 1 crashes at step 8" in out
    assert_local_and_exact(out, reference, "1", "0")
    roles = {int(r): role for r, role, _, _ in WORK.findall(out)}
    assert roles == {0: "rolled-back", 1: "failed", 2: "healthy", 3: "healthy"}


def test_second_death_right_after_a_rejoin_recovers_locally(tmp_path):
    """pp=2: rank 1 dies at 9; the restarted job rejoins at 9 and keeps the window it replayed from as its
    persisted checkpoint; rank 1 dies again at 10, before the job persisted a window of its own: the second
    restart still replays only stage 1, from that window."""
    out = death_run(tmp_path, PP2, 2, "--fault.kill", "9:1:backward,10:1:forward", restarts=2)
    recoveries = assert_local_and_exact(out, baseline(PP2, 2), "1", "1")
    assert [r[:3] for r in recoveries] == [("9", "1", "1"), ("10", "1", "1")]
    assert recoveries[0][3] == recoveries[1][3]  # the same rollback point


@pytest.mark.slow
def test_death_during_a_rejoin_keeps_the_survivors_state(tmp_path):
    """pp=2: rank 1 dies at 9, then again while the restarted job replays its stage (iteration 7); rank 0,
    which was only serving logs, exits without writing anything: the next generation uses the live state it
    kept in the first one and still replays stage 1 alone."""
    out = death_run(tmp_path, PP2, 2, "--fault.kill", "9:1:backward,7:1:replay", restarts=2)
    assert "fault: rank 1 killed (SIGKILL) in the replay phase of step 7" in out
    [(step, *_)] = assert_local_and_exact(out, baseline(PP2, 2), "1", "1")
    assert step == "9"


@pytest.mark.slow
def test_death_in_the_last_iteration_keeps_the_final_state(tmp_path):
    """pp=2: rank 1 dies in the optimizer step of the last iteration (12); rank 0 finishes it and keeps its
    final state while the job gathers it; the restarted job replays stage 1 up to 13, has nothing left to
    train, and prints the fault-free run's final line (the loss of 12 comes from the scalar log)."""
    out = death_run(tmp_path, PP2, 2, "--fault.kill", "12:1:optimizer")
    assert [r[:3] for r in REJOIN.findall(out)] == [("13", "1", "1")], out
    assert final_line(out) == final_line(baseline(PP2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_pp2_dp2_ep2_bf16_sigkill_in_each_phase(tmp_path, phase):
    """A death before the gradient-norm all-reduce leaves every survivor at state_T; one in the optimizer
    step (after it) lets them finish T: either way the stage of rank 2 alone replays, bit-exact."""
    out = death_run(tmp_path, PP2_DP2_EP2_BF16, 4, "--fault.kill", f"8:2:{phase}")
    [(step, *_)] = assert_local_and_exact(out, baseline(PP2_DP2_EP2_BF16, 4), "2", "1")
    assert step == ("9" if phase == "optimizer" else "8")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "dead", "scope"),
    [
        (("--fault.kill", "8:2:backward"), "2", "2"),  # a middle stage
        # two deaths at once (both at the start of the iteration: a death inside it stops the others
        # before they reach a later phase): non-adjacent stages, then adjacent ones
        (("--fault.crash", "8:0,8:2"), "0+2", "0,2"),
        (("--fault.crash", "8:1,8:2"), "1+2", "1-2"),
        (("--fault.kill", "2:1:backward"), "1", "1"),  # inside the first window: the initial state
    ],
)
def test_pp4_real_deaths(tmp_path, fault, dead, scope):
    assert_local_and_exact(death_run(tmp_path, PP4, 4, *fault), baseline(PP4, 4), dead, scope)


@pytest.mark.slow
def test_interleaved_1f1b_and_two_deaths_in_a_row(tmp_path):
    """Interleaved1F1B (pipeline rank 1 runs stages 1 and 3); rank 1 dies at 6, then rank 0 at 15 (after
    the restarted job persisted a window of its own), each recovered by its own torchrun restart."""
    layout = [*INTERLEAVED, "--training.steps", "18"]
    out = death_run(tmp_path, layout, 2, "--fault.kill", "6:1:backward,15:0:forward", restarts=2)
    recoveries = assert_local_and_exact(out, baseline(layout, 2), "1", "1,3")
    assert [r[1:3] for r in recoveries] == [("1", "1,3"), ("0", "0,2")]


@pytest.mark.slow
def test_a_hung_worker_is_detected_by_the_timeout(tmp_path):
    """pp=2: rank 1 stops (SIGSTOP) in its backward pass, keeping its connections open; rank 0's receive
    fails after `fault.timeout_s`, it keeps its state, and the job recovers as from a death."""
    out = death_run(
        tmp_path, PP2, 2, "--fault.kill", "9:1:backward", "--fault.kill_signal", "SIGSTOP", "--fault.timeout_s", "5"
    )
    assert "fault: rank 1 stopped (SIGSTOP) in the backward phase of step 9" in out
    assert re.search(r"^failure detected: rank 0 at step 9 by a collective failed \(Timed out\)", out, re.M), out
    assert_local_and_exact(out, baseline(PP2, 2), "1", "1")
