"""ETTR of checkpoint strategies under one failure schedule, measured side by side in one invocation.

    python -m benchmarks.ettr --config train_configs/bench_moe.toml \
        --strategies none,moevement,gemini,checkfreq,moc --mtbf-iters 100 --steps 100 [--seed 1] [--pp 2] \
        [--fault-mode kill|wipe] [--dense-snapshot-iters 3] [--none-steps N] [--threads 1] [--out outputs/ettr] \
        [--section.key value ...]

A fault-free `none` run (torchrun, `--pp` stages) precedes every strategy and one follows the last,
so each strategy is bracketed by two references taken minutes apart: its reference iteration time T
is their mean, which cancels most of the machine's drift over an invocation (the spread of all
references is printed). The references train the same `--steps` iterations as the strategies
unless `--none-steps` says otherwise: an iteration's cost changes over a run (on `bench_moe` the
mean of iterations 4-12 is about 10% below that of iterations 4-100, as routing changes), so a
shorter reference counts that change as checkpointing overhead. The first one also sets the snapshot
bandwidth cap so that a dense snapshot of a rank takes `--dense-snapshot-iters` iterations (the
paper's regime). Every other strategy trains `--steps` iterations with the
same Poisson failures (mean `--mtbf-iters` iterations apart, one random rank each, from `--seed`);
a strategy may be a variant with settings of its own (`moevement@checkpoint.background_priority=normal`).
`--fault-mode kill` (the default): the failed rank SIGKILLs itself at a random phase of the iteration
(`--fault.kill`) and its rank shell's standby replaces it in place, every strategy alike (add
`--fault.max_replacements 0` for torchrun's restart of every process), so recovery includes detection,
the survivors' rejoin and the replacement's start; `wipe`: the rank loses its state in place at the
iteration boundary (`--fault.mtbf_iters`).
Per strategy it prints

    strategy=<s> ettr=<x> overhead=<x> recovery_s=<x> failures=<n> lost_tokens=<n>

ETTR = useful time / wall time, where useful time is what the fault-free references need for the
same iterations (iterations x T) and wall time is the training loop's; overhead compares the mean
first-execution iteration time with T; recovery_s is the time lost to failures (recovery
plus recomputed iterations). `none` cannot recover, so its line is the fault-free reference.
As each strategy finishes it also prints where its wall time beyond the references' went:

    <s>: lost_s=<x> (restart= fetch= convert= catchup= resume= recompute= warmup= slower= other=)
         short_of_ettr_<target>_s=<x>

(seconds; `lost_time` says what each part is; `--target-ettr`, 0.9 by default, names the wall time a
target ETTR needs.)
It writes `<out>/ettr.csv` (per strategy its summary and the primitives the simulator reads:
`simulator.measured.COLUMNS`), `<out>/profile.json` (the measured costs `python -m simulator --profile`
reads) and the plots `ettr_vs_mtbf.png`, `goodput.png` and `moc_k_pec.png`. Beside each measurement it
prints the simulator's column: `predicted_ettr`, the one calibrated model's mechanisms on the run's
primitives (`simulator.measured.predict`: T, the cap, restart, fetch and replay seconds measured; overhead,
W, intervals and replayed iterations predicted; none for CheckFreq), and `replayed_ettr`, the same failure
law on the measured overhead and loss per failure. `python -m simulator --paper-tables --measured
<out>/ettr.csv` compares the same rows (our own Table 4).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

from baselines.intervals import ettr as steady_ettr
from benchmarks.variants import QUIET, variant_flags
from models import count_params
from moevement.failures import TRAINING_PHASES, poisson_events
from moevement.recovery.report import RecoveryReport
from simulator.calibration import MeasuredProfile
from simulator.measured import from_row, predict, replayed
from trainer.config import Config, load_config
from trainer.run.event_lines import FinalLine
from trainer.run.event_log import RunEvent, run_events

FIELDS = re.compile(r"(\w+)=(\S+)")
WARMUP = 3  # first iterations (allocation, profiling) left out of per-iteration means


def parse_run(stdout: str, events: list[RunEvent] = ()) -> dict:
    """Step records in print order (a rolled-back iteration appears again) and the accounting, from `stdout`;
    the recoveries (`RecoveryReport`) and the final line (`FinalLine`, None: none) from the run's recorded
    `events` (`run_events(stdout)`)."""
    steps, accounting = [], None
    for line in stdout.splitlines():
        if line.startswith("step="):
            steps.append({k: float(v) for k, v in FIELDS.findall(line)})
        elif line.startswith("accounting "):
            accounting = {k: float(v) for k, v in FIELDS.findall(line)}
    recoveries = [e for e in events if isinstance(e, RecoveryReport)]
    final = next((e for e in events if isinstance(e, FinalLine)), None)
    return {"steps": steps, "accounting": accounting, "recoveries": recoveries, "final": final}


def iteration_times(run: dict, tokens: int, first_only: bool = True) -> list[float]:
    """Seconds of each iteration after the warm-up (first executions only, unless asked)."""
    if first_only:
        return [seconds for step, seconds in first_executions(run, tokens) if step > WARMUP]
    return [tokens / r["tok_per_s"] for r in run["steps"] if r["step"] > WARMUP]


def first_executions(run: dict, tokens: int) -> list[tuple[int, float]]:
    """(iteration, seconds) of each iteration's first execution."""
    out, high = [], 0
    for r in run["steps"]:
        if r["step"] > high:
            out.append((int(r["step"]), tokens / r["tok_per_s"]))
            high = r["step"]
    return out


