"""Activation bytes of one micro-batch on a pipeline stage, traced on the meta device (nothing allocated).

The stage's own modules (cut as `parallelisms.pipeline` cuts them, parameters cast to the compute dtype as
FSDP's mixed precision casts them) run one training forward, and its loss on the last stage, on meta
tensors of the configured micro-batch shape, under `torch.autograd.graph.saved_tensors_hooks`: every
tensor autograd keeps for backward is seen. What a micro-batch keeps alive is the union of their
storages (a storage saved twice counts once; parameters and buffers are state, not activations) with
the stage's input and output (the pipeline keeps both until the micro-batch's backward).

Two kernels cannot be traced on meta as the accelerator runs them, so the trace substitutes what the
CUDA kernels save (`kernels="cuda"`, the default): scaled-dot-product attention saves q, k, v, its
output and the FP32 log-sum-exp (flash attention; meta would take the math path and save the S x S
scores), and RMSNorm saves its input and the FP32 reciprocal RMS (`_fused_rms_norm`). `kernels="cpu"`
keeps the CPU's RMSNorm (its composite saves the FP32 upcast input and product too; CPU attention is a
flash kernel with the saved set above): the trace that `tests/test_memory_estimate.py` holds against
real CPU tensors. Grouped expert GEMMs are replaced by shape-only products (their saved tensors are
their inputs, unchanged). Routing keeps every assignment (`capacity_factor` is taken as 0: an upper
bound) and with expert parallelism a rank's experts see top_k rows per token, the balanced average.

Every mode of `training.activation_checkpoint` is figured from the one trace: a checkpointed block (every
block under `full`, those of even layer id under `selective`: `parallelisms.activation_checkpoint`) keeps
only its input, the others what they saved, and what runs outside the blocks (embedding, final norm,
loss) keeps what it saved; backward recomputes one checkpointed block at a time, when the blocks after it
have freed what they kept (`recompute`: the most this adds to `saved`). Eager
kernels are assumed: `training.compile`'s fused kernels may save less.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode

import models.experts
from models import Transformer
from models.moe import MoE
from parallelisms.fsdp import DTYPES
from parallelisms.pipeline import split_model
from trainer.config import Config

try:  # `training.activation_checkpoint`'s choice of blocks, where the trainer has it
    from parallelisms.activation_checkpoint import MODES, checkpointed_layers
except ImportError:  # before it: the same rule (full: every block, selective: even layer ids)
    MODES = ("none", "full", "selective")

    def checkpointed_layers(layer_ids: list[int], mode: str) -> list[int]:
        return [i for i in layer_ids if mode == "full" or (mode == "selective" and i % 2 == 0)]


Kernels = str  # "cuda" | "cpu": whose RMSNorm the trace models (see the module docstring)


@dataclass
class StageActivations:
    """One stage's activation bytes per micro-batch, by `training.activation_checkpoint` mode; see the
    module docstring."""

    stage: int
    saved: dict[str, int]  # mode -> bytes alive from a micro-batch's forward to its backward
    recompute: dict[str, int]  # mode -> bytes above `saved` while backward recomputes a checkpointed block
    largest_block: int  # the largest block's saved bytes (without checkpointing)
    loss_transient: int  # last stage: one loss chunk's logits recomputed in backward, and their gradient


@dataclass
class _Trace:
    """Storages saved during one traced forward: key -> (bytes, block that saved it first or None)."""

    excluded: set[int]
    storages: dict[int, tuple[int, str | None]] = field(default_factory=dict)
    block_inputs: dict[int, tuple[int, str]] = field(default_factory=dict)  # key -> (bytes, block)
    block: str | None = None
    # every tensor keyed, held to the trace's end: a freed storage's address (its key) could be reused
    held: list[torch.Tensor] = field(default_factory=list)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.held.append(tensor)
        key = _key(tensor)
        if key not in self.excluded and key not in self.storages:
            self.storages[key] = (tensor.untyped_storage().nbytes(), self.block)
        return tensor

    def union(self, keys: dict[int, int]) -> int:
        """Bytes of the saved storages and of `keys` (storage -> bytes), each once."""
        every = {k: n for k, (n, _) in self.storages.items()} | keys
        return sum(n for k, n in every.items() if k not in self.excluded)

    def block_bytes(self, block: str) -> int:
        """Bytes of the storages `block` saved first."""
        return sum(n for n, owner in self.storages.values() if owner == block)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class _FlashAttention(torch.autograd.Function):
    """Shape-only attention saving what CUDA's (and CPU's) flash kernel saves: q, k, v, out, log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the trace has no backward
        raise NotImplementedError


class _FusedRMSNorm(torch.autograd.Function):
    """Shape-only RMSNorm saving what CUDA's `_fused_rms_norm` saves: its input, weight and FP32 1/RMS."""

    @staticmethod
    def forward(ctx, x, weight):
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):  # never run: the trace has no backward
        raise NotImplementedError


class _AcceleratorKernels(TorchFunctionMode):
    """Attention (always) and RMSNorm (`kernels="cuda"`) as the accelerator's kernels save them."""

    def __init__(self, kernels: Kernels):
        super().__init__()
        self.fused_norm = kernels == "cuda"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _FlashAttention.apply(*args[:3])
        if self.fused_norm and func in (F.rms_norm, torch.rms_norm):
            return _FusedRMSNorm.apply(args[0], args[2] if len(args) > 2 else kwargs.get("weight"))
        return func(*args, **kwargs)


def _shape_only_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`models.experts.grouped_mm`'s result shape on meta (row-grouped form, the only one a forward uses)."""
    return a.new_empty((a.shape[0], b.shape[-1]))


