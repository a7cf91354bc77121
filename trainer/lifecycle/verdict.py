"""Every decision of a process's life around a death, as tables (docs/design/lifecycle/README.md):

- `decide`: what a trainer does once an exception ended its work (`DECIDE`, below);
- `on_sigterm`: what SIGTERM does in each phase of the stop guard (`trainer/lifecycle/stop_guard.py`), and
  `kept_iteration`: which state a stopped rank then keeps (`KEEPS`, `trainer/lifecycle/survival.py`);
- `after_child_exit`: what a rank shell does when its trainer child ends (`SHELL`,
  `trainer/lifecycle/rank_shell.py`), `after_standby_exit`: when its idle standby dies (`STANDBY`),
  `a_frozen_child`: when it ends a trainer that stopped saying anything, and `a_silent_shell`: when a shell's
  child ends the shell that stopped beating (`trainer/lifecycle/shell_watch.py`);
- `cannot_form`: when a generation this rank waits to join can no longer form (`CANNOT_FORM`,
  `trainer/lifecycle/job_end.py`), `a_lost_node`: when a node is gone (`trainer/lifecycle/node_presence.py`);
- `Ending`: how each way a process ends is said and which exit status it gets (the table of exception types
  is `trainer.lifecycle.process.ENDINGS`);
- `runs_a_shell`: whether `train.py` starts as a rank shell at all (`trainer/lifecycle/entry.py`).

The tables are data (`Row`s, first match wins); the rest of the lifecycle gathers the facts and carries the
verdicts out. Imports nothing but the exit codes (the rank shell, which never imports torch, asks it too), so
it is tested as tables.

`decide`:

| what happened                                                | verdict             |
|--------------------------------------------------------------|---------------------|
| this rank's own error (not a peer's death, not SIGTERM)      | RAISE               |
| a peer died after the job recorded its end                   | DONE                |
| a peer stopped with a clean error and said so                | PEER_STOPPED        |
| a peer died, a rank shell replaces it, this rank training    | REJOIN              |
| a peer died, a rank shell replaces it, this rank in a group  | REJOIN              |
| the same while joining a generation that did not form        | FALLBACK            |
| a peer died or SIGTERM, no shell (or SIGTERM), training      | EXIT_FOR_TORCHRUN   |
| the same while a generation starts or the job finishes       | RAISE               |
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from trainer.lifecycle import exit_codes

T = TypeVar("T")


@dataclass(frozen=True)
class Row(Generic[T]):
    """One row of a table: `then` where every fact `when` names has the value it gives (a fact it does not
    name may have any); `what` says the case in words. A table is a tuple of rows, the first that matches
    wins, and its last row names no fact (it matches whatever the rows above it left)."""

    what: str
    when: Mapping[str, bool]
    then: T

    def matches(self, facts: object) -> bool:
        return all(getattr(facts, name) is value for name, value in self.when.items())


def look_up(table: tuple[Row[T], ...], facts: object) -> T:
    """`then` of the first row of `table` that matches `facts`."""
    return next(row.then for row in table if row.matches(facts))


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


_REPLACED = {"under_shell": True, "sigterm": False}  # a rank shell replaces the dead peer in place

# The table of the module docstring, row by row.
DECIDE: tuple[Row[Verdict], ...] = (
    Row("this rank's own error (not a peer's death, not SIGTERM)", {"peer_failure": False}, Verdict.RAISE),
    Row("a peer died after the job recorded its end", {"job_finished": True}, Verdict.DONE),
    Row("a peer stopped with a clean error and said so", {"peer_said_error": True}, Verdict.PEER_STOPPED),
    Row("a peer died, a rank shell replaces it, this rank training", {**_REPLACED, "training": True}, Verdict.REJOIN),
    Row(
        "a peer died, a rank shell replaces it, this rank in a group", {**_REPLACED, "in_a_group": True}, Verdict.REJOIN
    ),
    Row("the same while joining a generation that did not form", _REPLACED, Verdict.FALLBACK),
    Row("a peer died or SIGTERM, no shell (or SIGTERM), training", {"training": True}, Verdict.EXIT_FOR_TORCHRUN),
    Row("the same while a generation starts or the job finishes", {}, Verdict.RAISE),
)


def decide(happened: Happened) -> Verdict:
    """The verdict for `happened` (`DECIDE`)."""
    return look_up(DECIDE, happened)


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


class Keeps(enum.Enum):
    NOTHING = "nothing"  # it was recovering: its stage may be half-replayed and replays after the restart
    BEGUN = "begun"  # the update of the iteration it began completed: the state before the next one
    APPLIED = "applied"  # the state after the last iteration whose update is done


# The phase a rank stopped in (`StopGuard.stopped_in`) -> which state it keeps.
KEEPS: dict[str, Keeps] = {
    "setup": Keeps.APPLIED,
    "training": Keeps.APPLIED,
    "applying": Keeps.BEGUN,
    "recovering": Keeps.NOTHING,
}


def kept_iteration(stopped_in: str, step: int, applied: int) -> int | None:
    """The iteration whose state a rank stopped in phase `stopped_in` keeps, its next (`KEEPS`): after
    `step`, the iteration it began, or after `applied`, the last one applied; None: it keeps nothing."""
    keeps = KEEPS[stopped_in]
    if keeps is Keeps.NOTHING:
        return None
    return (step if keeps is Keeps.BEGUN else applied) + 1


class ShellVerdict(enum.Enum):
    HAND_BACK = "hand_back"  # exit with the child's status: torchrun's restart (or the job's end) takes over
    DONE = "done"  # the child died after the job finished: exit with success, replace nobody
    REPLACE = "replace"  # activate the standby as the same rank in the next generation
    # a death nobody replaces in place: say why (the value), then hand the slot back to torchrun's restart
    NO_STANDBY = "no standby"
    SPENT = "replacements spent"


@dataclass(frozen=True)
class ChildEnd:
    """The facts a rank shell has when its trainer child ended."""

    handed_to_torchrun: bool  # its exit status is one torchrun takes over (`exit_codes.HANDED_TO_TORCHRUN`)
    stopping: bool  # torchrun sent the shell SIGTERM
    job_finished: bool  # the child said the job finished (`finished <step>`)
    standby_ready: bool  # the shell's standby is alive
    spent: bool  # `fault.max_replacements` replacements are made already


SHELL: tuple[Row[ShellVerdict], ...] = (
    Row("torchrun stops the job", {"stopping": True}, ShellVerdict.HAND_BACK),
    Row(
        "the child exited cleanly, with a clean error, or for torchrun",
        {"handed_to_torchrun": True},
        ShellVerdict.HAND_BACK,
    ),
    Row("the child died after the job finished", {"job_finished": True}, ShellVerdict.DONE),
    Row("the child died and no standby is alive", {"standby_ready": False}, ShellVerdict.NO_STANDBY),
    Row("the child died and every replacement is spent", {"spent": True}, ShellVerdict.SPENT),
    Row("the child died", {}, ShellVerdict.REPLACE),
)


def child_end(returncode: int, stopping: bool, job_finished: bool, standby_ready: bool, spent: bool) -> ChildEnd:
    """The facts of a trainer child that ended with `returncode` (`Popen.returncode`)."""
    return ChildEnd(returncode in exit_codes.HANDED_TO_TORCHRUN, stopping, job_finished, standby_ready, spent)


def after_child_exit(end: ChildEnd) -> ShellVerdict:
    """What a rank shell does when its trainer child ended (`SHELL`)."""
    return look_up(SHELL, end)


class StandbyVerdict(enum.Enum):
    LEAVE = "leave"  # torchrun stops the job: the shell reaps it with the trainer
    GIVE_UP = "give_up"  # say it is lost; the trainer's next death goes to torchrun's restart ("no standby")
    RESPAWN = "respawn"  # start a new standby at once, so the trainer's next death is still replaced in place


@dataclass(frozen=True)
class StandbyEnd:
    """The facts a rank shell has when its idle standby died."""

    stopping: bool  # torchrun sent the shell SIGTERM
    spent: bool  # `fault.max_replacements` standbys died already


STANDBY: tuple[Row[StandbyVerdict], ...] = (
    Row("torchrun stops the job", {"stopping": True}, StandbyVerdict.LEAVE),
    Row("as many standbys died as replacements are allowed", {"spent": True}, StandbyVerdict.GIVE_UP),
    Row("a standby died while the trainer runs", {}, StandbyVerdict.RESPAWN),
)


def after_standby_exit(end: StandbyEnd) -> StandbyVerdict:
    """What a rank shell does when its idle standby died (`STANDBY`)."""
    return look_up(STANDBY, end)


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
    (`FaultBounds.later_join_s`)."""
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


