"""FSDP2 (`fully_shard`) data parallelism and bf16 mixed precision."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from models.experts import GroupedExperts
from parallelisms.mesh import ParallelDims, ParallelismConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_fsdp(part: torch.nn.Module, dims: ParallelDims, mixed_precision: str) -> None:
    """Shard a model (or pipeline stage) over its data-parallel ranks.

    Routed experts are sharded over the expert-data-parallel ranks (`edp = dp / ep`, the
    ranks holding the same experts) with gradients divided by `dp`, since each expert's
    gradient already sums the contributions of all `dp` ranks' tokens (all-to-all).
    Everything else is sharded per block, then the root (embedding, norm, head). Stacked expert weights
    are sharded within each expert (dimension 1), never across experts.
    Parameters stay FP32 (master weights); forward and backward run on compute weights
    of `mixed_precision` dtype; gradients are reduced and kept in FP32.
    """
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[mixed_precision], reduce_dtype=torch.float32)
    dp_mesh, dp = dims.dp_mesh, dims.cfg.dp
    for block in part.layers.values():
        if dims.cfg.ep > 1 and getattr(block, "moe", None) is not None:
            experts = block.moe.experts
            fully_shard(experts, mesh=dims.mesh["edp"], mp_policy=policy, shard_placement_fn=_within_each_expert)
            experts.set_gradient_divide_factor(float(dp))
            if dims.mesh["edp"].size() > 1:  # sum, then divide: gloo has no PREMUL_SUM
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, shard_placement_fn=_within_each_expert)
    fully_shard(part, mesh=dp_mesh, mp_policy=policy)


def reshard(part: torch.nn.Module) -> None:
    """Put every FSDP module of `part` back on its sharded parameters. After a forward without backward
    (validation) the root keeps its gathered parameters registered as plain tensors, which every
    data-parallel rank would then hold whole (and a state digest or save would count as each rank's own)."""
    for module in part.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def largest_shard_on_meta(part: torch.nn.Module, cfg: ParallelismConfig) -> None:
    """Replace every parameter of `part` (on meta) by the largest local shard `apply_fsdp` gives a rank:
    data-parallel rank 0's (torch chunks a dimension of n rows into pieces of ceil(n / shards) first).

    Routed experts are sharded over `dp / ep` ranks when `ep` > 1, every other parameter over `dp`, along
    the dimension `_within_each_expert` names. For host-memory estimates (`trainer.estimates.host_estimate`)."""
    for module in part.modules():
        expert_group = cfg.ep > 1 and isinstance(module, GroupedExperts)
        shards = cfg.dp // cfg.ep if expert_group else cfg.dp
        for name, param in list(module.named_parameters(recurse=False)):
            shape = list(param.shape)
            dim = (_within_each_expert(param) or Shard(0)).dim
            shape[dim] = -(-shape[dim] // shards)
            setattr(module, name, torch.nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta")))


def _within_each_expert(param: torch.nn.Parameter) -> Shard | None:
    """Stacked expert weights [experts, out, in] are sharded along `out`, as each expert's own weight would
    be: every rank holds a part of every expert (an expert is a unit of snapshot and freezing). Others: Shard(0)."""
    return Shard(1) if param.dim() == 3 else None
