"""Throughput of parallel layouts on CPU, and the measured pipeline bubble against theory.

    python -m benchmarks.parallel_scaling [--steps 12] [--rounds 2] [--skip-scaling] [--skip-bubble]

1. Scaling: runs `train.py` on the debug config (4 layers, batch 16 x 128 tokens, 4 micro-batches)
   as real subprocesses (torchrun when nproc > 1, OMP_NUM_THREADS=1), the layouts interleaved
   round-robin over --rounds. Per layout: the median `tok_per_s` over all logged steps except the
   first 2 of each run, and its speedup over the single process.
2. Bubble: re-launches this file under torchrun with --worker for pp=2 and pp=4 (1F1B, M=4 and 8).
   Each rank builds its stage like train.py's `build_training`, times `schedule.step` (median
   T_step, barrier to barrier) and, taking turns with no communication, its own stage's
   forward+backward of one micro-batch (median t_stage). For the bottleneck stage (largest t_stage)
   it prints measured = 1 - M * t_stage / T_step next to the 1F1B theory (S-1) / (M+S-1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.overhead import recorded_steps
from benchmarks.variants import QUIET
from parallelisms import collectives
from parallelisms.distributed import device_type, init_distributed, shutdown_distributed
from parallelisms.mesh import ParallelismConfig, build_mesh
from parallelisms.pipeline import lm_loss
from train import build_training
from trainer.config import load_config

CONFIG = "train_configs/debug_moe.toml"
COMMON = [
    *("--model.n_layers", "4", "--training.batch_size", "16", "--training.micro_batches", "4"),
    *("--training.seq_len", "128", *QUIET),
]
VARIANTS = {  # name: (processes, parallelism overrides)
    "1proc": (1, []),
    "dp2": (2, ["--parallelism.dp", "2"]),
    "pp2": (2, ["--parallelism.pp", "2"]),
    "dp4_ep4": (4, ["--parallelism.dp", "4", "--parallelism.ep", "4"]),
    "pp4": (4, ["--parallelism.pp", "4"]),
    "pp2_dp2": (4, ["--parallelism.pp", "2", "--parallelism.dp", "2"]),
}
SKIP_STEPS = 2  # warm-up steps left out of each run's median
# Bubble harness: stage compute ~20+ ms per micro-batch so gloo P2P (~1-3 ms) stays small.
BUBBLE_MODEL = ["--model.n_layers", "4", "--model.dim", "128", "--training.seq_len", "128"]
BUBBLE_MB, BUBBLE_M, BUBBLE_WARMUP, BUBBLE_ITERS = 8, (4, 8), 2, 8


def launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


def run_checked(cmd: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return proc.stdout


def run_variant(name: str, steps: int) -> list[float]:
    """tok_per_s of every logged step after the first SKIP_STEPS of one training run."""
    nproc, extra = VARIANTS[name]
    out = run_checked(
        [*launcher(nproc), "train.py", "--config", CONFIG, *COMMON, "--training.steps", str(steps), *extra]
    )
    rates = [record["tok_per_s"] for step, record in recorded_steps(out).items() if step > SKIP_STEPS]
    if not rates:
        raise RuntimeError(f"{name}: no step records after step {SKIP_STEPS} for output:\n{out[-2000:]}")
    return rates


def scaling(steps: int, rounds: int) -> None:
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(rounds):  # round-robin so machine noise spreads over all layouts
        for name in VARIANTS:
            rates[name] += run_variant(name, steps)
        print(f"# scaling round {r + 1}/{rounds} done", flush=True)
    base = statistics.median(rates["1proc"])
    for name, (nproc, _) in VARIANTS.items():
        median = statistics.median(rates[name])
        print(f"variant={name} nproc={nproc} tok_per_s={median:.1f} speedup={median / base:.2f}")
    print(
        f"note: this machine has {os.cpu_count()} CPU cores; nproc=4 variants oversubscribe them "
        f"(OMP_NUM_THREADS=1 per process), so their speedups mostly measure contention."
    )


# ---------------------------------------------------------------- bubble worker (runs under torchrun)


def time_schedule(model, inputs, targets) -> float:
    """Median wall time of one pipeline step, barrier to barrier (the slowest rank's makespan)."""
    times = []
    for _ in range(BUBBLE_WARMUP + BUBBLE_ITERS):
        for part in model.parts:
            part.zero_grad(set_to_none=True)
        args = (inputs,) if model.has_first_stage else ()
        losses = [] if model.has_last_stage else None
        collectives.barrier()
        start = time.perf_counter()
        model.schedule.step(
            *args, target=targets if model.has_last_stage else None, losses=losses, return_outputs=False
        )
        collectives.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[BUBBLE_WARMUP:])


