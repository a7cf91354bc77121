"""Every decision of a process's life around a death, as four tables (docs/design/lifecycle/README.md):

- `decide`: what a trainer does once an exception ended its work (below);
- `on_sigterm`: what SIGTERM does in each phase of the stop guard (`trainer/lifecycle/stop_guard.py`);
- `after_child_exit`: what a rank shell does when its trainer child ends (`trainer/lifecycle/rank_shell.py`),
  `a_frozen_child`: when it ends a trainer that stopped saying anything, and `a_silent_shell`: when a shell's
  child ends the shell that stopped beating (`trainer/lifecycle/shell_watch.py`);
- `runs_a_shell`: whether `train.py` starts as a rank shell at all (`trainer/lifecycle/entry.py`).

The rest of the lifecycle gathers the facts and carries the verdicts out. Imports nothing but the exit
codes (the rank shell, which never imports torch, asks it too), so it is tested as tables.

`decide`:

| what happened                                              | verdict             |
|------------------------------------------------------------|---------------------|
| this rank's own error (not a peer's death, not SIGTERM)    | RAISE               |
| a peer died after the job recorded its end                 | DONE                |
| a peer stopped with a clean error and said so              | PEER_STOPPED        |
| a peer died, a rank shell replaces it, this rank in a group | REJOIN              |
| the same while joining a generation that did not form      | FALLBACK            |
| a peer died or SIGTERM, no shell (or SIGTERM), training     | EXIT_FOR_TORCHRUN   |
| the same while a generation starts or the job finishes     | RAISE               |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from trainer.lifecycle.exit_codes import HANDED_TO_TORCHRUN


class Verdict(enum.Enum):
    RAISE = "raise"  # not the lifecycle's to handle: the error goes up and its type decides the exit status
    DONE = "done"  # nothing to recover: the job finished
    PEER_STOPPED = "peer_stopped"  # stop as quietly as the peer that said the job's error (exit status 2)
    REJOIN = "rejoin"  # keep the state in memory and join the next in-place generation in this process
    FALLBACK = "fallback"  # keep what was kept in host memory; exit for torchrun's restart of every worker
    EXIT_FOR_TORCHRUN = "exit_for_torchrun"  # keep the live state in host memory; exit (75, or 143 on SIGTERM)


@dataclass(frozen=True)
class Happened:
    """The facts a verdict is taken from, gathered when an exception ended a rank's work."""

    peer_failure: bool  # a failed communication (a peer gone or hung) or torchrun's SIGTERM, not a bug here
    sigterm: bool  # ... and it was SIGTERM: torchrun's agent is stopping every worker
    job_finished: bool  # the job's end is recorded on torchrun's store (trainer/lifecycle/job_end.py)
    peer_said_error: bool  # another rank stopped with a clean error and announced it
    under_shell: bool  # a rank shell replaces dead workers in place (trainer/lifecycle/rank_shell.py)
    training: bool  # in the training loop, where the stop guard keeps the state consistent
    in_a_group: bool  # this process belongs to a generation's process group (it joined one)


def decide(happened: Happened) -> Verdict:
    """The verdict for `happened` (the table of the module docstring, in order)."""
    h = happened
    if not h.peer_failure:
        return Verdict.RAISE
    if h.job_finished:
        return Verdict.DONE
    if h.peer_said_error:
        return Verdict.PEER_STOPPED
    if h.under_shell and not h.sigterm:
        return Verdict.REJOIN if h.training or h.in_a_group else Verdict.FALLBACK
    return Verdict.EXIT_FOR_TORCHRUN if h.training else Verdict.RAISE


class OnSigterm(enum.Enum):
    EXIT = "exit"  # before training (or after it): say what was kept and exit at once (143)
    STOP = "stop"  # the state is `state_T`: raise `WorkerStopped` now, keep it, exit for torchrun
    WAIT = "wait"  # an update is being applied (stop once it is logged), or the rank is already stopping


def on_sigterm(phase: str) -> OnSigterm:
    """What SIGTERM does in the stop guard's `phase` ("setup", "training", "applying", "recovering",
    "stopping"). During a recovery the rank keeps nothing (its stage replays after the restart)."""
    if phase in ("training", "recovering"):
        return OnSigterm.STOP
    if phase == "setup":
        return OnSigterm.EXIT
    return OnSigterm.WAIT


class ShellVerdict(enum.Enum):
    HAND_BACK = "hand_back"  # exit with the child's status: torchrun's restart (or the job's end) takes over
    DONE = "done"  # the child died after the job finished: exit with success, replace nobody
    REPLACE = "replace"  # activate the standby as the same rank in the next generation (if one is ready)


def after_child_exit(returncode: int, job_finished: bool, stopping: bool) -> ShellVerdict:
    """What a rank shell does when its trainer child ended with `returncode` (`Popen.returncode`):
    `job_finished` once the child said so, `stopping` once torchrun sent the shell SIGTERM."""
    if stopping or returncode in HANDED_TO_TORCHRUN:
        return ShellVerdict.HAND_BACK
    if job_finished:
        return ShellVerdict.DONE
    return ShellVerdict.REPLACE


def a_frozen_child(silent_s: float, bound_s: float, stopping: bool) -> bool:
    """Whether a rank shell kills its trainer child as frozen: since its imports the child says `alive`
    every second from a thread of its own, and it said nothing for longer than `bound_s` (`hang_bound`):
    the process is stopped (SIGSTOP) or stuck holding the interpreter. Not while torchrun stops the job
    (`stopping`). The killed child is then a death like any other (`after_child_exit`)."""
    return not stopping and silent_s > bound_s


def hang_bound(heartbeat_timeout_s: float, timeout_s: float) -> tuple[str, float]:
    """(key, seconds): the silence after which a shell's trainer, or a shell, is hung (`a_frozen_child`,
    `a_silent_shell`): `fault.heartbeat_timeout_s`, the hang bound, or `fault.timeout_s` where that is
    shorter, since a hung trainer's peers give up on it then and wait a bounded time for its replacement
    (`parallelisms.distributed.LATER_GENERATION_JOIN_FACTOR` times that)."""
    if timeout_s < heartbeat_timeout_s:
        return "fault.timeout_s", timeout_s
    return "fault.heartbeat_timeout_s", heartbeat_timeout_s


STANDBY_GRACE_S = 2.0  # a standby waits this much longer than the trainer before it ends a silent shell


def a_silent_shell(silent_s: float, bound_s: float, standby: bool) -> bool:
    """Whether a rank shell's child (its trainer, or its standby: `standby`) kills the shell, which beats to
    each child every second and said nothing for longer than `bound_s` (`hang_bound`): the shell is stopped
    or stuck, so nobody would replace the trainer, and torchrun, which waits on the shell, would wait for
    ever. Its trainer decides first; its standby `STANDBY_GRACE_S` later, so that a shell whose trainer has
    exited (or is frozen too) is still ended, and a live trainer's line is the one printed."""
    return silent_s > bound_s + (STANDBY_GRACE_S if standby else 0.0)


def runs_a_shell(
    under_torchrun: bool, world: int, shell_child: bool, one_shot: bool, strategy: str, max_replacements: int
) -> bool:
    """Whether `train.py` starts as a rank shell (the trainer then runs as its child, beside a warm standby):
    under torchrun with more than one worker, not itself a shell's child, not a one-shot command
    (`--dry-run`, `--print-config`, `--help`), with a checkpoint strategy to rejoin with and replacements
    allowed (`fault.max_replacements` > 0)."""
    launched = under_torchrun and world > 1 and not shell_child and not one_shot
    return launched and strategy != "none" and max_replacements > 0