def summarize(run: dict, none_iteration_s: float, tokens: int) -> dict:
    """ETTR, overhead, recovery time and failures of one run against the fault-free iteration time."""
    acct = run["accounting"]
    mean_s = statistics.fmean(iteration_times(run, tokens))
    failures = int(acct["failures"])
    lost_s = acct["recovery_s"] + acct["recompute_s"]
    return {
        "ettr": acct["iterations"] * none_iteration_s / acct["wall_s"],
        "overhead": mean_s / none_iteration_s - 1,
        "recovery_s": lost_s,
        "failures": failures,
        "recovery_per_failure_s": lost_s / failures if failures else 0.0,
        "lost_tokens": int(acct["lost_tokens"]),
        "goodput": acct["goodput"],
        "wall_s": acct["wall_s"],
        "iterations": int(acct["iterations"]),
        "host_mb": acct["host_mb"],
        "log_mb": acct["log_mb"],
    }


REPLAY_PARTS = ("fetch", "convert", "catchup")  # the rest of a recovery line's seconds: detection and restart


def lost_time(run: dict, reference_s: float, tokens: int, target_ettr: float) -> dict:
    """Where a run's wall time beyond the references' (iterations x `reference_s`) went, in seconds.

    fetch/convert/catchup: the recovery lines' parts, restart: the rest of their seconds (detection, keeping
    live state, the processes' restart and set-up); resume: the rest of the accounting's recovery
    time (from a recovery line to training going on); recompute: rolled-back iterations run again;
    warmup: the first `WARMUP` iterations beyond the reference's time; slower: the later first executions
    beyond it (checkpointing overhead and the first iterations of restarted processes); other: wall time
    in no iteration or recovery. `short`: how much shorter the wall must be for `target_ettr`."""
    acct = run["accounting"]
    parts = dict.fromkeys(("restart", "fetch", "convert", "catchup"), 0.0)
    in_lines = 0.0
    for report in run["recoveries"]:
        seconds = report.seconds  # a recorded report holds the line's values
        replay = {k: v for k, v in report.parts().items() if k in REPLAY_PARTS}
        for key, value in replay.items():
            parts[key] += value
        parts["restart"] += seconds - sum(replay.values())
        in_lines += seconds
    useful = acct["iterations"] * reference_s
    warmup = sum(s - reference_s for step, s in first_executions(run, tokens) if step <= WARMUP)
    return {
        "lost": acct["wall_s"] - useful,
        **parts,
        "resume": acct["recovery_s"] - in_lines,
        "recompute": acct["recompute_s"],
        "warmup": warmup,
        "slower": acct["productive_s"] - useful - warmup,
        "other": acct["wall_s"] - acct["productive_s"] - acct["recompute_s"] - acct["recovery_s"],
        "short": max(0.0, acct["wall_s"] - useful / target_ettr),
    }


