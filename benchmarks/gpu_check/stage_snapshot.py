"""MoEvement's snapshots of a DeepSeek-MoE-16B-shaped stage at Algorithm 1's W, on one GPU, against the
arithmetic of `train.py --dry-run`: `python -m benchmarks.gpu_check.stage_snapshot [--layers 1]`.

The stage is `train_configs/deepseek_moe_16b.toml` cut to MoE layers of the 16B shape only (no dense layer, a
byte vocabulary: no embedding or head to speak of, as a middle pipeline stage), as many as `--layers` and as
the host memory allows (both window parities of pinned snapshot buffers, `HOST_BYTES_PER_PARAM`), one GPU,
bf16, `--micro-batches` micro-batches of 2 x 4096 tokens per iteration. `none` and `moevement` (W chosen by
Algorithm 1 from the measured iteration time and device-to-host bandwidth, `metrics.profile` records what it
planned with) alternate for `--rounds`; then `--dry-run` of the same command at that W. Printed, one
`stage16b:` line each: the stage; W, the measured copy bandwidth and the planned iteration time; the bytes
each iteration snapshots (planned from the profile, and measured) and their copy time at the measured
bandwidth against the iteration; the overhead against `none` over the same steady iterations and the stall;
the dry-run's host and pinned bytes at that W against the host memory the run's buffers held.

One layer by default: W and the overhead follow a layer's bytes against its share of the iteration, not the
number of layers (section 4's stage holds 19 of the 27 layers in bf16 without optimizer state; with FP32
master weights and AdamW moments one H100 holds about 5, and their pinned buffers would not fit the host).

Not a section of `make gpu-check` (its sections fill the 9 minutes); benchmarks/gpu_check/on_device.sh runs
both. Without CUDA it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics

import torch

from benchmarks.gpu_check.overhead import overhead_fields
from benchmarks.gpu_check.runs import ROOT, RunFailed, Workspace, train
from benchmarks.overhead import common_start, recorded_steps, steady_ms, steady_records
from models import Transformer
from moevement.checkpoint.schedule import generate_schedule, slot_size_for, snapshot_sizes
from trainer.config import load_config

CONFIG = "train_configs/deepseek_moe_16b.toml"
SEQUENCES, SEQ_LEN, VOCAB = 2, 4096, 260  # a micro-batch of the config's sequence length; the byte tokenizer's
PROFILE_ITERS = 2  # checkpoint.profile_iters' default
MAX_WINDOW = 16  # checkpoint.max_window's default
# Host bytes per parameter of both window parities' snapshot buffers at W <= MAX_WINDOW: a parity's W buffers
# hold each parameter's FP32 state once (12 bytes: weight, two AdamW moments) and its bf16 weight in the
# snapshots before its slot ((W - 1) / 2 of them on average): 12 + (W - 1) bytes a parameter, twice.
HOST_BYTES_PER_PARAM = 2 * (12 + MAX_WINDOW - 1)
RUN_TIMEOUT_S = 150
DRY_RUN_TIMEOUT_S = 60
PINNED = re.compile(r"^pinned_host .*\bsnapshots=([\d.]+) .*\bpinned=([\d.]+)", re.M)
HOST = re.compile(r"^host_memory rank=0 .*\bsnapshots=([\d.]+) .*\bhost_dir=([\d.]+)", re.M)


def stage_args(layers: int, micro_batches: int) -> list[str]:
    """The command line of the stage's runs (strategy and steps apart)."""
    return [
        *("--config", CONFIG, "--model.n_layers", str(layers), "--model.n_dense_layers", "0"),
        *("--model.vocab_size", str(VOCAB), "--data.tokenizer", "byte", "--training.mixed_precision", "bf16"),
        *("--training.batch_size", str(SEQUENCES * micro_batches), "--training.micro_batches", str(micro_batches)),
        *("--training.seq_len", str(SEQ_LEN), "--training.activation_checkpoint", "none"),  # the config's is full
    ]


def stage_params(layers: int) -> int:
    """Parameters of the stage (built on the meta device)."""
    args = load_config(CONFIG).model
    args.n_layers, args.n_dense_layers, args.vocab_size = layers, 0, VOCAB
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(args).parameters())


def host_free_bytes(host_dir: str = "/dev/shm") -> int:
    """What the snapshot buffers may take: the free space of their file system, at most the available memory."""
    free = shutil.disk_usage(host_dir).free
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return min(free, available)


