"""Section 4: forward+backward of a DeepSeek-MoE-16B-shaped pipeline stage in bf16: tokens/s and MFU.

The stage is a middle one (hidden states in and out, no embedding or head) of as many of the config's MoE
layers as fit: one layer's peak memory is measured, then the stage gets what fits in 80% of the free memory
(at most the config's MoE layers). Weights are bf16 (compute weights, as FSDP2's mixed precision gives the
kernels; no optimizer). FLOPs are counted by torch's FlopCounterMode on one forward+backward (the grouped
GEMMs included through `GROUPED_MM_FLOPS`; causal attention is counted as the full score matrix, as torch's
counter does); the timed steps run without the counter.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.gpu_check.report import Section, throughput_fields
from models import Transformer
from models.experts import GROUPED_MM_FLOPS
from parallelisms.pipeline import prune_to_stage
from trainer.config import load_config

CONFIG = "train_configs/deepseek_moe_16b.toml"
SEQUENCES, SEQ_LEN = 2, 4096  # one micro-batch of the config's sequence length
MEMORY_SHARE = 0.8
WARMUP, REPEATS = 2, 5


def moe_stage(n_layers: int, device: torch.device) -> tuple[torch.nn.Module, int]:
    """(a middle stage of `n_layers` MoE layers of the 16B shape, bf16 on `device`; the model dim)."""
    args = load_config(CONFIG).model
    first = args.n_dense_layers  # the dense layers come first: the stage takes MoE layers only
    args.n_layers = first + n_layers
    with torch.device("meta"):
        whole = Transformer(args)
    stage = prune_to_stage(whole, 1, 3, range(first, first + n_layers))
    stage.to_empty(device=device)
    torch.manual_seed(0)
    stage.init_weights()
    return stage.to(torch.bfloat16).train(), args.dim


def stage_input(dim: int, device: torch.device, tokens: int = SEQ_LEN) -> torch.Tensor:
    """A micro-batch of hidden states that needs its gradient, as a middle stage's input does (sent upstream)."""
    return torch.randn(SEQUENCES, tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)


def fwd_bwd(stage: torch.nn.Module, x: torch.Tensor) -> None:
    stage.zero_grad(set_to_none=True)
    x.grad = None
    stage(x).float().square().mean().backward()


def layer_peak_bytes(device: torch.device) -> int:
    """Peak memory of a one-layer stage's forward+backward (weights, gradients, activations)."""
    torch.cuda.empty_cache()  # what earlier sections left cached
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    stage, dim = moe_stage(1, device)
    fwd_bwd(stage, stage_input(dim, device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del stage
    torch.cuda.empty_cache()
    return peak


def timed(stage: torch.nn.Module, x: torch.Tensor, device: torch.device) -> float:
    """Median seconds of a forward+backward, after warm-up."""
    times = []
    for i in range(WARMUP + REPEATS):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fwd_bwd(stage, x)
        torch.cuda.synchronize(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(n_layers: int, device: torch.device) -> tuple[float, float]:
    """(FLOPs, median seconds) of a forward+backward of an `n_layers` stage."""
    stage, dim = moe_stage(n_layers, device)
    x = stage_input(dim, device)
    with FlopCounterMode(display=False, custom_mapping=GROUPED_MM_FLOPS) as counter:
        fwd_bwd(stage, x)
    return counter.get_total_flops(), timed(stage, x, device)


def run(section: Section) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = load_config(CONFIG).model
    n_moe = model.n_layers - model.n_dense_layers
    per_layer = layer_peak_bytes(device)
    free, _ = torch.cuda.mem_get_info(device)
    n_layers = max(1, min(n_moe, int(MEMORY_SHARE * free // per_layer)))
    try:
        result = measure(n_layers, device)
    except torch.OutOfMemoryError:  # the one-layer peak did not scale: half as many layers, once
        result = None
    if result is None:  # outside the handler: the failed stage's frames (and memory) are gone
        gc.collect()
        torch.cuda.empty_cache()
        n_layers = max(1, n_layers // 2)
        result = measure(n_layers, device)
    flops, seconds = result
    name = torch.cuda.get_device_name(device)
    section.notes.append(
        f"device={name!r} layers={n_layers} of {n_moe} (one layer's peak {per_layer / 2**30:.1f} GiB, "
        f"{free / 2**30:.0f} GiB free) tokens={SEQUENCES * SEQ_LEN} step_ms={seconds * 1e3:.1f} "
        f"flops_per_step={flops:.3e}"
    )
    section.notes.append(throughput_fields(flops, SEQUENCES * SEQ_LEN, seconds, name))
