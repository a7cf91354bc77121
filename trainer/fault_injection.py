"""`fault.kill`: a worker SIGKILLs itself at a precise point of an iteration (a real death, no clean-up).

The hooks fire in the torchrun generation the kill belongs to (`FaultPlan.kill_of`), so a restarted job
does not meet the same death again: in normal training for the phases of an iteration, and only while the
generation's start-up replays (a rejoin or a whole-job restart) for `replay`.
"""

from __future__ import annotations

import os
import signal

import torch

from moevement.failures import FaultPlan, KillEvent
from parallelisms.parallelize import ModelParts
from trainer.step import DropoutSeeder
from trainer.survival import StopGuard


def arm_kill(
    plan: FaultPlan,
    rank: int,
    model: ModelParts,
    optimizer: torch.optim.Optimizer,
    guard: StopGuard,
    seeder: DropoutSeeder,
    how: str = "SIGKILL",
) -> None:
    """Install this rank's kill of this generation, if any. `how`: SIGKILL (a death) or SIGSTOP (a hang:
    the process stays, holding its connections, until its peers' collectives time out)."""
    kill = plan.kill_of(rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    if kill is None:
        return

    def due() -> bool:
        if kill.phase == "replay":  # the start-up's replay runs before training, in the setup phase
            return guard.phase == "setup" and seeder.step == kill.step
        return guard.step == kill.step and guard.phase in ("training", "applying")

    if kill.phase in ("forward", "replay"):
        model.parts[0].register_forward_pre_hook(lambda *_: _die(kill, rank, how) if due() else None)
    elif kill.phase == "backward":

        def on_output(_module, _args, out):
            if due() and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda _grad: _die(kill, rank, how))

        model.parts[-1].register_forward_hook(on_output)
    else:  # optimizer: the gradient-norm all-reduce is done on every rank, the update is not
        optimizer.register_step_pre_hook(lambda *_: _die(kill, rank, how) if due() else None)


def _die(kill: KillEvent, rank: int, how: str) -> None:
    verb = "killed" if how == "SIGKILL" else "stopped"
    print(f"fault: rank {rank} {verb} ({how}) in the {kill.phase} phase of step {kill.step}", flush=True)
    os.kill(os.getpid(), getattr(signal, how))
