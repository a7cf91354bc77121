"""ETTR of checkpoint strategies under the same Poisson failures, measured side by side over several seeds.

    python -m benchmarks.ettr --config train_configs/bench_moe.toml \
        --strategies none,moevement,gemini,checkfreq,moc --mtbf-iters 100 --steps 300 [--seeds auto] \
        [--n-seeds 3] [--pp 2] [--fault-mode kill|wipe] [--dense-snapshot-iters 3] [--none-steps N] \
        [--threads 1] [--out outputs/ettr] [--resume] [--section.key value ...]

Failures: per seed, a Poisson process of mean `--mtbf-iters` iterations over the `--steps` iterations
(one random rank each). `--seeds auto` (the default) takes the first `--n-seeds` seeds from 1 whose draw
holds round(steps / MTBF) failures, so that the realized MTBF is the nominal one; a list (`--seeds 1,3`)
is taken as given. Each seed's failures and realized MTBF are printed first, then the pooled realized
MTBF beside the nominal one, flagged where it is more than 20% off.

A fault-free `none` run (torchrun, `--pp` stages) precedes every strategy run and one follows it, so each
run is bracketed by two references taken minutes apart; its reference is their mean, which cancels most
of the machine's drift (the spread of all references is printed). The first one also sets the snapshot
bandwidth cap so that a dense snapshot of a stage takes `--dense-snapshot-iters` iterations (the paper's
regime), and MoC's first K_pec (`benchmarks.ettr_moc`: MoC-System's adaptive configuration, every
iteration). Every strategy trains `--steps` iterations under each seed's failures; a strategy may be a
variant with settings of its own (`moevement@checkpoint.background_priority=normal`). Each run's log is
written once it finishes; `--resume` continues an invocation that stopped, same arguments and same `--out`,
from a clean checkout of the same commit: the runs found there are read back, the rest launched
(`benchmarks.ettr_resume`), so the long invocations can be done over several sittings.
`--fault-mode kill` (the default): the failed rank SIGKILLs itself at a random phase of the iteration
(`--fault.kill`) and its rank shell's standby replaces it in place, every strategy alike (add
`--fault.max_replacements 0` for torchrun's restart of every process); `wipe`: the rank loses its state
in place at the iteration boundary (`--fault.mtbf_iters`).

ETTR = useful time / wall time. Start-up is charged alike: the wall time is the training loop's, from the
start of training to the last iteration or recovery, and the useful time is what the bracketing `none`
references took, wall clock from the start of training too, for the same iterations
(`benchmarks.ettr_runs`). Per run it prints

    seed=<n> strategy=<s> ettr=<x> [ettr_charged=<x> plt=<x>] overhead=<x> recovery_s=<x> failures=<n>
        lost_tokens=<n> predicted_ettr=<x> error=<x> replayed_ettr=<x> steady_ettr=<x>

(MoC: `ettr_charged` charges each lost token the run's time per routed token, `plt` its final proportion
of lost tokens, flagged above MoC-System's 3.75% budget), then per strategy the median and range over the
seeds. overhead compares the mean first-execution iteration time with T; recovery_s is the time lost to
failures (recovery plus recomputed iterations). As each run finishes it also prints where its wall time
beyond its useful time went:

    <s>: lost_s=<x> (restart= fetch= convert= catchup= resume= recompute= warmup= slower= other=)
         short_of_ettr_<target>_s=<x>

(seconds; `benchmarks.ettr_runs.lost_time` says what each part is; `--target-ettr`, 0.9 by default.)
It writes `<out>/ettr.csv` (per run its summary and the costs the simulator reads:
`simulator.measured.COLUMNS`), `<out>/profile-seed<n>.json` (the measured costs `python -m simulator
--profile` reads), the logs, and the plots `ettr_vs_mtbf.png`, `goodput.png` and `moc_k_pec.png`
(`benchmarks.ettr_report`). `python -m simulator --paper-tables --measured <out>/ettr.csv` compares the
same rows (our own Table 4).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path

from benchmarks import ettr_report
from benchmarks.ettr_moc import charged, first_k, routed_per_iteration
from benchmarks.ettr_resume import bind, logged
from benchmarks.ettr_runs import Reference, Run, at_failures, bracket, lost_time, parse_run, summarize
from benchmarks.variants import QUIET, variant_flags
from models import count_params
from moevement.failures import TRAINING_PHASES, poisson_events
from trainer.config import Config, load_config
from trainer.records.event_log import run_events

POOLED_TOLERANCE = 0.2  # a pooled realized MTBF further than this from the nominal one is flagged


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


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's own flags and the `--section.key value` overrides passed on to every run."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/bench_moe.toml")
    parser.add_argument("--strategies", default="none,moevement,gemini,checkfreq,moc")
    parser.add_argument("--mtbf-iters", type=float, default=100.0)
    parser.add_argument("--seeds", default="auto", help="seeds of the Poisson failure schedules (auto, or 1,3,...)")
    parser.add_argument("--n-seeds", type=int, default=3, help="how many seeds --seeds auto takes")
    parser.add_argument("--fault-mode", choices=("kill", "wipe"), default="kill", help="real deaths or in-place wipes")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--none-steps", type=int, default=0, help="iterations of each reference (0: --steps)")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dense-snapshot-iters", type=float, default=3.0)
    parser.add_argument("--bandwidth-gbps", type=float, default=0.0, help="snapshot copy cap (0: calibrate)")
    parser.add_argument("--out", default="outputs/ettr")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--target-ettr", type=float, default=0.9, help="report how much wall time it needs")
    parser.add_argument("--resume", action="store_true", help="read back the runs an earlier invocation left in --out")
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


def choose_seeds(args: argparse.Namespace) -> list[int]:
    """`--seeds` as given, or (auto) the first `--n-seeds` seeds from 1 whose draw over `--steps` iterations
    holds round(steps / MTBF) failures; exits on a malformed list."""
    if args.seeds != "auto":
        try:
            return [int(s) for s in args.seeds.split(",")]
        except ValueError:
            sys.exit(f"--seeds: expected auto or a comma-separated list of integers, got {args.seeds!r}")
    nominal, seeds, seed = round(args.steps / args.mtbf_iters), [], 0
    while len(seeds) < args.n_seeds:
        seed += 1
        if len(poisson_events(args.mtbf_iters, seed, args.pp, args.steps)) == nominal:
            seeds.append(seed)
    return seeds


def realized_mtbf(steps: int, failures: int) -> float:
    return steps / failures if failures else float("inf")


def print_schedule(args: argparse.Namespace, seeds: list[int]) -> None:
    """Each seed's failures and realized MTBF, then the pooled one beside the nominal MTBF."""
    total = 0
    for seed in seeds:
        events = poisson_events(args.mtbf_iters, seed, args.pp, args.steps)
        total += len(events)
        at = ",".join(f"{e.step}:{e.ranks[0]}" for e in events) or "none"
        print(
            f"seed={seed} failures={len(events)} at={at} "
            f"realized_mtbf_iters={realized_mtbf(args.steps, len(events)):.1f} nominal_mtbf_iters={args.mtbf_iters:g}",
            flush=True,
        )
    pooled = realized_mtbf(args.steps * len(seeds), total)
    off = abs(pooled / args.mtbf_iters - 1) > POOLED_TOLERANCE
    print(
        f"pooled failures={total} iterations={args.steps * len(seeds)} realized_mtbf_iters={pooled:.1f} "
        f"nominal_mtbf_iters={args.mtbf_iters:g}" + (" (MORE THAN 20% OFF THE NOMINAL MTBF)" if off else ""),
        flush=True,
    )


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


