"""Build the fault-tolerance pieces the config asks for, wired to this rank's model and layout:
the sparse checkpointer, the upstream log (pipeline boundaries) and the recovery driver."""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from moevement.engine import SparseCheckpointer, Topology
from moevement.recovery import Layout, Recovery, TrainerHooks
from moevement.replay import PipelineReplay, StageRef
from moevement.restart import Found, find_restart_checkpoint
from moevement.upstream_log import UpstreamLog
from parallelisms.fsdp import DTYPES
from parallelisms.mesh import ParallelDims
from parallelisms.parallelize import ModelParts, initial_parameters
from parallelisms.pipeline import lm_loss, local_stage_ids
from trainer.config import Config
from trainer.step import DropoutSeeder, forward_backward, replay_update


@dataclass
class FaultTolerance:
    """MoEvement's pieces on this rank (`checkpoint.strategy = "moevement"`)."""

    checkpointer: SparseCheckpointer
    log: UpstreamLog | None  # pipeline boundaries only (pp > 1)
    recovery: Recovery
    restart_from: Found | None = None  # a whole-job restart found this persisted checkpoint to convert

    def begin(self, step: int) -> None:
        if self.log is not None:
            self.log.collect_garbage(self.checkpointer.rollback_point())
            self.log.begin(step)
        self.checkpointer.begin(step)

    def end(self, step: int, scalars: dict[str, float], tokens, gate_probs) -> None:
        """Iteration `step` is done: its scalar log (what a replay needs) goes into its snapshot."""
        self.checkpointer.end(step, scalars, tokens, gate_probs)

    def metrics(self) -> dict[str, float]:
        return {**self.checkpointer.metrics(), "log_mb": self.log.nbytes() / 1e6 if self.log else 0.0}


def gather_layout(dims: ParallelDims) -> tuple[Topology, Layout]:
    """Every rank's pipeline rank, data-parallel rank and node (collective over all ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Topology.single(), Layout([0], [0], [local_stage_ids(dims.cfg, 0)])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dims.pp_rank, dims.dp_rank, socket.gethostname()))
    hosts = list(dict.fromkeys(host for _, _, host in gathered))
    topology = Topology(dist.get_rank(), len(gathered), [p for p, _, _ in gathered],
                        [hosts.index(h) for _, _, h in gathered])
    layout = Layout([p for p, _, _ in gathered], [d for _, d, _ in gathered],
                    [local_stage_ids(dims.cfg, p) for p in range(dims.cfg.pp)])
    return topology, layout


def host_rank_dir(cfg: Config, rank: int) -> Path:
    return Path(cfg.checkpoint.host_dir) / cfg.job.name / f"rank{rank:05d}"


def build_fault_tolerance(cfg: Config, model: ModelParts, optimizer, dims: ParallelDims, seeder: DropoutSeeder,
                          train_batches, line) -> FaultTolerance | None:
    """Sparse checkpointing, upstream logging and recovery for `checkpoint.strategy = "moevement"`, else None."""
    if cfg.checkpoint.strategy != "moevement":
        return None
    topo, layout = gather_layout(dims)
    rank_dir = host_rank_dir(cfg, topo.rank)
    job_meta = {"seed": cfg.job.seed, "dp_rank": dims.dp_rank, "pp_rank": dims.pp_rank,
                "rng": "dropout seed = derive_seed(seed, iteration, micro-batch, stage, dp_rank)"}
    found = None
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # torchrun restarted the whole job
        expect = {k: job_meta[k] for k in ("seed", "dp_rank", "pp_rank")}
        found = find_restart_checkpoint(rank_dir.parent, cfg.checkpoint.persist_dir, expect, line)
        dist.barrier()  # every rank holds its copy before any rank clears its directory
    shutil.rmtree(rank_dir, ignore_errors=True)  # what is left there belongs to an earlier run
    checkpointer = SparseCheckpointer(cfg.checkpoint, model.view, optimizer,
                                      compute_dtype=DTYPES[cfg.training.mixed_precision], device=dims.device,
                                      rank_dir=rank_dir, topology=topo, job_meta=job_meta)
    log = UpstreamLog(model.parts, model.stage_ids, model.n_stages) if cfg.parallelism.pp > 1 else None
    hooks = _trainer_hooks(cfg, model, optimizer, dims, seeder, log, layout, train_batches, line)
    recovery = Recovery(checkpointer, log, optimizer, layout, model.n_stages, cfg.training.micro_batches, hooks,
                        global_rollback=cfg.fault.scope == "global")
    return FaultTolerance(checkpointer, log, recovery, found)


def _trainer_hooks(cfg: Config, model: ModelParts, optimizer, dims: ParallelDims, seeder: DropoutSeeder,
                   log: UpstreamLog | None, layout: Layout, train_batches, line) -> TrainerHooks:
    micro, dp = cfg.training.micro_batches, cfg.parallelism.dp

    def begin_iteration(t: int) -> None:
        seeder.begin(t)
        if log is not None:
            log.begin(t)

    if model.schedule is not None:
        stages = {s: StageRef(part, stage, *model.stage_shapes(s))
                  for s, part, stage in zip(model.stage_ids, model.parts, model.pipeline_stages)}
        replay = PipelineReplay(stages, model.n_stages, micro, lambda s: layout.rank_of(layout.owner_pp(s), dims.dp_rank),
                                log, lm_loss, dims.device)
        run = replay.forward_backward
    else:
        def run(t, scope, inputs, labels, boundary):
            forward_backward(model, inputs.to(dims.device), labels.to(dims.device), micro)

    return TrainerHooks(
        batch=lambda t: train_batches.local_batch(t, dims.dp_rank, dp),
        begin_iteration=begin_iteration,
        forward_backward=run,
        optimizer_step=lambda scalars: replay_update(model, optimizer, scalars),
        initial_parameters=lambda: initial_parameters(cfg.model, dims, cfg.job.seed),
        line=line)
