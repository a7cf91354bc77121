"""The `[parallelism]` config and the device mesh it describes.

World ranks are laid out as (pp, edp, ep), row-major: the `dp = edp * ep` ranks of a
pipeline stage are consecutive, and expert parallelism is carved out of them
(TorchTitan convention). `dp` is the flattened (edp, ep) sub-mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallelisms.distributed import bounded_backend

Schedule = Literal["1F1B", "Interleaved1F1B", "GPipe"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)


@dataclass
class ParallelismConfig:
    pp: int = 1  # pipeline stages (ranks along the pipeline)
    dp: int = 1  # data-parallel ranks per stage (FSDP2)
    ep: int = 1  # expert-parallel ranks, carved out of dp
    schedule: Schedule = "1F1B"  # 1F1B | Interleaved1F1B | GPipe
    stages_per_rank: int = 1  # virtual stages per rank (Interleaved1F1B needs >= 2)
    split_points: str = ""  # layer ids starting stages 1.. (e.g. "2,4"); "" = balanced
    # under torchrun --nnodes MIN:MAX: take the world a restart gets (dp = world / pp, micro-batches per rank
    # scaled to keep their rows) and resume from the newest periodic dense checkpoint, or with moevement from a
    # newer window in host memory re-laid into that layout (parallelisms/elastic.py)
    elastic: bool = False


@dataclass
class ParallelDims:
    """This rank's coordinates in the (pp, dp) grid and its sub-meshes."""

    mesh: DeviceMesh
    dp_mesh: DeviceMesh  # the flattened (edp, ep) dimension, kept here: slicing it from `mesh` is deprecated
    cfg: ParallelismConfig
    device: torch.device  # where this rank computes (cpu, or its cuda device)

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def ep_rank(self) -> int:
        return self.mesh["ep"].get_local_rank()

    def group(self, dim: str):
        return (self.dp_mesh if dim == "dp" else self.mesh[dim]).get_group()


def rank_coordinates(cfg: ParallelismConfig, rank: int) -> tuple[int, int, int]:
    """(pp rank, dp rank, ep rank) of global rank `rank` in the layout `cfg`, the mesh's row-major order,
    without a mesh (a standby, before it joins the job's groups)."""
    dp_rank = rank % cfg.dp
    return rank // cfg.dp, dp_rank, dp_rank % cfg.ep


def build_mesh(cfg: ParallelismConfig, device_type: str, timeout_s: float | None = None) -> ParallelDims:
    """A 3-D mesh (pp, edp, ep) with the flattened dp = (edp, ep) dimension; every group it makes is bounded
    by `timeout_s` (`fault.timeout_s`, the default group's bound; None: PyTorch's default)."""
    dims = ("pp", "edp", "ep")
    override = bounded_backend(timeout_s)
    bounded = {dim: override for dim in dims} if override else None
    mesh = init_device_mesh(
        device_type, (cfg.pp, cfg.dp // cfg.ep, cfg.ep), mesh_dim_names=dims, backend_override=bounded
    )
    # torch 2.13 has no public flatten; TorchTitan uses the same private call.
    dp_mesh = mesh["edp", "ep"]._flatten("dp", backend_override=override)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    return ParallelDims(mesh, dp_mesh, cfg, device)