def fault_flags(args: argparse.Namespace, cap: float, seed: int) -> tuple[list[str], int]:
    """The flags every strategy's run under `seed` shares (its failures and the snapshot bandwidth cap) and
    the torchrun restarts it needs. In kill mode the Poisson schedule becomes `--fault.kill` deaths, each at
    a phase drawn from the same seed."""
    cap_flags = ["--checkpoint.bandwidth_gbps", f"{cap:.6f}"]
    if args.fault_mode == "wipe":
        return ["--fault.mtbf_iters", str(args.mtbf_iters), "--fault.seed", str(seed), *cap_flags], 0
    cap_flags += ["--checkpoint.mtbf_iters", str(args.mtbf_iters)]  # what Gemini's interval plans for
    events = poisson_events(args.mtbf_iters, seed, args.pp, args.steps)
    phases = random.Random(seed).choices(TRAINING_PHASES, k=len(events))
    kills = ",".join(f"{e.step}:{e.ranks[0]}:{phase}" for e, phase in zip(events, phases))
    print(f"seed={seed} fault-mode=kill deaths={kills or 'none'}", flush=True)
    return (["--fault.kill", kills] if kills else []) + cap_flags, len(events)


def reference_run(
    args: argparse.Namespace, extra: list[str], out: Path, tokens: int, index: int
) -> tuple[Run, Reference]:
    """The `index`-th fault-free `none` run and its figures as a reference."""
    steps = args.none_steps or args.steps
    stdout = logged(
        out / f"none-{index}.log",
        args.resume,
        partial(launch, args.config, "none", steps, args.pp, extra, args.threads),
    )
    run = parse_run(run_events(stdout))
    reference = Reference.of(run, tokens)
    print(f"reference={index} none iteration_s={reference.iteration_s:.3f} wall_s={reference.wall_s:.1f}", flush=True)
    return run, reference


