"""The training state as named tensors, and its layout-independent digest.

Names are global (`layers.3.moe.experts.17.w1.weight`: one expert's slice of a stacked weight);
optimizer tensors are named `optim.<param name>.<key>` (`exp_avg`, `exp_avg_sq`, `step`). The same
state gives the same names and bytes in any parallel layout once consolidated.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from models.experts import stacked_experts, unstack
from parallelisms import collectives


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly FSDP-sharded DTensor) tensor, on CPU."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu()


def named_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor this rank holds, by global name (CPU copies); a stacked expert
    parameter as one tensor per expert (``layers.3.moe.experts.17.w1.weight``, AdamW's step for each)."""
    state: dict[str, torch.Tensor] = {}
    stacked = stacked_experts(model)

    def per_expert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        # each expert's own copy: a slice shares the whole stack's storage, which pickling (gather_object) would
        # then send once per expert
        return [(each, t.clone() if name in stacked else t) for each, t in unstack(name, tensor, stacked)]

    for name, param in model.named_parameters():
        state.update(per_expert(name, _local(param)))
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                state.update((f"optim.{each}.{key}", t) for each, t in per_expert(name, _local(value)))
    return state


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in canonical name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].contiguous()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def consolidated_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor] | None:
    """The whole job's training state on rank 0 (None elsewhere); collective over all ranks.

    Data-parallel replicas hold the same names and values; pipeline stages and expert
    ranks hold disjoint names. The union is the single-process state dict.
    """
    local = named_training_state(model, optimizer)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    collectives.gather_object(local, gathered, dst=0)
    if gathered is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for state in gathered:
        for name, tensor in state.items():
            merged.setdefault(name, tensor)
    return merged
