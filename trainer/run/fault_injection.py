"""`fault.kill`: a worker SIGKILLs itself at a precise point of an iteration (a real death, no clean-up).

Phases of iteration T: `forward` (the first forward of this rank's stages), `backward` (the first
backward), `clip` (just before the gradient-norm all-reduce, so no rank gets T's clip coefficient),
`optimizer` (after that all-reduce, before the update), `snapshot` (while this iteration's snapshot is
being copied to host memory), `replication` (after T is applied, while its snapshot is being sent to the
replica peers), `validation` (in the validation after T, where one runs), `dense_save` (in the background
writer of T's periodic dense checkpoint, after its first tensor), `dense_prune` (rank 0's background thread,
pruning older periodic checkpoints once T's is published, after the first file it deletes: only where the
prune deletes one); these fire only in normal training.
`replay` fires while a restarted generation's start-up (a rejoin or a whole-job restart) replays T;
`join`, in a survivor that kept its state of T, right after it joined the process groups of the in-place
generation that follows the death at T. At the end of a run whose last iteration is T: `digest` as this
rank starts the final state digest (its peers wait for it there), `save` as it starts
`checkpoint.save_final`, `saved` once that is published (rank 0 before it tells the others),
`accounting` right after the point where rank 0 prints the accounting line (without `save_final`,
before the job records its end: trainer/lifecycle/job_end.py), `final` once this rank knows the job
finished (rank 0 after its `final` line, the others once they see rank 0's record). The kills fire in
the order given, each once per job (`FaultPlan.kill_of`: the n-th distinct kill once n have fired), whether
the job goes on in place or restarted by torchrun: the kills that fired are recorded on torchrun's store
(`fired`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from moevement.failures import END_PHASES, FaultPlan, KillEvent
from parallelisms.parallelize import ModelParts
from trainer.lifecycle.stop_guard import StopGuard
from trainer.records.event_lines import FaultStrike
from trainer.step import DropoutSeeder


def print_strike(strike: FaultStrike) -> None:
    """A `fault:` line printed only (no run record to keep it in)."""
    print(strike.line(), flush=True)


class KillSwitch:
    """This rank's kill of this generation (if any). Forward, backward, optimizer and replay fire from
    module and optimizer hooks; the training loop names the other points with `at(phase)`. `say` prints the
    `fault:` line (rank 0's `MetricsLogger.line(..., every_rank=True)` also records it)."""

    def __init__(
        self,
        kill: KillEvent | None,
        rank: int,
        guard: StopGuard,
        seeder: DropoutSeeder,
        how: str,
        say: Callable[[FaultStrike], None] = print_strike,
    ):
        self.kill, self.rank, self.guard, self.seeder, self.how = kill, rank, guard, seeder, how
        self.say = say

    def due(self, phase: str) -> bool:
        kill, guard = self.kill, self.guard
        if kill is None or kill.phase != phase:
            return False
        if phase == "replay":  # the start-up's replay runs before training, in the setup phase
            return guard.phase == "setup" and self.seeder.step == kill.step
        if phase in END_PHASES:  # named once each, after the last iteration
            return guard.step == kill.step
        return guard.step == kill.step and guard.phase in ("training", "applying")  # not while a recovery replays

    def at(self, phase: str) -> None:
        if self.due(phase):
            strike(self.kill, self.rank, self.how, self.guard.process.store, self.say)

    def in_background(self, phase: str, step: int) -> None:
        """In a periodic save's background thread (`dense_save`: the writer of iteration `step`'s checkpoint,
        after its first tensor; `dense_prune`: rank 0 pruning after publishing it, after the first file)."""
        if self.kill is not None and self.kill.phase == phase and self.kill.step == step:
            strike(self.kill, self.rank, self.how, self.guard.process.store, self.say)


def strike(
    kill: KillEvent, rank: int, how: str, store: dist.Store | None, say: Callable[[FaultStrike], None] = print_strike
) -> None:
    """`kill` strikes this process now: the line (through `say`), the record on torchrun's `store`, the signal."""
    say(FaultStrike(rank, kill.step, how, kill.phase, time.time()))
    record_fired(store, kill.key)
    os.kill(os.getpid(), getattr(signal, how))


_FIRED = "moevement/faults-fired/"  # keys on torchrun's store: the injected deaths that struck


def fired(store: dist.Store | None, event: str) -> bool:
    """Whether the injected death `event` ("kill/<step>", "crash/<step>/<rank>") struck already in this job,
    as torchrun's `store` (`ProcessState.store`) records it (a process without torchrun's store runs once)."""
    return store is not None and store.check([_FIRED + event])


def record_fired(store: dist.Store | None, event: str) -> None:
    """The injected death `event` strikes now: no later generation or torchrun restart meets it again."""
    if store is not None:
        store.set(_FIRED + event, "1")


def kills_fired(store: dist.Store | None, plan: FaultPlan) -> int:
    """How many distinct kills of `plan` struck in this job so far (`fired`)."""
    return len({k.key for k in plan.kills if fired(store, k.key)})


def kill_if_joining(plan: FaultPlan, rank: int, kept_step: int | None, how: str, store: dist.Store | None) -> None:
    """Setup, right after this process joined a generation's process groups: a survivor that kept its state of
    iteration `kept_step` (None: not a survivor) and has a `join` kill of that step due dies now. Its line is
    printed only: this generation has no run record open yet."""
    kill = plan.kill_of(rank, kills_fired(store, plan)) if kept_step is not None else None
    if kill is not None and kill.phase == "join" and kill.step == kept_step:
        strike(kill, rank, how, store)


def arm_kill(
    plan: FaultPlan,
    rank: int,
    model: ModelParts,
    optimizer: torch.optim.Optimizer,
    guard: StopGuard,
    seeder: DropoutSeeder,
    how: str = "SIGKILL",
    say: Callable[[FaultStrike], None] = print_strike,
) -> KillSwitch:
    """Install this rank's kill of this generation, if any. `how`: SIGKILL (a death) or SIGSTOP (a hang:
    the process stays, holding its connections, until its peers' collectives time out); `say` prints its
    `fault:` line on any rank (`MetricsLogger.line(..., every_rank=True)`, which records it on rank 0)."""
    switch = KillSwitch(plan.kill_of(rank, kills_fired(guard.process.store, plan)), rank, guard, seeder, how, say)
    if switch.kill is None:
        return switch

    def before_forward(*_):
        switch.at("forward")
        switch.at("replay")

    model.parts[0].register_forward_pre_hook(before_forward)

    def on_output(_module, _args, out):
        if switch.due("backward") and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda _grad: switch.at("backward"))

    model.parts[-1].register_forward_hook(on_output)
    optimizer.register_step_pre_hook(lambda *_: switch.at("optimizer"))
    return switch