def primitives(run: Run, ref: Reference, tokens: int, args: argparse.Namespace, cfg: Config, cap: float) -> dict:
    """What `simulator.measured` reads of one run beside its summary (`simulator.measured.COLUMNS`): T, the cap
    as iterations per dense snapshot, restart (with resume), fetch and replay (or recompute) seconds and
    iterations, W or k at the failures, the warm-up, and the model's expert share and MoC's first K."""
    lost = lost_time(run, ref, tokens, args.target_ettr)
    total, active = count_params(cfg.model)
    experts, top_k = cfg.model.n_routed_experts, cfg.model.top_k
    return {
        "run": f"seed {args.seed} pp={args.pp}",
        "reference_s": ref.iteration_s,
        "mtbf_iters": args.mtbf_iters,
        "pp": args.pp,
        "micro_batches": cfg.training.micro_batches,
        "dense_snapshot_iters": dense_rank_gbit(cfg, args.pp) / cap / ref.iteration_s,
        "restart_s": lost["restart"] + lost["resume"],
        "fetch_s": lost["fetch"],
        "replay_s": lost["convert"] + lost["catchup"] + lost["recompute"],
        "replayed": sum(r.replayed for r in run.recoveries),
        "warmup_s": lost["warmup"],
        "window": at_failures(run, "window"),
        "interval": at_failures(run, "interval"),
        "fault_mode": args.fault_mode,
        "expert_share": (total - active) * experts / (experts - top_k) / total if experts > top_k else 0.0,
        "experts": experts,
        "moc_experts": int(run.steps[0].get("k_pec", cfg.checkpoint.moc_experts)) if run.steps else 0,
    }


def report_run(label: str, run: Run, ref: Reference, tokens: int, target_ettr: float) -> None:
    """Print a run's recoveries, its summary against its reference, and where its lost time went."""
    for report in run.recoveries:
        print(f"  {label}: {report.line()}", flush=True)
    r = summarize(run, ref, tokens)
    print(
        f"  {label}: ettr={r['ettr']:.4f} overhead={r['overhead']:.4f} recovery_s={r['recovery_s']:.3f} "
        f"failures={r['failures']} wall_s={r['wall_s']:.1f} useful_s={r['useful_s']:.1f}",
        flush=True,
    )
    lost = lost_time(run, ref, tokens, target_ettr)
    parts = " ".join(f"{k}={v:.1f}" for k, v in lost.items() if k not in ("lost", "short"))
    print(
        f"  {label}: lost_s={lost['lost']:.1f} ({parts}) short_of_ettr_{target_ettr:g}_s={lost['short']:.1f}",
        flush=True,
    )


def print_references(references: list[Reference]) -> float:
    """Print the spread of the `none` reference runs; returns their mean iteration time."""
    times = [r.iteration_s for r in references]
    mean = statistics.fmean(times)
    print(
        f"references={len(times)} none iteration_s={mean:.3f} min={min(times):.3f} max={max(times):.3f} "
        f"spread={(max(times) - min(times)) / mean:.4f}",
        flush=True,
    )
    return mean


