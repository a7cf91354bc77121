"""Section 1: the debug model's loss and gradients on CUDA against the CPU FP32 reference, and the grouped-GEMM
experts (`torch._grouped_mm` on CUDA) against the per-expert loop.

Both devices start from the same weights (initialised on CPU, copied) and the same tokens. FP32 on CUDA
(TF32 off, torch's default for matmuls) must match element by element to rounding; bf16 (the module cast to
bf16, as FSDP2's mixed precision computes) is judged by the relative L2 error of the whole gradient, since
bf16 rounding may flip a near-tied routing decision and move a few expert gradients a lot.
"""

from __future__ import annotations

import copy

import torch

from benchmarks.gpu_check.report import Check, Section, compare, guarded
from models import build_model
from models.experts import GroupedExperts
from trainer.config import load_config

DEBUG_CONFIG = "train_configs/debug_moe.toml"
FP32 = {"atol": 1e-5, "rtol": 1e-3}  # loss and every gradient element (scaled by the largest gradient below)
BF16_LOSS = {"rtol": 2e-2}
BF16_GRAD_L2 = 5e-2
GROUPED_BF16_L2 = 1e-2  # grouped GEMM against the loop, both in bf16 on the same inputs


def loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, every parameter's gradient flattened in parameter order) of one training forward+backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    loss = model.loss(model(inputs), labels)
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return loss.detach().float().cpu(), grads.cpu()


def model_checks(section: Section, device: str) -> None:
    """CUDA fp32 and bf16 against CPU fp32 (each guarded: one failing does not hide the other)."""
    args = load_config(DEBUG_CONFIG).model
    torch.manual_seed(0)
    cpu_model = build_model(args)
    tokens = torch.randint(0, args.vocab_size, (4, 129), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = loss_and_grads(cpu_model, tokens)
    scale = float(ref_grads.abs().max())

    def fp32() -> list[Check]:
        loss, grads = loss_and_grads(copy.deepcopy(cpu_model).to(device), tokens)
        return [
            compare("fp32 loss", loss, ref_loss, **FP32),
            compare("fp32 grads", grads, ref_grads, atol=FP32["atol"] * scale, rtol=FP32["rtol"]),
        ]

    def bf16() -> list[Check]:
        loss, grads = loss_and_grads(copy.deepcopy(cpu_model).to(device).to(torch.bfloat16), tokens)
        return [
            compare("bf16 loss", loss, ref_loss, **BF16_LOSS),
            compare("bf16 grads", grads, ref_grads, rel_l2=BF16_GRAD_L2),
        ]

    guarded(section, "fp32 model on CUDA", fp32)
    guarded(section, "bf16 model on CUDA", bf16)


def expert_outputs(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Output and the input/weight gradients (flattened together) of the experts, grouped or one by one."""
    experts.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    if grouped:
        out = experts(x, counts)
    else:
        chunks = x.split(counts.tolist())
        out = torch.cat([experts.expert(i, chunk) for i, chunk in enumerate(chunks)])
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    parts = [out, x.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad]
    return torch.cat([t.float().flatten() for t in parts])


def grouped_gemm_checks(section: Section, device: str) -> None:
    """`GroupedExperts` on CUDA (torch._grouped_mm: aligned shapes, one empty group) against the loop."""
    torch.manual_seed(2)
    counts = torch.tensor([37, 0, 120, 5, 64, 1, 90, 11], device=device)
    x = torch.randn(int(counts.sum()), 128, device=device)

    def in_dtype(dtype: torch.dtype, **tolerance) -> list[Check]:
        experts = GroupedExperts(8, 128, 256).to(device, dtype)
        got = expert_outputs(experts, x.to(dtype), counts, grouped=True)
        ref = expert_outputs(experts, x.to(dtype), counts, grouped=False)
        return [compare(f"grouped GEMM {str(dtype).removeprefix('torch.')} vs loop", got, ref, **tolerance)]

    guarded(section, "grouped GEMM bf16", lambda: in_dtype(torch.bfloat16, rel_l2=GROUPED_BF16_L2))
    guarded(section, "grouped GEMM fp32", lambda: in_dtype(torch.float32, atol=1e-4, rtol=1e-4))


def run(section: Section, device: str = "cuda") -> None:
    """`device`: the GPU (another device only to exercise this code: it then compares CPU with CPU)."""
    model_checks(section, device)
    grouped_gemm_checks(section, device)