def launch(config: str, spec: str, steps: int, pp: int, flags: list[str], threads: int, restarts: int = 0) -> str:
    strategy, own = variant_flags(spec)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={pp}",
        f"--max-restarts={restarts}",
        "train.py",
        "--config",
        config,
        *QUIET,
        "--training.steps",
        str(steps),
        "--parallelism.pp",
        str(pp),
        "--checkpoint.strategy",
        strategy,
        *flags,
        *own,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        said = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("error: "))
        error = said or proc.stderr[proc.stderr.find("Traceback") :][:4000]
        sys.exit(f"run failed ({strategy}):\n{proc.stdout[-2000:]}\n{error}")
    return proc.stdout


def plot(out: Path, results: dict, runs: dict, none_iteration_s: float, mtbf_iters: float, batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simulator.colours import colour

    mtbfs = [10 * 1.1**i for i in range(50)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for s, r in results.items():
        if s == "none":
            continue
        # A negative measured overhead is noise against the references, not a gain: the curve uses 0
        # (the legend says so) and ETTR is never drawn above 1.
        overhead = max(0.0, r["overhead"])
        curve = [min(1.0, steady_ettr(overhead, r["recovery_per_failure_s"], m * none_iteration_s)) for m in mtbfs]
        label = s if r["overhead"] >= 0 else f"{s} (overhead {r['overhead']:+.3f} drawn as 0)"
        ax.plot(mtbfs, curve, label=label, color=colour(s))
        ax.plot([mtbf_iters], [min(1.0, r["ettr"])], "o", color=colour(s))
    ax.set(
        xscale="log",
        xlabel="MTBF (iterations)",
        ylabel="ETTR",
        ylim=(0, 1.0),
        title="ETTR vs MTBF (lines: measured costs; dots: measured runs)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ettr_vs_mtbf.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    for s, run in runs.items():
        high, xs, ys = 0, [], []
        for r in run["steps"]:
            high = max(high, int(r["step"]))
            xs.append(r["wall_s"])
            ys.append(high * batch)
        ax.plot(xs, ys, label=s, color=colour(s))
    ax.set(xlabel="wall time (s)", ylabel="samples trained (excl. recomputed)", title="Goodput over time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=120)

    if "moc" in runs:
        fig, ax = plt.subplots(figsize=(6, 3))
        steps = runs["moc"]["steps"]
        ax.step([r["wall_s"] for r in steps], [r["k_pec"] for r in steps], where="post")
        ax.set(xlabel="wall time (s)", ylabel="K_pec", title="MoC experts saved per layer")
        fig.tight_layout()
        fig.savefig(out / "moc_k_pec.png", dpi=120)
    plt.close("all")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's own flags and the `--section.key value` overrides passed on to every run."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/bench_moe.toml")
    parser.add_argument("--strategies", default="none,moevement,gemini,checkfreq,moc")
    parser.add_argument("--mtbf-iters", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=1, help="seed of the Poisson failure schedule")
    parser.add_argument("--fault-mode", choices=("kill", "wipe"), default="kill", help="real deaths or in-place wipes")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--none-steps", type=int, default=0, help="iterations of each reference (0: --steps)")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dense-snapshot-iters", type=float, default=3.0)
    parser.add_argument("--bandwidth-gbps", type=float, default=0.0, help="snapshot copy cap (0: calibrate)")
    parser.add_argument("--out", default="outputs/ettr")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--target-ettr", type=float, default=0.9, help="report how much wall time it needs")
    return parser.parse_known_args(argv)


def strategies_under_failures(spec: str) -> list[str]:
    """The strategies of `--strategies` other than `none`, in order; exits on a variant of `none`
    (the fault-free reference cannot recover from failures)."""
    strategies = [s for s in spec.split(",") if s != "none"]
    if variants_of_none := [s for s in strategies if variant_flags(s)[0] == "none"]:
        sys.exit(
            f"--strategies: {','.join(variants_of_none)}: `none` is the fault-free reference and cannot "
            f"recover from the failures the other runs get; variants of it are for benchmarks.overhead"
        )
    return strategies


def dense_rank_gbit(cfg: Config, pp: int) -> float:
    """Gbit of a dense snapshot of one stage: FP32 master + AdamW moments (12 B/param)."""
    return 12 * count_params(cfg.model)[0] / pp * 8 / 1e9


def snapshot_cap(args: argparse.Namespace, cfg: Config, none_iteration_s: float) -> float:
    """Snapshot bandwidth cap in Gbit/s (`--bandwidth-gbps`, else the one under which a dense snapshot of
    a stage takes `--dense-snapshot-iters` iterations); prints it with the reference iteration time."""
    dense = dense_rank_gbit(cfg, args.pp)
    cap = args.bandwidth_gbps or dense / (args.dense_snapshot_iters * none_iteration_s)
    print(
        f"none iteration_s={none_iteration_s:.3f} bandwidth_gbps={cap:.4f} "
        f"dense_snapshot_iters={dense / cap / none_iteration_s:.2f}",
        flush=True,
    )
    return cap


def primitives(run: dict, reference_s: float, tokens: int, args: argparse.Namespace, cfg: Config, cap: float) -> dict:
    """What `simulator.measured` reads of one strategy's run beside its summary (`simulator.measured.COLUMNS`):
    T, the cap as iterations per dense snapshot, restart (with resume), fetch and replay seconds, iterations
    replayed or recomputed, the warm-up, and the model's expert share and MoC's first K."""
    lost = lost_time(run, reference_s, tokens, args.target_ettr)
    total, active = count_params(cfg.model)
    experts, top_k = cfg.model.n_routed_experts, cfg.model.top_k
    return {
        "run": f"seed {args.seed} pp={args.pp}",
        "reference_s": reference_s,
        "mtbf_iters": args.mtbf_iters,
        "pp": args.pp,
        "micro_batches": cfg.training.micro_batches,
        "dense_snapshot_iters": dense_rank_gbit(cfg, args.pp) / cap / reference_s,
        "restart_s": lost["restart"] + lost["resume"],
        "fetch_s": lost["fetch"],
        "replay_s": lost["convert"] + lost["catchup"],
        "replayed": sum(r.replayed for r in run["recoveries"]),
        "warmup_s": lost["warmup"],
        "expert_share": (total - active) * experts / (experts - top_k) / total if experts > top_k else 0.0,
        "experts": experts,
        "moc_experts": cfg.checkpoint.moc_experts,
    }


def fault_flags(args: argparse.Namespace, cap: float) -> tuple[list[str], int]:
    """The flags every strategy's run shares (the failure schedule and the snapshot bandwidth cap) and the
    torchrun restarts it needs. In kill mode the Poisson schedule becomes `--fault.kill` deaths, each at a
    phase drawn from the same seed."""
    cap_flags = ["--checkpoint.bandwidth_gbps", f"{cap:.6f}"]
    if args.fault_mode == "wipe":
        return ["--fault.mtbf_iters", str(args.mtbf_iters), "--fault.seed", str(args.seed), *cap_flags], 0
    cap_flags += ["--checkpoint.mtbf_iters", str(args.mtbf_iters)]  # what Gemini's interval plans for
    events = poisson_events(args.mtbf_iters, args.seed, args.pp, args.steps)
    phases = random.Random(args.seed).choices(TRAINING_PHASES, k=len(events))
    kills = ",".join(f"{e.step}:{e.ranks[0]}:{phase}" for e, phase in zip(events, phases))
    print(f"fault-mode=kill deaths={kills or 'none'}", flush=True)
    return (["--fault.kill", kills] if kills else []) + cap_flags, len(events)


def reference_run(args: argparse.Namespace, extra: list[str], out: Path, tokens: int, index: int) -> tuple[dict, float]:
    """The `index`-th fault-free `none` run: its parsed run and mean iteration time."""
    stdout = launch(args.config, "none", args.none_steps or args.steps, args.pp, extra, args.threads)
    (out / f"none-{index}.log").write_text(stdout)
    run = parse_run(stdout, run_events(stdout))
    iteration_s = statistics.fmean(iteration_times(run, tokens))
    print(f"reference={index} none iteration_s={iteration_s:.3f}", flush=True)
    return run, iteration_s


def report_run(strategy: str, run: dict, bracket: tuple[float, float], tokens: int, target_ettr: float) -> None:
    """Print a strategy's recoveries, its summary against the mean of the `none` runs before and after it,
    and where its lost time went (`lost_time`)."""
    for report in run["recoveries"]:
        print(f"  {strategy}: {report.line()}", flush=True)
    r = summarize(run, statistics.fmean(bracket), tokens)
    print(
        f"  {strategy}: ettr={r['ettr']:.4f} overhead={r['overhead']:.4f} recovery_s={r['recovery_s']:.3f} "
        f"failures={r['failures']} wall_s={r['wall_s']:.1f} reference_s={bracket[0]:.3f},{bracket[1]:.3f}",
        flush=True,
    )
    lost = lost_time(run, statistics.fmean(bracket), tokens, target_ettr)
    parts = " ".join(f"{k}={v:.1f}" for k, v in lost.items() if k not in ("lost", "short"))
    print(
        f"  {strategy}: lost_s={lost['lost']:.1f} ({parts}) short_of_ettr_{target_ettr:g}_s={lost['short']:.1f}",
        flush=True,
    )


def print_references(times: list[float]) -> float:
    """Print the spread of the `none` reference runs; returns their mean iteration time."""
    mean = statistics.fmean(times)
    print(
        f"references={len(times)} none iteration_s={mean:.3f} min={min(times):.3f} max={max(times):.3f} "
        f"spread={(max(times) - min(times)) / mean:.4f}",
        flush=True,
    )
    return mean


def measured_profile(results: dict, none_iteration_s: float, mtbf_iters: float, steps: int) -> dict:
    """The measured profile `simulator.ettr --profile` reads (every strategy but the `none` reference)."""
    return {
        "iteration_s": none_iteration_s,
        "mtbf_s": mtbf_iters * none_iteration_s,
        "steps": steps,
        "strategies": {
            s: {"overhead": r["overhead"], "recovery_s": r["recovery_per_failure_s"], "failures": r["failures"]}
            for s, r in results.items()
            if s != "none"
        },
    }


SIMULATED = ("predicted_ettr", "replayed_ettr", "steady_ettr")


def write_csv(path: Path, results: dict, measured: dict, simulated: dict) -> None:
    """One row per strategy: its summary, its primitives (`primitives`; empty for `none`) and the simulator's
    columns (`SIMULATED`; empty for `none` and where the model predicts nothing)."""
    columns = ["strategy", *results["none"]]
    columns += list(dict.fromkeys(c for m in measured.values() for c in m if c not in columns))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*columns, *SIMULATED], restval="")
        writer.writeheader()
        for s, r in results.items():
            sim = {k: "" if v is None else v for k, v in simulated.get(s, {}).items()}
            writer.writerow({"strategy": s, **r, **measured.get(s, {}), **sim})


def simulate(results: dict, measured: dict, profile: dict) -> dict:
    """Per strategy under failures: the simulator's `SIMULATED` columns (`simulator.measured`; `steady_ettr`:
    1/(1+o) (1 - R/MTBF) on the measured costs at the nominal MTBF)."""
    steady = MeasuredProfile.from_json(profile)
    out = {}
    for s, extra in measured.items():
        run = from_row({"strategy": s, **results[s], **extra})
        out[s] = {"predicted_ettr": predict(run), "replayed_ettr": replayed(run), "steady_ettr": steady.steady_ettr(s)}
    return out


def print_results(results: dict, simulated: dict) -> None:
    """The `strategy=<s> ettr=<x> ...` line of every strategy, the simulator's columns beside it."""
    for s, r in results.items():
        sim = simulated.get(s, {})
        predicted = sim.get("predicted_ettr")
        note = (
            " (fault-free reference: cannot recover)"
            if s == "none"
            else (
                " predicted_ettr=- "
                if predicted is None
                else f" predicted_ettr={predicted:.4f} error={abs(predicted / r['ettr'] - 1):.4f} "
            )
            + f"replayed_ettr={sim['replayed_ettr']:.4f} steady_ettr={sim['steady_ettr']:.4f}"
        )
        print(
            f"strategy={s} ettr={r['ettr']:.4f} overhead={r['overhead']:.4f} recovery_s={r['recovery_s']:.3f} "
            f"failures={r['failures']} lost_tokens={r['lost_tokens']}{note}",
            flush=True,
        )


def report(out: Path, results: dict, measured: dict, profile: dict) -> None:
    """Write `profile.json` and `ettr.csv` to `out` and print every strategy's line."""
    (out / "profile.json").write_text(json.dumps(profile, indent=1))
    simulated = simulate(results, measured, profile)
    write_csv(out / "ettr.csv", results, measured, simulated)
    print_results(results, simulated)


def main(argv: list[str] | None = None) -> None:
    args, extra = parse_args(argv)
    cfg = load_config(args.config, extra)
    tokens, batch = cfg.training.batch_size * cfg.training.seq_len, cfg.training.batch_size
    strategies = strategies_under_failures(args.strategies)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    references = [reference_run(args, extra, out, tokens, 0)]
    cap = snapshot_cap(args, cfg, references[0][1])
    faults, restarts = fault_flags(args, cap)
    runs, bracket = {"none": references[0][0]}, {}
    for i, strategy in enumerate(strategies):
        stdout = launch(args.config, strategy, args.steps, args.pp, [*extra, *faults], args.threads, restarts)
        (out / f"{strategy}.log").write_text(stdout)  # a stopped invocation loses no finished run
        runs[strategy] = parse_run(stdout, run_events(stdout))
        references.append(reference_run(args, extra, out, tokens, i + 1))
        bracket[strategy] = (references[i][1], references[i + 1][1])
        report_run(strategy, runs[strategy], bracket[strategy], tokens, args.target_ettr)
    none_iteration_s = print_references([t for _, t in references])

    results = {"none": {**summarize(runs["none"], references[0][1], tokens), "ettr": 1.0}}  # the first reference
    results.update({s: summarize(runs[s], statistics.fmean(bracket[s]), tokens) for s in strategies})
    measured = {s: primitives(runs[s], statistics.fmean(bracket[s]), tokens, args, cfg, cap) for s in strategies}
    report(out, results, measured, measured_profile(results, none_iteration_s, args.mtbf_iters, args.steps))
    plot(out, results, runs, none_iteration_s, args.mtbf_iters, batch)
    print(
        f"wrote {out / 'ettr.csv'}, {out / 'profile.json'}, {out / 'ettr_vs_mtbf.png'}, {out / 'goodput.png'}"
        + (f", {out / 'moc_k_pec.png'}" if "moc" in runs else "")
    )


if __name__ == "__main__":
    main()