class CannotForm(enum.Enum):
    JOB_FINISHED = "job_finished"  # nothing to recover: the rank ends with success (`JobFinished`)
    PEERS_LEFT = "peers_left"  # torchrun's restart of every worker takes over (`PeersLeft`)
    NODE_LOST = "node_lost"  # ... on the nodes that remain (`NodeLost`)


@dataclass(frozen=True)
class Waiting:
    """The facts a rank waiting to join a later generation reads on torchrun's store, about twice a second."""

    job_finished: bool  # rank 0 recorded the job's end
    peers_left: bool  # every other rank passed the job's last collective (and the end is not recorded)
    node_lost: bool  # the node it watches is lost (`a_lost_node`)


CANNOT_FORM: tuple[Row[CannotForm | None], ...] = (
    Row("the job recorded its end", {"job_finished": True}, CannotForm.JOB_FINISHED),
    Row("every other rank left the job, which did not record its end", {"peers_left": True}, CannotForm.PEERS_LEFT),
    Row("the node it watches is lost with its ranks", {"node_lost": True}, CannotForm.NODE_LOST),
    Row("the generation may still form: keep waiting", {}, None),
)


def cannot_form(waiting: Waiting) -> CannotForm | None:
    """Why the generation a rank waits to join cannot form, or None (`CANNOT_FORM`)."""
    return look_up(CANNOT_FORM, waiting)