def fitting_layers(requested: int, params_per_layer: int, free: int) -> int:
    """The most layers, up to `requested`, whose snapshot buffers fit in 80% of `free` host bytes (0: none)."""
    return max(0, min(requested, int(0.8 * free) // (HOST_BYTES_PER_PARAM * params_per_layer)))


def planned_snapshot_bytes(profile: dict) -> list[int]:
    """Each snapshot's bytes in the window `metrics.profile` records (count slots over its operator order)."""
    fp32, compute, window = profile["fp32_bytes"], profile["compute_bytes"], profile["window"]
    n = len(fp32)
    cut = generate_schedule(range(n), slot_size_for(n, window), window)
    return snapshot_sizes(cut, fp32, compute)


def copy_fields(sizes: list[int], copy_gbs: float, iteration_s: float) -> str:
    """`snapshot_gb largest=... mean=... copy_s largest=... (<share> of the planned iteration)`."""
    largest, mean = max(sizes), statistics.mean(sizes)
    copy_s = largest / 1e9 / copy_gbs
    return (
        f"snapshot_gb planned largest={largest / 1e9:.2f} mean={mean / 1e9:.2f} copy_s largest={copy_s:.3f} "
        f"({copy_s / iteration_s:.2f} of the planned iteration {iteration_s:.3f} s at {copy_gbs:.1f} GB/s)"
    )


def dry_run_fields(stdout: str) -> str:
    """The dry-run's per-rank snapshot and pinned host GB (`pinned_host`, `host_memory` lines)."""
    pinned, host = PINNED.search(stdout), HOST.search(stdout)
    if pinned is None or host is None:
        return "dry-run printed no host/pinned lines"
    return f"dry-run host_dir_gb={host[2]} snapshots_gb={host[1]} pinned_gb={pinned[2]}"


def measured(workspace: Workspace, base: list[str], steps: int, rounds: int) -> tuple[dict, list, list]:
    """(the profile Algorithm 1 planned the last moevement run's window with, each round's step records of
    `none`, of `moevement`), the two alternating which runs first."""
    runs: dict[str, list] = {"none": [], "moevement": []}
    profile = workspace.root / "profile.json"
    for round_ in range(rounds):
        for strategy in list(runs)[:: 1 if round_ % 2 == 0 else -1]:
            args = [*base, *workspace.common(f"stage16b_{strategy}"), "--training.steps", str(steps)]
            args += ["--checkpoint.strategy", strategy]
            args += ["--metrics.profile", str(profile)] if strategy == "moevement" else []
            runs[strategy].append(recorded_steps(train(args, RUN_TIMEOUT_S), ROOT))
    return json.loads(profile.read_text()), runs["none"], runs["moevement"]


def report(profile: dict, none: list, moevement: list, tokens: int) -> list[str]:
    """The W, copy and overhead lines of the measured runs."""
    window, gbs, iteration_s = profile["window"], profile["copy_gbs"], profile["iteration_s"]
    start = common_start([*none, *moevement], PROFILE_ITERS)
    per_round = [
        [statistics.median(steady_ms(r, PROFILE_ITERS, tokens, start)) for r in rs] for rs in (none, moevement)
    ]
    steady = [rec for r in moevement for rec in steady_records(r, PROFILE_ITERS, start)]
    stalls, ckpt = [rec["stall_ms"] for rec in steady], [rec["ckpt_mb"] / 1e3 for rec in steady]
    ratios = [m / n for n, m in zip(*per_round, strict=True)]
    return [
        f"W={window} (Algorithm 1, max {MAX_WINDOW}) copy_gbs={gbs:.1f} (measured D2H into pinned snapshot memory) "
        f"iteration_s={iteration_s:.3f} (planned: the shortest profiled forward+backward)",
        f"{copy_fields(planned_snapshot_bytes(profile), gbs, iteration_s)}; measured ckpt_gb "
        f"max={max(ckpt):.2f} mean={statistics.mean(ckpt):.2f}",
        f"iter_ms none={statistics.median(per_round[0]):.1f} moevement={statistics.median(per_round[1]):.1f} "
        f"{overhead_fields(ratios)} over {len(steady) // len(moevement)} steady iterations from {start} "
        f"stall_ms median={statistics.median(stalls):.2f} max={max(stalls):.2f} (target: overhead <= 0.02)",
        f"host_mb of the run's buffers max={max(rec['host_mb'] for rec in steady):.0f}",
    ]


def main(argv: list[str] | None = None) -> int:
    """0 when the runs finished (or there is no GPU, or no host memory for one layer), 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1, help="MoE layers of the 16B shape (at most)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches of 2 x 4096 per iteration")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("stage16b: no CUDA device (torch.cuda.is_available() is False): nothing to measure here, exiting 0")
        return 0
    per_layer, free = stage_params(1), host_free_bytes()
    layers = fitting_layers(args.layers, per_layer, free)
    tokens = SEQUENCES * SEQ_LEN * args.micro_batches
    print(
        f"stage16b: {torch.cuda.get_device_name()} torch {torch.__version__} layers={layers} of the 16B shape "
        f"({per_layer / 1e9:.2f} B parameters each; host free {free / 1e9:.0f} GB, {HOST_BYTES_PER_PARAM} "
        f"bytes a parameter reserved) tokens_per_iteration={tokens} ({args.micro_batches} x 2 x 4096)",
        flush=True,
    )
    if not layers:
        print("stage16b: SKIP not even one layer's snapshot buffers fit the host memory (container: --shm-size)")
        return 0
    workspace, base = Workspace(), stage_args(layers, args.micro_batches)
    try:
        profile, none, moevement = measured(workspace, base, args.steps, args.rounds)
        for line in report(profile, none, moevement, tokens):
            print(f"stage16b: {line}", flush=True)
        at_w = ["--checkpoint.strategy", "moevement", "--checkpoint.window", str(profile["window"]), "--dry-run"]
        dry = train([*base, *workspace.common("stage16b_dry_run"), *at_w], DRY_RUN_TIMEOUT_S)
        print(f"stage16b: at W={profile['window']}: {dry_run_fields(dry)}", flush=True)
    except (RunFailed, OSError, ValueError, KeyError) as e:
        print(f"stage16b: FAIL {type(e).__name__}: {e}", flush=True)
        return 1
    finally:
        workspace.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
