"""Build the checkpoint strategy the config asks for, wired to this rank's model and layout."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import torch.distributed as dist

from moevement.engine import SparseCheckpointer, Topology
from parallelisms.fsdp import DTYPES
from parallelisms.mesh import ParallelDims
from parallelisms.parallelize import ModelParts
from trainer.config import Config


def topology(dims: ParallelDims) -> Topology:
    """Every rank's pipeline stage and node (collective over all ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Topology.single()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dims.pp_rank, socket.gethostname()))
    hosts = list(dict.fromkeys(host for _, host in gathered))
    return Topology(dist.get_rank(), len(gathered), [s for s, _ in gathered], [hosts.index(h) for _, h in gathered])


def host_rank_dir(cfg: Config, rank: int) -> Path:
    return Path(cfg.checkpoint.host_dir) / cfg.job.name / f"rank{rank:05d}"


def build_checkpointer(cfg: Config, model: ModelParts, optimizer, dims: ParallelDims) -> SparseCheckpointer | None:
    """The sparse checkpointer for `checkpoint.strategy = "moevement"`, else None."""
    if cfg.checkpoint.strategy != "moevement":
        return None
    topo = topology(dims)
    rank_dir = host_rank_dir(cfg, topo.rank)
    shutil.rmtree(rank_dir, ignore_errors=True)  # a fresh run: snapshots of an earlier run are stale
    job_meta = {"seed": cfg.job.seed, "dp_rank": dims.dp_rank, "pp_rank": dims.pp_rank,
                "rng": "dropout seed = derive_seed(seed, iteration, micro-batch, stage, dp_rank)"}
    return SparseCheckpointer(cfg.checkpoint, model.view, optimizer,
                              compute_dtype=DTYPES[cfg.training.mixed_precision], device=dims.device,
                              rank_dir=rank_dir, topology=topo, job_meta=job_meta)
