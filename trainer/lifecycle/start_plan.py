"""How this process takes its place in the job: decided once per generation, read by everything it starts.

A process starts its rank fresh (a new job, or a relaunch of the job from its persisted state: attempt 0),
rejoins after torchrun restarted every worker (attempt > 0: survivors kept their state in node-local shared
memory), or joins the next *generation* of its attempt in place: a rank shell replaced a dead worker by a
warm standby (`trainer/lifecycle/rank_shell.py`) while the survivors kept their state in memory and stayed alive.
The generation numbers the process groups (`parallelisms.distributed.join_generation`); every death
starts a new one, as does every torchrun restart (counted by `attempt`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from moevement.recovery.live_state import LiveState
from moevement.recovery.report import ShellFault
from parallelisms import collectives
from trainer.lifecycle.process_state import ProcessState
from trainer.lifecycle.rank_shell import GENERATION, shell_fault
from trainer.lifecycle.startup import STARTUP


@dataclass(frozen=True)
class StartPlan:
    run_id: str  # torchrun's run id ("" without torchrun)
    attempt: int  # torchrun restarts of the job before this one
    generation: int = 0  # in-place generations of this attempt before this one
    kept: LiveState | None = None  # a survivor's state, kept in memory from the previous generation
    accounting: dict | None = None  # a survivor's run accounting, likewise
    fault: ShellFault | None = None  # a replacement's: the fault it replaces, as its rank shell saw it
    process: ProcessState = field(default_factory=lambda: ProcessState(STARTUP), compare=False)  # outlives the plan

    @property
    def restarted(self) -> bool:
        """Whether the job ran before this start in this torchrun run (each torchrun restart and each
        generation follows a death; state may be kept somewhere)."""
        return self.attempt > 0 or self.generation > 0

    @property
    def in_place(self) -> bool:
        """Whether survivors stayed alive: the rank joins a later generation of its attempt."""
        return self.generation > 0

    def name(self) -> dict:
        """The run and attempt that files kept across a torchrun restart are named by."""
        return {"run_id": self.run_id, "attempt": self.attempt}

    def next_generation(
        self, kept: LiveState | None, accounting: dict | None, fault: ShellFault | None = None
    ) -> StartPlan:
        """A survivor's plan for the generation after this one, with what it kept in memory (and, where this
        generation failed to start, the fault it was to recover from, if its shell saw it)."""
        return replace(self, generation=self.generation + 1, kept=kept, accounting=accounting, fault=fault)


def agree_on_attempt(plan: StartPlan) -> StartPlan:
    """`plan` with the job's attempt: the most torchrun restarts any rank's agent counted (collective, once
    the default group is up). Agents count their own restarts: a node that joined later (it came back to an
    elastic job, or replaced a lost one) counts fewer than the others, and a restart of every worker because
    a node joined counts on none; what a rank does on a restart must not differ between nodes."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return plan
    attempt = torch.tensor([plan.attempt])
    collectives.all_reduce(attempt, op=dist.ReduceOp.MAX)
    return replace(plan, attempt=int(attempt.item()))


def plan_start(process: ProcessState) -> StartPlan:
    """This process's plan at its start, from torchrun's environment and its rank shell's activation;
    `process`: what the process carries across its generations."""
    return StartPlan(
        run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        generation=int(os.environ.get(GENERATION, "0")),
        fault=ShellFault(*seen) if (seen := shell_fault()) else None,
        process=process,
    )
