"""One training iteration and one validation pass on a single pipeline stage.

Iteration `step` (1-based) consumes batch `step` and turns state_step into
state_{step+1}. Dropout RNG is seeded from (seed, step, micro-batch, rank), never
from history, so any iteration can be re-run bit for bit.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.config import TrainingConfig
from trainer.optim import clip_grad_norm, lr_at, set_lr


@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the iteration's micro-batches
    aux_loss: float  # load-balancing loss summed over MoE layers, mean over micro-batches
    grad_norm: float  # global gradient norm before clipping
    clip_coef: float  # factor the gradients were scaled by (1.0: not clipped)
    lr: float


def derive_seed(seed: int, step: int, micro_batch: int, rank: int) -> int:
    """A 63-bit RNG seed that depends only on its arguments."""
    digest = hashlib.sha256(f"{seed}:{step}:{micro_batch}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def moe_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """MoE layers by name: the modules that keep per-expert token counts."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "tokens_per_expert")}


def set_aux_grad_scale(model: torch.nn.Module, scale: float) -> None:
    """Weight the load-balancing loss gradient like the micro-batch loss (1 / micro-batches)."""
    for module in moe_modules(model).values():
        module.aux_grad_scale = scale


def take_expert_load(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Per-expert routed-token counts since the last call, by MoE layer; resets them."""
    load = {}
    for name, module in moe_modules(model).items():
        load[name] = module.tokens_per_expert.detach().clone()
        module.reset_load_stats()
    return load


def _aux_loss(model: torch.nn.Module) -> float:
    return sum(float(m.last_aux_loss) for m in moe_modules(model).values())


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               labels: torch.Tensor, step: int, cfg: TrainingConfig, seed: int, rank: int) -> StepResult:
    """Forward/backward over `cfg.micro_batches` micro-batches, clip, AdamW step."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    micro = cfg.micro_batches
    loss_sum = torch.zeros((), dtype=torch.float64)
    aux_sum = 0.0
    for m, (x, y) in enumerate(zip(inputs.chunk(micro), labels.chunk(micro))):
        torch.manual_seed(derive_seed(seed, step, m, rank))
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        (loss / micro).backward()
        loss_sum += loss.detach().double()
        aux_sum += _aux_loss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm, clip_coef = clip_grad_norm(params, cfg.max_grad_norm)
    lr = lr_at(step, cfg)
    set_lr(optimizer, lr)
    optimizer.step()
    return StepResult(float(loss_sum) / micro, aux_sum / micro, grad_norm, clip_coef, lr)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy over fixed validation batches (dropout off, no load counting)."""
    model.eval()
    losses = [F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).double() for x, y in batches]
    model.train()
    return float(torch.stack(losses).mean())
