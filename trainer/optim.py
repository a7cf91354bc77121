"""AdamW over FP32 master weights, warmup+cosine learning rate, global-norm clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from parallelisms import collectives
from trainer.config import TrainingConfig


def _local(tensor):
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class LocalShardAdamW(torch.optim.AdamW):
    """AdamW that updates the local shards of DTensor (FSDP2) parameters directly.

    AdamW is elementwise, so the update is bit for bit the one DTensor dispatch would run on the same
    shards, without DTensor's sharding propagation on every foreach call. That propagation is cached
    per list of tensors, and a replay changes the list every iteration (frozen operators have no
    gradient), where an uncached propagation costs more than the update itself.
    """

    def _init_group(self, group, *lists, **kwargs):
        has_complex = super()._init_group(group, *lists, **kwargs)
        for values in lists:
            if isinstance(values, list):
                values[:] = [_local(v) for v in values]
        return has_complex


def build_optimizer(model: torch.nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm scales and biases are not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return LocalShardAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Learning rate of iteration `step` (1-based): linear warmup, then cosine to `min_lr`."""
    if cfg.warmup_steps > 0 and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> tuple[float, float]:
    """Scale gradients so their global L2 norm is at most `max_norm` (0: no clipping).

    Every rank passes the parameters it holds (FSDP shards, its experts, its pipeline
    stages); each element of the global model lives on exactly one rank's shard, so the
    squared norm is the sum over all ranks. Returns (total_norm, clip_coef) — the scalars
    a replay needs to reproduce the update.
    """
    grads = [p.grad for p in params if p.grad is not None]
    local = [_local(g) for g in grads]
    squared = torch.stack(torch._foreach_norm(local, 2.0)).square().sum() if local else torch.zeros(())
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.all_reduce(squared)
    total_norm = squared.sqrt()
    clip_coef = 1.0
    if max_norm > 0:
        clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).item()
    apply_clip(grads, clip_coef)
    return total_norm.item(), clip_coef


def apply_clip(grads: list[torch.Tensor], clip_coef: float) -> None:
    """Multiply gradients by a (logged or freshly computed) clip coefficient."""
    if clip_coef < 1.0 and grads:
        torch._foreach_mul_([_local(g) for g in grads], clip_coef)  # elementwise: shards suffice
