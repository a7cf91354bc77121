"""The bytes of a rank's training state on its accelerator, by arithmetic on the meta device.

As `parallelisms.parallelize` lays them out for world rank `rank` = pp_rank * dp + dp_rank (the mesh is
(pp, edp, ep), row-major: dp_rank = edp_rank * ep + ep_rank):

- Without FSDP (`dp` = 1 and `mixed_precision = "fp32"`) every parameter, gradient and AdamW moment is a
  plain FP32 tensor of the parameter's shape.
- With FSDP2 (`parallelisms.fsdp`): parameters stay FP32 (master weights) and are sharded along dim 0
  (stacked expert weights along dim 1) over dp ranks (routed experts over the dp / ep ranks holding the
  same experts). Torch chunks n rows into pieces of ceil(n / shards) and every rank allocates that padded
  size (`FSDPParam`'s padded shard); gradients are reduced in FP32 (`reduce_dtype`) into one padded
  reduce-scatter output per FSDP group, of which each gradient is a view: the same padded bytes; AdamW
  creates its moments `zeros_like` the unpadded local shard, so they are 2 x 4 bytes per local element.
- AdamW's `step` counters (`foreach`, not `capturable`) are 0-dim FP32 tensors in host memory.
- Buffers (RoPE tables, MoE load statistics) are per stage module and not sharded.

`unsharded`, `root` and `largest_block` count the parameter elements FSDP gathers (the compute weights
and the unsharded gradients that `trainer.estimates.memory_estimate` sizes from them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models import Transformer
from models.experts import GroupedExperts
from parallelisms.pipeline import split_model
from trainer.config import Config

FP32 = 4


@dataclass
class StateBytes:
    """One rank's training state on its accelerator, in bytes (elements where named so)."""

    params: int  # FP32 parameters as allocated (FSDP: padded shards)
    grads: int  # FP32 gradients after the reduction, as allocated
    moments: int  # AdamW exp_avg and exp_avg_sq
    steps_host: int  # AdamW step counters (host memory)
    buffers: int  # module buffers
    unsharded: int  # elements of this rank's parameters as FSDP gathers them (its experts whole)
    root: int  # of them, the elements outside the blocks (embedding, final norm, head)
    largest_block: int  # of them, the elements of the largest block
    fsdp: bool  # whether FSDP2 manages the parameters


def uses_fsdp(cfg: Config) -> bool:
    """Whether `parallelize` applies FSDP2 (data parallelism, or bf16 compute weights)."""
    return cfg.parallelism.dp > 1 or cfg.training.mixed_precision != "fp32"


def rank_parts(cfg: Config, pp_rank: int, whole: nn.Module | None = None) -> list[nn.Module]:
    """Pipeline rank `pp_rank`'s stage modules on meta, whole (unsharded, every expert), cut from `whole`
    (the model on meta, built when not given)."""
    if whole is None:
        with torch.device("meta"):
            whole = Transformer(cfg.model)
    return split_model(whole, cfg.parallelism, pp_rank)[1]


def shard_elements(shape: tuple[int, ...], dim: int, shards: int, index: int) -> tuple[int, int]:
    """(padded, local) elements of shard `index` of `shards` along `dim`: torch.chunk's ceil-sized pieces."""
    rows, rest = shape[dim], 1
    for i, n in enumerate(shape):
        rest *= n if i != dim else 1
    piece = -(-rows // shards)
    return piece * rest, max(0, min(piece, rows - index * piece)) * rest


def rank_state(cfg: Config, rank: int, parts: list[nn.Module] | None = None) -> StateBytes:
    """World rank `rank`'s training state (see the module docstring); `parts`: its pipeline rank's
    `rank_parts`, built when not given. Expert parallelism keeps 1/ep of each layer's experts."""
    p = cfg.parallelism
    pp_rank, dp_rank = divmod(rank, p.dp)
    edp_rank = dp_rank // p.ep
    parts, fsdp = parts if parts is not None else rank_parts(cfg, pp_rank), uses_fsdp(cfg)
    out = StateBytes(0, 0, 0, 0, 0, 0, 0, 0, fsdp)
    seen: set[int] = set()
    for part in parts:
        out.buffers += sum(b.numel() * b.element_size() for b in part.buffers())
        for module in part.modules():
            experts = isinstance(module, GroupedExperts)
            shards, index = (p.dp // p.ep, edp_rank) if experts and p.ep > 1 else (p.dp, dp_rank)
            for param in module.parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                shape = (param.shape[0] // p.ep, *param.shape[1:]) if experts else tuple(param.shape)
                padded, local = shard_elements(shape, 1 if param.dim() == 3 else 0, shards, index)
                if not fsdp:
                    padded = local = math.prod(shape)
                out.params += padded * FP32
                out.grads += padded * FP32
                out.moments += 2 * local * FP32
                out.steps_host += FP32
                out.unsharded += math.prod(shape)
        blocks = [_elements(block, p.ep) for block in part.layers.values()]
        out.largest_block = max([out.largest_block, *blocks])
        out.root += _elements(part, p.ep) - sum(blocks)
    return out


def _elements(module: nn.Module, ep: int) -> int:
    """Parameter elements of `module` on one rank before FSDP: 1/ep of the routed experts."""
    return sum(
        param.numel() // (ep if isinstance(owner, GroupedExperts) else 1)
        for owner in module.modules()
        for param in owner.parameters(recurse=False)
    )
