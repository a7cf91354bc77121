"""Forward+backward time of one MoE layer (grouped GEMM experts) vs the per-expert loop and a dense SwiGLU.

    python -m benchmarks.moe_layer [--config train_configs/bench_moe.toml] [--tokens N]

Variants, on the same tokens, interleaved over the repeats:
  moe     the MoE layer as the model runs it: stacked experts, one grouped GEMM per projection
  loop    the same layer with its experts as separate SwiGLU modules run one by one (the code before grouping)
  frozen  the MoE layer with half its experts frozen, as in a MoEvement replay: their rows take no part
          in the weight-gradient GEMMs (the share of weight-gradient rows left is printed)
  dense   a SwiGLU of hidden ``top_k * expert_hidden_dim + n_shared * shared_expert_hidden_dim`` (the
          router's dim x E weights are left out)
Prints medians, minima and ``ratio=<median moe / median dense>``.
"""

import argparse
import copy
import dataclasses
import statistics
import time
import tomllib
from pathlib import Path

import torch

from models.args import ModelArgs
from models.ffn import SwiGLU
from models.moe import MoE

# The [model] section of train_configs/bench_moe.toml, used when that file is missing.
BENCH_MOE = dict(
    family="deepseek",
    vocab_size=260,
    dim=512,
    n_layers=8,
    n_heads=8,
    max_seq_len=1024,
    n_dense_layers=1,
    dense_hidden_dim=1536,
    n_routed_experts=32,
    n_shared_experts=1,
    expert_hidden_dim=256,
    shared_expert_hidden_dim=512,
    top_k=4,
    aux_loss_coef=0.01,
)
DEFAULT_TOKENS = 2048


def load_shape(config: Path | None) -> tuple[ModelArgs, int]:
    """ModelArgs from the config's [model] table (unknown keys ignored) and seq_len * batch_size tokens."""
    if config is None or not config.exists():
        return ModelArgs(**BENCH_MOE), DEFAULT_TOKENS
    with config.open("rb") as f:
        cfg = tomllib.load(f)
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    args = ModelArgs(**{k: v for k, v in cfg.get("model", {}).items() if k in known})
    training = cfg.get("training", {})
    n_tokens = training.get("seq_len", 0) * training.get("batch_size", 0) or DEFAULT_TOKENS
    return args, n_tokens


def looped(moe: MoE) -> MoE:
    """The same layer with its experts as separate ``SwiGLU`` modules (copies of the stacked weights) run one
    at a time: the computation before grouping."""
    loop = copy.copy(moe)
    loop._modules = dict(moe._modules)  # the copy's own submodule table: the original stays as it was
    experts = torch.nn.ModuleList(SwiGLU(moe.experts.w1.shape[2], moe.experts.w1.shape[1]) for _ in moe.experts.ids)
    with torch.no_grad():
        for e, expert in enumerate(experts):
            for w in ("w1", "w2", "w3"):
                getattr(expert, w).weight.copy_(getattr(moe.experts, w)[e])
    loop.looped_experts = experts  # registered: zero_grad reaches them

    def run_experts(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        chunks = x.split(counts.tolist())
        return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks, strict=True)])

    loop.run_experts = run_experts
    return loop


def frozen_half(moe: MoE) -> MoE:
    """The same layer with every other expert frozen (a shallow copy: the weights are shared)."""
    frozen = copy.copy(moe)
    frozen._modules = dict(moe._modules)
    frozen.experts = copy.copy(moe.experts)
    frozen.experts.frozen = [e % 2 == 1 for e in range(moe.experts.n)]
    return frozen


def fwd_bwd_seconds(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    module.zero_grad(set_to_none=True)
    x.grad = None
    start = time.perf_counter()
    module(x).backward(grad)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("train_configs/bench_moe.toml"))
    parser.add_argument("--tokens", type=int, default=0, help="override seq_len * batch_size")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    opts = parser.parse_args()
    args, n_tokens = load_shape(opts.config)
    args.validate()
    n_tokens = opts.tokens or n_tokens

    torch.manual_seed(0)
    moe = MoE(args).train()
    n_shared = args.n_shared_experts if moe.shared_experts is not None else 0
    dense_hidden = args.top_k * args.expert_hidden_dim + n_shared * args.shared_expert_hidden_dim
    dense = SwiGLU(args.dim, dense_hidden)
    x = torch.randn(n_tokens, args.dim, requires_grad=True)
    grad = torch.randn(n_tokens, args.dim)
    variants = {"moe": moe, "loop": looped(moe), "frozen": frozen_half(moe), "dense": dense}
    times = {name: [] for name in variants}
    order = list(variants)
    for i in range(opts.warmup + opts.repeats):
        for name in order if i % 2 == 0 else reversed(order):
            elapsed = fwd_bwd_seconds(variants[name], x, grad)
            if i >= opts.warmup:
                times[name].append(elapsed)
    with torch.no_grad():
        counts = torch.bincount(moe.router(x)[2].flatten(), minlength=args.n_routed_experts)
    active_rows = float(counts[0::2].sum() / counts.sum())

    med = {name: statistics.median(t) for name, t in times.items()}
    best = {name: min(t) for name, t in times.items()}
    print(
        f"tokens={n_tokens} dim={args.dim} experts={args.n_routed_experts} top_k={args.top_k} "
        f"expert_hidden={args.expert_hidden_dim} shared={n_shared}x{args.shared_expert_hidden_dim} "
        f"threads={torch.get_num_threads()} repeats={opts.repeats}"
    )
    for name in variants:
        print(f"{name:6s} fwd+bwd median {med[name] * 1e3:9.2f} ms  min {best[name] * 1e3:9.2f} ms")
    print(f"frozen: the weight-gradient GEMMs run over {active_rows:.3f} of the expert rows")
    print(f"grouped/loop median ratio {med['moe'] / med['loop']:.3f}; frozen/moe {med['frozen'] / med['moe']:.3f}")
    print(
        f"dense hidden={dense_hidden}; min ratio {best['moe'] / best['dense']:.3f} (less sensitive to CPU contention)"
    )
    print(f"ratio={med['moe'] / med['dense']:.3f}")


if __name__ == "__main__":
    main()
