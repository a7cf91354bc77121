"""bf16 matrix products on CPUs without native bf16 instructions.

On an AVX2-only CPU, PyTorch's bf16 `mm` falls back to a generic kernel that is about 7x (forward)
to 20x (backward, transposed operands) slower than fp32 SGEMM, so bf16 mixed precision trains
15x slower than fp32. `use_fp32_gemm` swaps every `nn.Linear` of a module (and the grouped GEMMs of
stacked experts) for the same product done by SGEMM on the upcast bf16 operands, rounded back to
bf16: bf16 weights, activations and gradients with fp32 accumulation, the numerics of a bf16 GEMM
with an fp32 accumulator. Results are deterministic (the same SGEMM every time), so replays stay
bit-exact; they are not guaranteed to match the native bf16 kernel's last bit, so a run uses one or
the other throughout.

A frozen weight (`requires_grad=False`) gets no weight-gradient product, as with `F.linear`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.experts import LOW_PRECISION, GroupedExperts


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class _Fp32GemmLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            g2 = g.reshape(-1, g.shape[-1])
            grad_w = (g2.t() @ x.float().reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = g.reshape(-1, g.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype in LOW_PRECISION:
        return _Fp32GemmLinear.apply(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def use_fp32_gemm(module: nn.Module) -> int:
    """Route the CPU bf16 products of every `nn.Linear` and every grouped expert GEMM in `module` through
    SGEMM; returns how many modules."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    for linear in linears:
        linear.forward = _linear_forward.__get__(linear)
    grouped = [m for m in module.modules() if isinstance(m, GroupedExperts)]
    for experts in grouped:
        experts.fp32_gemm = True
    return len(linears) + len(grouped)