@contextlib.contextmanager
def traced(part: nn.Module, kernels: Kernels) -> Iterator[_Trace]:
    """Record what autograd saves while `part` (on meta) runs forward inside this context."""
    trace = _Trace({_key(t) for t in [*part.parameters(), *part.buffers()]})
    hooks = []
    for name, block in part.layers.items():
        hooks.append(block.register_forward_pre_hook(lambda m, args, name=name: _enter(trace, name, args[0])))
        hooks.append(block.register_forward_hook(lambda m, args, out: setattr(trace, "block", None)))
    try:
        with (
            mock.patch.object(models.experts, "grouped_mm", _shape_only_grouped_mm),
            _AcceleratorKernels(kernels),
            saved_tensors_hooks(trace.pack, lambda t: t),
        ):
            yield trace
    finally:
        for hook in hooks:
            hook.remove()


def _enter(trace: _Trace, name: str, x: torch.Tensor) -> None:
    trace.block = name
    trace.held.append(x)
    trace.block_inputs.setdefault(_key(x), (x.untyped_storage().nbytes(), name))


def stage_modules(cfg: Config, pp_rank: int, whole: nn.Module | None = None) -> tuple[list[int], list[nn.Module]]:
    """(stage ids, stage modules on meta) of pipeline rank `pp_rank`, cut from `whole` (the model on meta,
    built when not given), every parameter in the compute dtype, training mode, routing without capacity
    dropping, the loss chunked as configured."""
    if whole is None:
        with torch.device("meta"):
            whole = Transformer(cfg.model)
    stage_ids, parts = split_model(whole, cfg.parallelism, pp_rank)
    dtype = DTYPES[cfg.training.mixed_precision]
    for part in parts:
        part.train()
        part.loss_chunk_tokens = cfg.training.loss_chunk_tokens
        for p in part.parameters():
            p.data = p.data.to(dtype)
        for moe in [m for m in part.modules() if isinstance(m, MoE)]:
            moe.capacity_factor = 0.0
    return stage_ids, parts


def micro_batch_shape(cfg: Config) -> tuple[int, int]:
    """(sequences, tokens per sequence) of one micro-batch on one data-parallel rank."""
    t = cfg.training
    return t.batch_size // (t.micro_batches * cfg.parallelism.dp), t.seq_len


def trace_stage(cfg: Config, stage: int, part: nn.Module, kernels: Kernels = "cuda") -> StageActivations:
    """`part` (stage `stage` from `stage_modules`) traced over one micro-batch of `cfg`'s shape."""
    b, s = micro_batch_shape(cfg)
    dtype, n_stages = DTYPES[cfg.training.mixed_precision], cfg.parallelism.pp * cfg.parallelism.stages_per_rank
    last = stage == n_stages - 1
    if part.tok_embeddings is not None:
        x = torch.empty(b, s, dtype=torch.long, device="meta")
    else:
        x = torch.empty(b, s, cfg.model.dim, dtype=dtype, device="meta", requires_grad=True)
    with traced(part, kernels) as trace:
        out = part(x)
        if last:
            part.loss(out, torch.empty(b, s, dtype=torch.long, device="meta"))
    io = {_key(x): x.untyped_storage().nbytes(), _key(out): out.untyped_storage().nbytes()}
    loss = _loss_transient(cfg, part, out, kernels) if last else 0
    blocks = [int(key) for key in part.layers]
    saved, recompute = {}, {}
    for mode in MODES:
        chosen = {str(i) for i in checkpointed_layers(blocks, mode)}
        kept = {k: n for k, (n, block) in trace.storages.items() if block is None or block not in chosen}
        inputs = {k: n for k, (n, block) in trace.block_inputs.items() if block in chosen}
        saved[mode] = sum((kept | inputs | io).values())
        recompute[mode] = _recompute_extra(trace, [str(i) for i in blocks], chosen)
    largest = max((trace.block_bytes(str(b)) for b in blocks), default=0)
    return StageActivations(stage, saved, recompute, largest, loss)


def _recompute_extra(trace: _Trace, blocks: list[str], chosen: set[str]) -> int:
    """Bytes above a micro-batch's saved ones while backward recomputes a checkpointed block: that block's
    activations, less what the blocks after it (whose backward has run) kept; the worst block."""
    extra, freed = 0, 0
    for block in reversed(blocks):
        if block in chosen:
            extra = max(extra, trace.block_bytes(block) - freed)
            freed += next((n for n, owner in trace.block_inputs.values() if owner == block), 0)
        else:
            freed += trace.block_bytes(block)
    return extra


def _loss_transient(cfg: Config, part: nn.Module, out: torch.Tensor, kernels: Kernels) -> int:
    """Backward of the loss: one chunk's forward recomputed (its saved bytes) and the FP32 gradient of its
    logits; unchunked, the logits are saved already and only their gradient comes on top."""
    tokens = out.shape[0] * out.shape[1]
    chunk = min(cfg.training.loss_chunk_tokens, tokens) if cfg.training.loss_chunk_tokens > 0 else tokens
    grad = chunk * cfg.model.vocab_size * 4
    if cfg.training.loss_chunk_tokens <= 0:
        return grad
    hidden = out.flatten(0, 1)[:chunk].detach().requires_grad_()
    with traced(part, kernels) as trace:
        part._summed_loss(hidden, torch.empty(chunk, dtype=torch.long, device="meta"))
    return trace.union({}) + grad


def trace_rank(cfg: Config, pp_rank: int, kernels: Kernels = "cuda") -> list[StageActivations]:
    """Every local stage of pipeline rank `pp_rank`, traced."""
    stage_ids, parts = stage_modules(cfg, pp_rank)
    return [trace_stage(cfg, s, part, kernels) for s, part in zip(stage_ids, parts)]
