"""Model FLOPs per token, the device's peak, and the model FLOPs utilisation (MFU) of a step.

The step line's `tflops=` and `mfu=` (trainer/records/metrics.py) and the GPU check's throughput section
(benchmarks/gpu_check/) share the peak table. Model FLOPs count what the model needs, not what the run
executes: activation checkpointing's recomputation and the chunked loss's second head product
(`training.loss_chunk_tokens`) are not counted, as in TorchTitan.
"""

from __future__ import annotations

import torch

from models import Transformer
from models.args import ModelArgs

# Dense bf16 peak of one GPU without sparsity, FLOP/s, by a part of its device name (the first match wins;
# the PCIe and NVL H100 boards run at lower clocks than the SXM module).
BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200", 989e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H800", 989e12),
    ("A100", 312e12),
)


def bf16_peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU called `device_name`, or None for a GPU not in the table."""
    return next((peak for part, peak in BF16_PEAK_FLOPS if part in device_name), None)


def device_peak_flops(device: torch.device, peak_tflops: float = 0.0) -> float | None:
    """The peak FLOP/s MFU is measured against: `peak_tflops` (`metrics.peak_tflops`) when > 0, else the
    dense bf16 peak of a known CUDA device; None otherwise (a CPU has no peak in the table: its MFU is not
    reported rather than guessed)."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type == "cuda":
        return bf16_peak_flops(torch.cuda.get_device_name(device))
    return None


def matmul_params_per_token(args: ModelArgs) -> int:
    """The weights one token is multiplied with: every weight matrix of the model (attention, dense FFNs, router,
    shared experts, output head) but the input embedding (a lookup), and `top_k` of each MoE layer's routed
    experts. Vectors (norm weights, biases) are left out: they scale or add, they do not multiply."""
    with torch.device("meta"):
        model = Transformer(args)
    weights = sum(p.numel() for p in model.parameters() if p.dim() >= 2)  # a tied weight counts once (the head)
    if not args.tie_embeddings:
        weights -= model.tok_embeddings.weight.numel()
    idle = args.n_routed_experts - args.top_k
    return weights - sum(idle * moe.experts.params_per_expert() for moe in model.moe_layers().values())


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs (forward and backward) of one token in a sequence of `seq_len`, TorchTitan's
    `get_num_flop_per_token` with MoE's active weights: 6 per weight it meets (`matmul_params_per_token`: 2 in
    forward, 4 in backward for the input and weight gradients) plus the attention's score and value products,
    12 * n_layers * dim * seq_len (the whole seq_len x seq_len matrix, not halved for causality, as torch's
    FLOP counter counts it)."""
    return 6 * matmul_params_per_token(args) + 12 * args.n_layers * args.dim * seq_len


def step_throughput(flops_per_step: float, seconds: float, devices: int, peak: float | None) -> dict[str, float]:
    """`tflops` (model TFLOP/s per device: a step's FLOPs over the job's `devices` and `seconds`) and, when
    the device's `peak` FLOP/s is known, `mfu` (tflops over the peak, a fraction)."""
    per_device = flops_per_step / seconds / devices
    out = {"tflops": per_device / 1e12}
    if peak:
        out["mfu"] = per_device / peak
    return out
