"""One training iteration and one validation pass over this rank's model parts.

Iteration `step` (1-based) consumes batch `step` and turns state_step into
state_{step+1}. Dropout RNG is re-seeded before every stage forward from (seed, step,
micro-batch, stage, data-parallel rank), never from history, so any iteration can be
re-run bit for bit in the same layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallelisms import collectives
from parallelisms.fsdp import reshard
from parallelisms.mesh import ParallelDims
from parallelisms.parallelize import ModelParts
from trainer.config import TrainingConfig
from trainer.optim import apply_clip, clip_grad_norm, lr_at, set_lr


@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the iteration's global batch
    aux_loss: float  # load-balancing loss of the last micro-batch, summed over MoE layers
    grad_norm: float  # global gradient norm before clipping
    clip_coef: float  # factor the gradients were scaled by (1.0: not clipped)
    lr: float


def derive_seed(*keys: int) -> int:
    """A 63-bit RNG seed that depends only on its arguments."""
    digest = hashlib.sha256(":".join(map(str, keys)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class DropoutSeeder:
    """Seeds torch's RNG before each forward of each stage module: (seed, step, micro-batch, stage, dp rank)."""

    def __init__(self, model: ModelParts, seed: int, dp_rank: int):
        self.seed, self.dp_rank, self.step = seed, dp_rank, 0
        self.calls = dict.fromkeys(model.stage_ids, 0)
        for part, stage in zip(model.parts, model.stage_ids):
            part.register_forward_pre_hook(lambda _module, _args, stage=stage: self._seed(stage))

    def begin(self, step: int) -> None:
        self.step = step
        self.calls = dict.fromkeys(self.calls, 0)

    def _seed(self, stage: int) -> None:
        torch.manual_seed(derive_seed(self.seed, self.step, self.calls[stage], stage, self.dp_rank))
        self.calls[stage] += 1


def moe_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """MoE layers by name: the modules that keep per-expert token counts."""
    return {name: m for name, m in module.named_modules() if hasattr(m, "tokens_per_expert")}


def set_aux_grad_scale(module: torch.nn.Module, scale: float) -> None:
    """Weight the load-balancing loss gradient like the language-model loss of one micro-batch."""
    for moe in moe_modules(module).values():
        moe.aux_grad_scale = scale


def take_expert_load(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(routed-token counts, summed gate probabilities) per expert since the last call, by MoE layer; resets them."""
    tokens, gate_probs = {}, {}
    for name, moe in moe_modules(module).items():
        tokens[name] = moe.tokens_per_expert.detach().clone()
        gate_probs[name] = moe.gate_prob_sum.detach().clone()
        moe.reset_load_stats()
    return tokens, gate_probs


def forward_backward(model: ModelParts, inputs: torch.Tensor, labels: torch.Tensor, micro: int) -> torch.Tensor:
    """Run every micro-batch forward and backward; return the local mean loss (0 off the last stage)."""
    if model.schedule is not None:
        losses = [] if model.has_last_stage else None
        args = (inputs,) if model.has_first_stage else ()
        model.schedule.step(*args, target=labels if model.has_last_stage else None, losses=losses, return_outputs=False)
        return torch.stack(losses).detach().double().mean() if losses else _zero(inputs.device)
    part = model.parts[0]
    loss_sum = _zero(inputs.device)
    for m, (x, y) in enumerate(zip(inputs.chunk(micro), labels.chunk(micro))):
        if hasattr(part, "set_requires_gradient_sync"):  # FSDP: reduce once, after the last micro-batch
            part.set_requires_gradient_sync(m == micro - 1)
        loss = part.loss(part(x), y)
        (loss / micro).backward()
        loss_sum += loss.detach().double()
    return loss_sum / micro


def _zero(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64, device=device)


def _global_mean_loss(loss: torch.Tensor, dims: ParallelDims) -> float:
    """The loss from the last pipeline stage, averaged over data-parallel ranks, on every rank."""
    if dims.cfg.pp > 1:
        collectives.broadcast(loss, group=dims.group("pp"), group_src=dims.cfg.pp - 1)
    if dims.cfg.dp > 1:
        collectives.all_reduce(loss, group=dims.group("dp"))
        loss /= dims.cfg.dp
    return float(loss)


def _aux_loss(model: ModelParts, dims: ParallelDims) -> float:
    """The load-balancing loss summed over every MoE layer, averaged over data-parallel ranks. Added layer by
    layer in float64 on the device, as Python would add the floats, but with one host read, not one per layer."""
    aux = _zero(dims.device)
    for moe in moe_modules(model.view).values():
        aux += moe.last_aux_loss.to(aux.device, torch.float64)
    if dist.get_world_size() > 1:
        collectives.all_reduce(aux)
        aux /= dims.cfg.dp
    return float(aux)


def train_step(
    model: ModelParts,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    step: int,
    cfg: TrainingConfig,
    dims: ParallelDims,
    before_clip: Callable[[], None] | None = None,
) -> StepResult:
    """Forward/backward over `cfg.micro_batches` micro-batches, clip, AdamW step (`before_clip`: called
    just before the gradient-norm all-reduce)."""
    for part in model.parts:
        part.train()
    optimizer.zero_grad(set_to_none=True)
    inputs, labels = inputs.to(dims.device, non_blocking=True), labels.to(dims.device, non_blocking=True)
    loss = forward_backward(model, inputs, labels, cfg.micro_batches)
    # Every collective of the iteration ends with the gradient-norm all-reduce: after it a rank only updates
    # its own state, so a rank that passed it can finish the iteration alone (trainer/lifecycle/survival.py).
    mean_loss, aux_loss = _global_mean_loss(loss, dims), _aux_loss(model, dims)
    params = [p for p in model.view.parameters() if p.requires_grad]
    if before_clip is not None:
        before_clip()
    grad_norm, clip_coef = clip_grad_norm(params, cfg.max_grad_norm)
    lr = lr_at(step, cfg)
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(mean_loss, aux_loss, grad_norm, clip_coef, lr)


def replay_update(model: ModelParts, optimizer: torch.optim.Optimizer, scalars: dict) -> None:
    """The optimizer update of a replayed iteration: the logged clip coefficient and learning rate
    (frozen operators have no gradients, so AdamW leaves them alone); then reset the load statistics."""
    apply_clip([p.grad for p in model.view.parameters() if p.grad is not None], scalars["clip_coef"])
    set_lr(optimizer, scalars["lr"])
    if not scalars.get("skipped", False):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    take_expert_load(model.view)


@torch.no_grad()
def evaluate(
    model: ModelParts, batches: list[tuple[torch.Tensor, torch.Tensor]], dims: ParallelDims, micro: int
) -> float:
    """Mean cross-entropy over fixed validation batches (dropout off, no load counting); the parameters
    are sharded again afterwards, as after a training step."""
    for part in model.parts:
        part.eval()
    total = 0.0
    for x, y in batches:
        x, y = x.to(dims.device), y.to(dims.device)
        if model.schedule is not None:
            losses = [] if model.has_last_stage else None
            args = (x,) if model.has_first_stage else ()
            model.schedule.eval(*args, target=y if model.has_last_stage else None, losses=losses)
            loss = torch.stack(losses).double().mean() if losses else _zero(x.device)
        else:
            loss = torch.stack(
                [model.loss_fn(model.parts[0](xm), ym).double() for xm, ym in zip(x.chunk(micro), y.chunk(micro))]
            ).mean()
        total += _global_mean_loss(loss, dims)
    for part in model.parts:
        reshard(part)
        part.train()
    return total / len(batches)