def strategy_flags(spec: str, moc_k: int) -> list[str]:
    """A strategy's flags before the shared ones: MoC's adaptive first K_pec (a later flag overrides it)."""
    return ["--checkpoint.moc_experts", str(moc_k)] if variant_flags(spec)[0] == "moc" else []


class Invocation:
    """The runs of one invocation: every seed's strategies, each between two references."""

    def __init__(self, args: argparse.Namespace, extra: list[str], cfg: Config, out: Path):
        self.args, self.extra, self.cfg, self.out = args, extra, cfg, out
        self.tokens = cfg.training.batch_size * cfg.training.seq_len
        first, reference = reference_run(args, extra, out, self.tokens, 0)
        self.references = [reference]
        self.cap = snapshot_cap(args, cfg, reference.iteration_s)
        self.moc_k = first_k(cfg, args.pp, self.cap, reference.iteration_s)
        if any(variant_flags(s)[0] == "moc" for s in args.strategies.split(",")):
            print(
                f"moc first_k_pec={self.moc_k} of {cfg.model.n_routed_experts} (adaptive, every iteration)", flush=True
            )
        self.rows = [ettr_report.Row(None, "none", {**summarize(first, reference, self.tokens), "ettr": 1.0})]
        self.runs: dict[tuple[int, str], Run] = {}

    def seed(self, seed: int, strategies: list[str]) -> None:
        """Every strategy under `seed`'s failures, each followed by a reference."""
        args = self.args
        faults, restarts = fault_flags(args, self.cap, seed)
        for spec in strategies:
            flags = [*strategy_flags(spec, self.moc_k), *self.extra, *faults]
            log = self.out / f"seed{seed}-{spec}.log"  # a stopped invocation loses no finished run
            stdout = logged(
                log, args.resume, partial(launch, args.config, spec, args.steps, args.pp, flags, args.threads, restarts)
            )
            run = parse_run(run_events(stdout))
            _, after = reference_run(args, self.extra, self.out, self.tokens, len(self.references))
            ref = bracket(self.references[-1], after)
            self.references.append(after)
            report_run(f"seed={seed} {spec}", run, ref, self.tokens, args.target_ettr)
            self.runs[(seed, spec)] = run
            self.rows.append(self.row(seed, spec, run, ref))

    def row(self, seed: int, spec: str, run: Run, ref: Reference) -> ettr_report.Row:
        summary = summarize(run, ref, self.tokens)
        if variant_flags(spec)[0] == "moc":
            summary |= charged(run.totals, summary["ettr"], routed_per_iteration(self.cfg))
        args = argparse.Namespace(**{**vars(self.args), "seed": seed})
        return ettr_report.Row(seed, spec, summary, primitives(run, ref, self.tokens, args, self.cfg, self.cap))


def main(argv: list[str] | None = None) -> None:
    args, extra = parse_args(argv)
    cfg = load_config(args.config, extra)
    strategies = strategies_under_failures(args.strategies)
    seeds = choose_seeds(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bind(out, [a for a in (sys.argv[1:] if argv is None else argv) if a != "--resume"], args.resume)
    print_schedule(args, seeds)

    runs = Invocation(args, extra, cfg, out)
    for seed in seeds:
        runs.seed(seed, strategies)
    iteration_s = print_references(runs.references)

    profiles = {}
    for seed in seeds:
        mine = [r for r in runs.rows if r.seed == seed]
        profiles[seed] = ettr_report.measured_profile(mine, iteration_s, args.mtbf_iters, args.steps)
        (out / f"profile-seed{seed}.json").write_text(json.dumps(profiles[seed], indent=1))
    ettr_report.simulate(runs.rows, profiles)
    ettr_report.write_csv(out / "ettr.csv", runs.rows)
    ettr_report.print_rows(runs.rows)
    ettr_report.print_summary(runs.rows)
    ettr_report.plot(out, runs.rows, runs.runs, iteration_s, args.mtbf_iters, runs.tokens)
    print(f"wrote {out / 'ettr.csv'}, {out}/profile-seed<n>.json, {out / 'ettr_vs_mtbf.png'}, {out / 'goodput.png'}")


if __name__ == "__main__":
    main()
