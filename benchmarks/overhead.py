"""Checkpointing overhead of strategies on the same model, interleaved in one invocation.

    python -m benchmarks.overhead --config train_configs/bench_moe.toml --strategies none,moevement \
        --steps 20 [--rounds 2] [--pp 1] [--window W] [--dense-snapshot-iters 3.5 | --bandwidth-gbps X]
        [--threads N] [--logs DIR] [--key value ...]

Each round runs `train.py` once per strategy (real subprocesses, strategies alternating); with
`--pp N` > 1 every run is a torchrun job of N pipeline stages, so the snapshot is replicated to the
peer rank and the boundary tensors are logged, as in the ETTR benchmark. Extra
`--section.key value` arguments go to every run (e.g. `--training.mixed_precision bf16`); a
strategy written `moevement@checkpoint.background_priority=normal` is a variant with its own settings
(`@section.key=value`, repeatable), compared in the same rounds.

The snapshot bandwidth cap reproduces the paper's regime on CPU: unless --bandwidth-gbps is given,
it is set after the first `none` run so that a dense snapshot (FP32 weights + both AdamW moments)
takes --dense-snapshot-iters iterations. Per strategy it prints

    strategy=<s> iter_ms=<median> overhead=<ratio-1> snapshot_mb_per_iter=<x> stall_ms=<median> ...

over the steady-state iterations of all rounds, the same iterations for every strategy
(`compared_iterations=`): from the second iteration of the second window of the run whose first
window is longest (the first window is planned from start-up iterations, which run slower, so its
snapshots may stall; the second reserves host memory for its size). The `round=` lines, printed as
the runs finish, take each run's median from its own steady start. round_overhead is the
median over rounds of each run's median against the same round's `none` run (robust to a
machine that drifts between rounds); snapshot_mb_per_iter averages whole windows only, and
dense_fraction divides it by the dense size (of one stage: 1/pp of the model).

Every run also reports the CPU seconds of its checkpointing activities (`--metrics.cpu_cost`), and
per strategy a line

    cpu strategy=<s> process_ms=<x> extra_ms=<x> training_thread_ms=<x> copy_ms=<x> checksum_ms=<x> ...

gives them per iteration and rank, averaged over ranks and rounds and over every iteration of the
training loop (start-up and window boundaries included); extra_ms is the process's CPU time per
iteration beyond the same round's `none` run. Beside the totals, each activity's cost per call
(`checkpointer_per_call_ms`: a `begin` or `end` of the checkpointer; `window_per_call_ms`: a window's
start, with its planning, layouts and new host memory; `replication_per_call_ms`: a round or a
window's closing all-reduce) and its calls per run and rank.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from benchmarks.variants import QUIET, variant_flags
from models import count_params
from trainer.config import load_config
from trainer.records.event_lines import StepLine
from trainer.records.event_log import run_events

CPU_RE = re.compile(r"^cpu_cost (.*)$", re.MULTILINE)


def recorded_steps(stdout: str, cwd: Path | None = None) -> dict[int, dict[str, float]]:
    """{iteration: the fields of its `step` record} of the run whose stdout is `stdout` (its `run: <dir>`
    lines name the run folder; relative ones against `cwd`, by default this process's working directory)."""
    return {e.step: dict(e.fields) for e in run_events(stdout, cwd) if isinstance(e, StepLine)}


def parse_cpu(stdout: str) -> list[dict[str, float]]:
    """Every rank's `cpu_cost` line, as numbers."""
    return [{k: float(v) for k, v in (kv.split("=") for kv in m[1].split())} for m in CPU_RE.finditer(stdout)]


def run(
    config: str, spec: str, steps: int, extra: list[str], threads: int, pp: int = 1, log: Path | None = None
) -> tuple[dict[int, dict[str, float]], list[dict[str, float]]]:
    """One run's step records and every rank's CPU costs (its output also written to `log`, if given);
    `pp` > 1: a torchrun job of `pp` pipeline stages."""
    strategy, own = variant_flags(spec)
    launcher = [] if pp == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={pp}"]
    cmd = [
        sys.executable,
        *launcher,
        "train.py",
        "--config",
        config,
        *QUIET,
        "--training.steps",
        str(steps),
        "--checkpoint.strategy",
        strategy,
        "--parallelism.pp",
        str(pp),
        "--metrics.cpu_cost",
        "true",
        *extra,
        *own,
    ]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"run failed ({strategy}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return recorded_steps(proc.stdout), parse_cpu(proc.stdout)


def window_starts(records: dict[int, dict[str, float]], profile_iters: int) -> list[tuple[int, int]]:
    """(first iteration, W) of each complete window of one run: windows follow the profile and one another
    (W may change from one window to the next), but for iterations in none (`window` 0: a window waiting
    for its buffers to be grown, a block without snapshots)."""
    out, start, last = [], profile_iters + 1, max(records)
    while start in records:
        window = int(records[start]["window"])
        if window == 0:
            start += 1
            continue
        if start + window - 1 > last:
            break
        out.append((start, window))
        start += window
    return out


def whole_windows(records: dict[int, dict[str, float]], profile_iters: int) -> list[dict[str, float]]:
    """The records of the complete windows of one run."""
    return [records[t] for start, window in window_starts(records, profile_iters) for t in range(start, start + window)]


def steady_start(records: dict[int, dict[str, float]], profile_iters: int) -> int:
    """First steady-state iteration: the second of the second window. The first window is planned
    from start-up iterations, which run slower (its snapshots may stall), and the second one is the
    first planned from steady iterations. Without windows: the second iteration after the profile."""
    for t in range(profile_iters + 1, max(records, default=0) + 1):
        if int(records.get(t, {}).get("window", 0)) > 0:  # the first window (it may wait for its buffers)
            return t + int(records[t]["window"]) + 1
    return profile_iters + 2


def steady_records(
    records: dict[int, dict[str, float]], profile_iters: int, start: int | None = None
) -> list[dict[str, float]]:
    """The records of one run's steady-state iterations: from `start`, else from :func:`steady_start` on."""
    start = steady_start(records, profile_iters) if start is None else start
    return [r for t, r in records.items() if t >= start]


def steady_ms(
    records: dict[int, dict[str, float]], profile_iters: int, tokens: int, start: int | None = None
) -> list[float]:
    """Milliseconds of each steady-state iteration (`tokens` per iteration; from `start`, if given)."""
    return [tokens / r["tok_per_s"] * 1e3 for r in steady_records(records, profile_iters, start)]


def ab_ratios(records: dict[int, dict[str, float]], block: int, start: int, tokens: int) -> list[float]:
    """One run of `checkpoint.ab_blocks block`: for each block that takes snapshots (`(t // block)` even) from
    iteration `start` on, the median time of its iterations over the median of the block after it, which takes
    none: adjacent blocks of one process see the same machine. ValueError if the records disagree (a snapshot
    in a block without, or an iteration of a block with snapshots that took none)."""
    ms = {t: tokens / r["tok_per_s"] * 1e3 for t, r in records.items() if t >= start}
    for t in ms:
        if (records[t]["ckpt_mb"] > 0) == bool((t // block) % 2):
            raise ValueError(f"iteration {t}: ckpt_mb={records[t]['ckpt_mb']} does not match blocks of {block}")
    ratios = []
    for first in range(-(-start // (2 * block)) * 2 * block, max(ms, default=0) + 1, 2 * block):
        on = [ms[t] for t in range(first, first + block) if t in ms]
        off = [ms[t] for t in range(first + block, first + 2 * block) if t in ms]
        if len(on) == len(off) == block:
            ratios.append(statistics.median(on) / statistics.median(off))
    return ratios


def ab_medians(records: dict[int, dict[str, float]], start: int, tokens: int) -> tuple[float, float]:
    """One run of `checkpoint.ab_blocks`: the median milliseconds of its iterations from `start` that took a
    snapshot, and of those that took none."""
    ms = {t: tokens / r["tok_per_s"] * 1e3 for t, r in records.items() if t >= start}
    on = [v for t, v in ms.items() if records[t]["ckpt_mb"] > 0]
    off = [v for t, v in ms.items() if records[t]["ckpt_mb"] <= 0]
    return statistics.median(on), statistics.median(off)


def common_start(runs: Iterable[dict[int, dict[str, float]]], profile_iters: int) -> int:
    """The first iteration that is steady in every run: strategies are compared over the same iterations.
    An iteration's time depends on its step (its batch, its experts' load: later ones ran up to 10%
    slower here), so a run without windows, steady from the second iteration after the profile, would
    otherwise be measured over earlier, faster iterations than a windowed one."""
    return max(steady_start(records, profile_iters) for records in runs)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's own flags and the `--section.key value` overrides passed on to every run."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/bench_moe.toml")
    parser.add_argument("--strategies", default="none,moevement")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (torchrun processes) of every run")
    parser.add_argument("--window", type=int, default=0, help="force W (0: Algorithm 1)")
    parser.add_argument("--bandwidth-gbps", type=float, default=0.0, help="snapshot copy cap (0: calibrate)")
    parser.add_argument("--dense-snapshot-iters", type=float, default=3.5)
    parser.add_argument("--logs", type=Path, default=None, help="keep each run's output in this folder")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="compute threads of every run (0: torch's default); cores - 1 leaves the copy thread a core",
    )
    return parser.parse_known_args(argv)


def run_flags(strategy: str, extra: list[str], cap: float, window: int) -> list[str]:
    """`extra` plus, for a checkpointing strategy, the bandwidth cap and the forced window (if any);
    exits when a checkpointing strategy would run before any cap is known."""
    flags = list(extra)
    if variant_flags(strategy)[0] != "none":
        if cap <= 0:
            sys.exit("--bandwidth-gbps is required when `none` is not among the strategies")
        flags += ["--checkpoint.bandwidth_gbps", f"{cap:.6f}"]
        if window:
            flags += ["--checkpoint.window", str(window)]
    return flags


def calibrate(iter_s: float, dense_bytes: int, dense_snapshot_iters: float) -> float:
    """The bandwidth cap (Gbit/s) under which a dense snapshot takes `dense_snapshot_iters` iterations
    of `iter_s` seconds; prints it."""
    cap = dense_bytes * 8 / 1e9 / (dense_snapshot_iters * iter_s)
    print(
        f"calibrated bandwidth_gbps={cap:.4f} (dense snapshot {dense_bytes / 1e6:.0f} MB "
        f"in {dense_snapshot_iters} iterations of {iter_s * 1e3:.0f} ms)",
        flush=True,
    )
    return cap


def run_rounds(
    args: argparse.Namespace, extra: list[str], strategies: list[str], dense_bytes: int, tokens: int, profile_iters: int
) -> tuple[dict[str, list[dict[int, dict[str, float]]]], dict[str, list[list[dict[str, float]]]], float]:
    """Every strategy's step records and CPU costs, one run per round (`none` first in each round), and the
    bandwidth cap: `--bandwidth-gbps`, else calibrated on the first `none` run. Exits on a run without a
    steady-state iteration."""
    cap = args.bandwidth_gbps
    runs: dict[str, list[dict[int, dict[str, float]]]] = {s: [] for s in strategies}
    cpu: dict[str, list[list[dict[str, float]]]] = {s: [] for s in strategies}
    order = sorted(strategies, key=lambda s: s != "none")  # calibrate on `none` before anything is capped
    for round_index in range(args.rounds):
        for strategy in order:
            flags = run_flags(strategy, extra, cap, args.window)
            log = args.logs / f"round{round_index}-{strategy}.log" if args.logs else None
            records, costs = run(args.config, strategy, args.steps, flags, args.threads, args.pp, log)
            if not steady_ms(records, profile_iters, tokens):
                sys.exit(
                    f"{strategy}: no steady-state iteration in {args.steps} steps (the first one would be "
                    f"{steady_start(records, profile_iters)}): raise --steps"
                )
            runs[strategy].append(records)
            cpu[strategy].append(costs)
            if strategy == "none" and cap <= 0:
                iter_s = statistics.median(steady_ms(records, profile_iters, tokens)) / 1e3
                cap = calibrate(iter_s, dense_bytes, args.dense_snapshot_iters)
            print(
                f"round={round_index} strategy={strategy} iterations={len(records)} "
                f"iter_ms={statistics.median(steady_ms(records, profile_iters, tokens)):.1f}",
                flush=True,
            )
    return runs, cpu, cap


def snapshot_fields(
    strategy: str, rs: list[dict[int, dict[str, float]]], steps: int, dense_bytes: int, profile_iters: int, start: int
) -> str:
    """The snapshot part of a checkpointing strategy's line: sizes over whole windows (over every
    snapshot iteration, with a printed note, when no window is complete), stalls over the compared
    iterations (from `start`)."""
    whole = [r for records in rs for r in whole_windows(records, profile_iters)]
    if not whole:
        print(
            f"note: no complete window of {strategy} in {steps} steps: snapshot sizes averaged "
            f"over every snapshot iteration",
            flush=True,
        )
        whole = [r for records in rs for t, r in records.items() if t > profile_iters]
    mb = statistics.mean(r["ckpt_mb"] for r in whole)
    stalls = [r["stall_ms"] for records in rs for r in steady_records(records, profile_iters, start)]
    windows = sorted({int(r["window"]) for r in whole})
    return (
        f" snapshot_mb_per_iter={mb:.1f} stall_ms={statistics.median(stalls):.1f}"
        f" mean_stall_ms={statistics.mean(stalls):.1f} window={','.join(map(str, windows))}"
        f" dense_fraction={mb / (dense_bytes / 1e6):.3f}"
    )


def report(
    runs: dict[str, list[dict[int, dict[str, float]]]],
    cap: float,
    steps: int,
    dense_bytes: int,
    tokens: int,
    profile_iters: int,
) -> None:
    """Print the dense snapshot's size and duration, then every strategy's `strategy=<s> ...` line, every
    strategy measured over the same iterations (:func:`common_start` to the last)."""
    start = common_start((records for rs in runs.values() for records in rs), profile_iters)
    run_ms = {s: [steady_ms(records, profile_iters, tokens, start) for records in rs] for s, rs in runs.items()}
    iter_ms = {s: statistics.median(ms for run in per_run for ms in run) for s, per_run in run_ms.items()}
    round_ms = {s: [statistics.median(run) for run in per_run] for s, per_run in run_ms.items()}
    base = iter_ms.get("none", min(iter_ms.values()))
    dense_s = dense_bytes / (cap * 1e9 / 8)
    print(
        f"dense_snapshot_mb={dense_bytes / 1e6:.1f} bandwidth_gbps={cap:.4f} "
        f"dense_snapshot_iters={dense_s / (base / 1e3):.2f} compared_iterations={start}-{steps}"
    )
    for strategy, rs in runs.items():
        line = f"strategy={strategy} iter_ms={iter_ms[strategy]:.1f} overhead={iter_ms[strategy] / base - 1:.4f}"
        if "none" in runs and strategy != "none":  # each run against the same round's `none` run
            paired = statistics.median(a / b for a, b in zip(round_ms[strategy], round_ms["none"]))
            line += f" round_overhead={paired - 1:.4f}"
        if variant_flags(strategy)[0] != "none":
            line += snapshot_fields(strategy, rs, steps, dense_bytes, profile_iters, start)
        print(line, flush=True)


def cpu_report(cpu: dict[str, list[list[dict[str, float]]]]) -> None:
    """Print every strategy's `cpu strategy=<s> ...` line: CPU milliseconds per iteration and rank."""

    def per_iteration(costs: list[dict[str, float]], key: str) -> float:
        return statistics.fmean(c[key] / c["iterations"] * 1e3 for c in costs)

    keys = [k.removesuffix("_s") for k in cpu[next(iter(cpu))][0][0] if k.endswith("_s")]
    for strategy, rounds in cpu.items():
        fields = {k: statistics.fmean(per_iteration(costs, f"{k}_s") for costs in rounds) for k in keys}
        line = f"cpu strategy={strategy} process_ms={fields.pop('process'):.1f}"
        if "none" in cpu and strategy != "none":
            extra = [per_iteration(a, "process_s") - per_iteration(b, "process_s") for a, b in zip(rounds, cpu["none"])]
            line += f" extra_ms={statistics.fmean(extra):.1f}"
        line += "".join(f" {k}_ms={v:.1f}" for k, v in fields.items())
        print(line + per_call(rounds), flush=True)


def per_call(rounds: list[list[dict[str, float]]]) -> str:
    """` <activity>_per_call_ms=<x> <activity>_calls=<n>` for every activity with measured calls: its CPU
    milliseconds per call pooled over ranks and rounds, and its calls per run and rank."""
    costs = [c for run in rounds for c in run]
    out = ""
    for key in (k.removesuffix("_calls") for k in costs[0] if k.endswith("_calls")):
        calls = sum(c[f"{key}_calls"] for c in costs)
        if calls:
            ms = sum(c[f"{key}_s"] for c in costs) / calls * 1e3
            out += f" {key}_per_call_ms={ms:.2f} {key}_calls={calls / len(costs):.1f}"
    return out


def main(argv: list[str] | None = None) -> None:
    args, extra = parse_args(argv)
    strategies = args.strategies.split(",")
    cfg = load_config(args.config, extra)
    dense_bytes = 12 * count_params(cfg.model)[0] // args.pp  # FP32 master + exp_avg + exp_avg_sq, one stage
    tokens = cfg.training.batch_size * cfg.training.seq_len
    profile_iters = cfg.checkpoint.profile_iters
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    runs, cpu, cap = run_rounds(args, extra, strategies, dense_bytes, tokens, profile_iters)
    report(runs, cap, args.steps, dense_bytes, tokens, profile_iters)
    cpu_report(cpu)


if __name__ == "__main__":
    main()