def a_lost_node(silent_s: float, node_loss_s: float) -> bool:
    """Whether a node whose count on torchrun's store has not moved for `silent_s` is lost, with its ranks
    (its trainers add one every second): `fault.node_loss_s` or longer."""
    return silent_s >= node_loss_s


class Said(enum.Enum):
    BY_THIS_RANK = "by_this_rank"  # a state the job reached: the rank that met it prints it, then exits
    BY_A_PEER = "by_a_peer"  # a peer said the job's error: leave at once, quietly
    ONCE_FOR_THE_JOB = "once_for_the_job"  # a clean error: announced to the other ranks, one line for the job


@dataclass(frozen=True)
class Ending:
    """How one way of ending a process is said, and the exit status it gets (`exit_codes.py`)."""

    status: int
    said: Said


REACHED_FALLBACK = Ending(exit_codes.FALLBACK, Said.BY_THIS_RANK)  # a generation that cannot form or be joined
REACHED_THE_END = Ending(exit_codes.DONE, Said.BY_THIS_RANK)  # the job finished: nothing to recover
PEERS_ERROR = Ending(exit_codes.CLEAN_ERROR, Said.BY_A_PEER)  # a peer stopped with a clean error
CLEAN_ERROR = Ending(exit_codes.CLEAN_ERROR, Said.ONCE_FOR_THE_JOB)  # bad config, data, checkpoint, ...


def runs_a_shell(
    under_torchrun: bool, world: int, shell_child: bool, one_shot: bool, strategy: str, max_replacements: int
) -> bool:
    """Whether `train.py` starts as a rank shell (the trainer then runs as its child, beside a warm standby):
    under torchrun with more than one worker, not itself a shell's child, not a one-shot command
    (`--dry-run`, `--print-config`, `--help`), with a checkpoint strategy to rejoin with and replacements
    allowed (`fault.max_replacements` > 0)."""
    launched = under_torchrun and world > 1 and not shell_child and not one_shot
    return launched and strategy != "none" and max_replacements > 0
