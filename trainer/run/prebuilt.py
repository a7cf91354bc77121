"""What a rank shell's warm standby builds before its activation (docs/design/lifecycle/replacement.md).

A standby knows the rank it will become (its slot's `RANK`), the world torchrun started (`WORLD_SIZE`) and
the job's config (the same command line); it cannot know the generation it will join nor the dead rank's
state. So before its activation it builds what depends on those alone (`prebuild`): the config fitted to
that world, the data pipeline (training and validation batches) and, on a CPU device, the rank's pipeline
stages materialised and initialised from the seed (`parallelisms.parallelize.materialize_stages`); with
`fault.standby_warm_up` it then runs one throwaway forward and backward through a copy of them (`warm_up`:
the kernels' first-call costs and the allocator's heap growth are paid before the death, not in the first
replayed iteration). On a CPU device, with `checkpoint.prefault`, it also keeps mappings of the buffer files in
its rank's host directory while it waits (`moevement/storage/prefault_watch.py`: the snapshots and replicas the
trainer it stands by for writes), so that its checkpointer, once activated, maps nothing again; `activated`
stops that watch. After the activation,
`train.py`'s setup takes them on where they fit the layout it joined (`Prebuilt.fits`: the same fitted
config and rank; an elastic job whose world changed builds afresh) and binds the generation's process
groups to them (FSDP2, pipeline stages); the optimizer and the checkpoint strategy are built there, on
the generation's groups. On an accelerator the model waits for the activation: a standby holds no device
memory beside a live trainer.

Bit-exactness: the stages are initialised exactly as setup initialises them, the CPU generator's state
after their initialisation is restored when they are taken on (`MaterializedStages.rng_state`), and the
warm-up touches neither the stages nor the generator; besides, a replacement's recovery overwrites every
weight. A prebuilt replacement therefore trains the same bits as one that built everything after its
activation (tests/test_real_deaths.py compares both with the fault-free run's digest).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moevement.storage.prefault_watch import PrefaultWatch
from parallelisms.distributed import device_type
from parallelisms.mesh import rank_coordinates
from parallelisms.parallelize import MaterializedStages, materialize_stages
from trainer.config import Config, fit_world
from trainer.data.batches import TokenBatches
from trainer.lifecycle.host_dirs import host_rank_dir
from trainer.strategy_registry import strategy_entry

Data = tuple[TokenBatches, TokenBatches | None]  # (training batches, validation batches)


@dataclass
class Prebuilt:
    """What a standby built for rank `rank` of the job `cfg` describes (fitted to the world it expected)."""

    cfg: Config
    rank: int
    data: Data
    stages: MaterializedStages | None  # None on an accelerator
    seconds: float  # what building (and warming up) took, before the activation
    buffers: PrefaultWatch | None = None  # its rank's buffer files mapped while it waits (CPU, checkpoint.prefault)

    def activated(self) -> None:
        """At the activation, before anything is built: stop keeping the rank's buffer mappings current (the
        ones kept stay, for its checkpointer)."""
        if self.buffers is not None:
            self.buffers.stop()

    def fits(self, cfg: Config, rank: int) -> bool:
        """Whether it is what setup would build for rank `rank` of the fitted config `cfg`."""
        return self.rank == rank and self.cfg == cfg

    def parts(self) -> str:
        """What it holds, for the `recovery work` line: "data" or "data+model"."""
        return "data+model" if self.stages is not None else "data"


def prebuild(
    cfg: Config, rank: int, world: int, training_data: Callable[[Config], Data], warm: bool = False
) -> Prebuilt:
    """Rank `rank`'s data and (on CPU) its stages, for `cfg` fitted to `world` processes (see the module
    docstring), `warm`ed up if asked; `training_data(cfg)` builds the data as setup does. ConfigError where
    the config does not fit that world (setup says so again, after the activation)."""
    started = time.perf_counter()
    fitted = fit_world(cfg, world)
    data = training_data(fitted)
    stages = buffers = None
    if device_type() == "cpu":
        p, t = fitted.parallelism, fitted.training
        pp_rank, _, ep_rank = rank_coordinates(p, rank)
        device = torch.device("cpu")
        stages = materialize_stages(fitted.model, p, pp_rank, ep_rank, fitted.job.seed, device, t.loss_chunk_tokens)
        if warm:
            warm_up(stages, (t.batch_size // (t.micro_batches * p.dp), t.seq_len))
        c = fitted.checkpoint  # (on an accelerator the checkpointer maps and pins them after the activation)
        if strategy_entry(c.strategy).recovers and c.prefault:
            buffers = PrefaultWatch(host_rank_dir(fitted, rank), c.background_priority)
    return Prebuilt(fitted, rank, data, stages, time.perf_counter() - started, buffers)


def warm_up(stages: MaterializedStages, micro_batch_shape: tuple[int, int]) -> None:
    """One forward and backward of a micro-batch of zeros through a copy of every stage, then the copy is
    dropped: the kernels' first calls and the allocator's heap growth happen here, and neither the stages
    (their weights, gradients, MoE load counters) nor the CPU generator change."""
    with torch.random.fork_rng(devices=[]):
        tokens = torch.zeros(micro_batch_shape, dtype=torch.long)
        for part in stages.parts:
            throwaway = copy.deepcopy(part)
            if throwaway.tok_embeddings is not None:
                x = tokens
            else:
                x = torch.zeros((*micro_batch_shape, throwaway.args.dim), requires_grad=True)
            out = throwaway(x)
            loss = throwaway.loss(out, tokens) if throwaway.output is not None else out.float().square().mean()
            loss.backward()
            del throwaway, out, loss
