"""FSDP2 (`fully_shard`) data parallelism and bf16 mixed precision."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, mixed_precision: str) -> None:
    """Shard each transformer block, then the root (embedding, norm, head).

    Parameters stay FP32 (the master weights); forward and backward run on compute
    weights of `mixed_precision` dtype; gradients are reduced and kept in FP32.
    """
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[mixed_precision], reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