def time_stage(model, tokens, targets, dim: int) -> float:
    """Median forward+backward time of this rank's stage on one micro-batch, no communication."""
    part, times = model.parts[0], []
    for _ in range(BUBBLE_WARMUP + BUBBLE_ITERS):
        part.zero_grad(set_to_none=True)
        x = tokens if model.has_first_stage else torch.randn(*tokens.shape, dim, requires_grad=True)
        start = time.perf_counter()
        out = part(x)
        if model.has_last_stage:
            lm_loss(out, targets).backward()
        else:
            out.backward(torch.randn_like(out))
        times.append(time.perf_counter() - start)
    return statistics.median(times[BUBBLE_WARMUP:])


def bubble_point(dims, pp: int, micro: int) -> tuple[float, float]:
    """(T_step, this rank's t_stage) for 1F1B over `pp` stages with `micro` micro-batches."""
    cfg = load_config(
        CONFIG,
        [
            *BUBBLE_MODEL,
            "--parallelism.pp",
            str(pp),
            "--parallelism.schedule",
            "1F1B",
            "--training.micro_batches",
            str(micro),
            "--training.batch_size",
            str(micro * BUBBLE_MB),
        ],
    )
    model, _ = build_training(cfg, dims)
    torch.manual_seed(0)  # every rank draws the same batch; stage 0 uses the tokens, the last the targets
    tokens = torch.randint(cfg.model.vocab_size, (micro * BUBBLE_MB, cfg.training.seq_len))
    targets = torch.randint(cfg.model.vocab_size, tokens.shape)
    t_step = time_schedule(model, tokens, targets)
    t_stage = 0.0
    for turn in range(dist.get_world_size()):  # one rank at a time: the others wait in the barrier
        if turn == dist.get_rank():
            t_stage = time_stage(model, tokens[:BUBBLE_MB], targets[:BUBBLE_MB], cfg.model.dim)
        collectives.barrier()
    return t_step, t_stage


def worker(pp: int) -> None:
    rank, world = init_distributed()
    dims = build_mesh(ParallelismConfig(pp=world), device_type())
    for micro in BUBBLE_M:
        t_step, t_stage = bubble_point(dims, pp, micro)
        stage_times = [0.0] * world
        collectives.all_gather_object(stage_times, t_stage)
        if rank == 0:
            slow = max(range(world), key=stage_times.__getitem__)
            measured = 1 - micro * stage_times[slow] / t_step
            theory = (pp - 1) / (micro + pp - 1)
            per_rank = "/".join(f"{t * 1e3:.1f}" for t in stage_times)
            print(
                f"bubble pp={pp} M={micro} measured={measured:.3f} theory={theory:.3f} "
                f"t_step_ms={t_step * 1e3:.1f} t_stage_ms={per_rank} bottleneck_stage={slow}",
                flush=True,
            )
    shutdown_distributed()


def bubble() -> None:
    print(
        f"# bubble: debug model dim=128 n_layers=4 seq_len=128, micro-batch={BUBBLE_MB} sequences, "
        f"1F1B; median of {BUBBLE_ITERS} steps after {BUBBLE_WARMUP} warm-up",
        flush=True,
    )
    for pp in (2, 4):
        out = run_checked([*launcher(pp), "-m", "benchmarks.parallel_scaling", "--worker", "--pp", str(pp)])
        print("".join(line + "\n" for line in out.splitlines() if line.startswith("bubble")), end="", flush=True)
    print(
        f"note: pp=2 fits the {os.cpu_count()} cores; pp=4 runs 4 processes on them, so stages that should run "
        f"concurrently time-share cores, T_step inflates and measured > theory there. t_stage is timed one "
        f"rank at a time (uncontended); gloo P2P adds ~1-3 ms per micro-batch per stage boundary."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="training steps per scaling run")
    parser.add_argument("--rounds", type=int, default=2, help="round-robin repetitions of all scaling variants")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--skip-bubble", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, default=2, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts.pp)
        return
    if opts.steps <= SKIP_STEPS:
        parser.error(f"--steps must exceed {SKIP_STEPS} (the first {SKIP_STEPS} steps of each run are skipped)")
    started = time.perf_counter()
    if not opts.skip_scaling:
        scaling(opts.steps, opts.rounds)
    if not opts.skip_bubble:
        bubble()
    print(f"# total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
