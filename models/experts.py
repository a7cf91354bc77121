"""The routed experts of one MoE layer, stored stacked and computed with grouped GEMM.

``w1``, ``w3`` [n, hidden, dim] and ``w2`` [n, dim, hidden]: slice ``i`` is the ``nn.Linear`` weight of
the SwiGLU expert with global id ``first_id + i``, so an expert computes ``w2[i] (silu(w1[i] x) * w3[i] x)``.
The tokens arrive grouped by expert; one grouped GEMM per projection runs every group, with no Python
loop over experts and, unless some experts are frozen, no host synchronisation.

Each expert stays a unit of its own outside this module: :func:`expert_tensor_names` names slice ``i`` of
``layers.3.moe.experts.w1`` ``layers.3.moe.experts.<first_id + i>.w1.weight``, the name checkpoints,
digests and the fault-tolerance operators use in every parallel layout; :meth:`GroupedExperts.set_frozen`
freezes single experts: their weight-gradient GEMM is skipped (the gradient slice is zero) while the
others train, and the input gradient still flows through them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS = ("w1", "w2", "w3")  # w2 is the down projection
LOW_PRECISION = (torch.bfloat16, torch.float16)


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts (global ids ``first_id .. first_id + n - 1``) of ``hidden`` units over ``dim``."""

    def __init__(self, n: int, dim: int, hidden: int, first_id: int = 0):
        super().__init__()
        self.n, self.first_id = n, first_id
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.frozen = [False] * n  # host-side: frozen experts get no weight gradient
        self.fp32_gemm = False  # CPU bf16: products by SGEMM on upcast operands (parallelisms.precision)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear``'s default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (the model's ``init_weights`` overrides it)."""
        for w in WEIGHTS:
            weight = getattr(self, w)
            bound = 1 / math.sqrt(weight.shape[-1])
            weight.uniform_(-bound, bound)

    @property
    def ids(self) -> range:
        return range(self.first_id, self.first_id + self.n)

    def set_frozen(self, index: int, frozen: bool) -> None:
        self.frozen[index] = frozen

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim]: token copies grouped by expert, ``counts`` [n] rows each (a tensor) -> [N, dim]."""
        offsets = counts.cumsum(0).to(torch.int32)
        frozen = tuple(self.frozen) if any(self.frozen) else None
        h1 = _GroupedLinear.apply(x, self.w1, offsets, frozen, self.fp32_gemm)
        h3 = _GroupedLinear.apply(x, self.w3, offsets, frozen, self.fp32_gemm)
        return _GroupedLinear.apply(F.silu(h1) * h3, self.w2, offsets, frozen, self.fp32_gemm)

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` (local) alone on rows x [..., dim], by ``F.linear``: the reference computation."""
        return F.linear(F.silu(F.linear(x, self.w1[index])) * F.linear(x, self.w3[index]), self.w2[index])

    def params_per_expert(self) -> int:
        return sum(getattr(self, w)[0].numel() for w in WEIGHTS)


def expert_tensor_names(prefix: str, weight: str, ids: range) -> list[str]:
    """Per-expert global names of the slices of the stacked ``<prefix>.<weight>`` (prefix: ``layers.3.moe.experts``)."""
    return [f"{prefix}.{e}.{weight}.weight" for e in ids]


def stacked_experts(model: nn.Module) -> dict[str, tuple[GroupedExperts, list[str]]]:
    """Every stacked expert parameter of ``model`` by its name: (its module, the per-expert name of each slice)."""
    out = {}
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for weight in WEIGHTS:
                out[f"{prefix}.{weight}"] = (module, expert_tensor_names(prefix, weight, module.ids))
    return out


def unstack(name: str, tensor: torch.Tensor, stacked: dict[str, tuple[GroupedExperts, list[str]]]):
    """(per-expert name, slice) of a stacked tensor (a full or local parameter, or its optimizer state);
    ``(name, tensor)`` itself otherwise. A 0-dim tensor (AdamW's step) is every expert's."""
    if name not in stacked:
        return [(name, tensor)]
    names = stacked[name][1]
    return [(n, tensor if tensor.dim() == 0 else tensor[i]) for i, n in enumerate(names)]


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of ``model`` as checkpoints name it: each expert's slice of a stacked weight apart."""
    stacked = stacked_experts(model)
    return [pair for name, p in model.named_parameters() for pair in unstack(name, p, stacked)]


def grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """FLOPs of one ``torch._grouped_mm`` (either form: every row or column of ``a`` meets one group's ``b``),
    for ``FlopCounterMode(custom_mapping=GROUPED_MM_FLOPS)``, which does not count it by itself."""
    return 2 * math.prod(a_shape) * b_shape[-1]


GROUPED_MM_FLOPS = {torch.ops.aten._grouped_mm: grouped_mm_flops}


def _aligned(*tensors: torch.Tensor) -> bool:
    """Grouped GEMM needs every stride but the unit one to be a multiple of 16 bytes."""
    return all(all(s == 1 or (s * t.element_size()) % 16 == 0 for s in t.stride()) for t in tensors)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``: a [N, K] @ b [n, K, M] per row group -> [N, M]; or a [K, N] @ b [N, M] per
    column group -> [n, K, M] (an empty group gives zeros). Shapes it does not take (strides that are not
    multiples of 16 bytes: tiny test models) run as one ``mm`` per group, the same products."""
    if _aligned(a, b):
        return torch._grouped_mm(a, b, offs=offsets)
    bounds = [0, *offsets.tolist()]
    if b.dim() == 3:
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(bounds, bounds[1:])])


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of group g] = x[rows of group g] @ w[g].T``; frozen groups get a zero weight gradient, and
    their rows take no part in the weight-gradient GEMM."""

    @staticmethod
    def forward(ctx, x, w, offsets, frozen: tuple[bool, ...] | None, fp32: bool) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, w, offsets)
        ctx.frozen, ctx.fp32 = frozen, fp32 and x.device.type == "cpu" and x.dtype in LOW_PRECISION
        a, b = (x.float(), w.float()) if ctx.fp32 else (x, w)
        return grouped_mm(a, b.transpose(-2, -1), offsets).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()  # e.g. the expanded gradient of a sum
        g, xs, ws = (grad.float(), x.float(), w.float()) if ctx.fp32 else (grad, x, w)
        grad_x = grouped_mm(g, ws, offsets).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1] and not (ctx.frozen and all(ctx.frozen)):
            if ctx.frozen:  # the rows of active experts only, each group as in training: the same products
                g, xs, offsets = _active_rows(g, xs, offsets, ctx.frozen)
            grad_w = grouped_mm(g.transpose(0, 1), xs, offsets).to(w.dtype)
        return grad_x, grad_w, None, None, None


def _active_rows(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, frozen: tuple[bool, ...]):
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    active = torch.tensor([not f for f in frozen], device=counts.device)
    rows = torch.repeat_interleave(active, counts.long())
    kept = (counts * active).cumsum(0).to(torch.int32)
    return g[rows], x[rows], kept
