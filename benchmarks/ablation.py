"""The paper's Figure 13, measured: MoEvement's techniques added one at a time under the same real deaths.

    python -m benchmarks.ablation --config train_configs/bench_moe.toml --pp 4 --training.micro_batches 4 \
        --training.mixed_precision bf16 --checkpoint.slots bytes --steps 40 --mtbf-iters 20 [--seed 1] \
        [--dense-snapshot-iters 3] [--threads 1] [--out outputs/ablation] [--section.key value ...]

Four `moevement` variants train the same iterations under the same Poisson deaths (real SIGKILLs at a
random phase, each replaced in place by its rank shell), each bracketed by fault-free `none` references
exactly as in `benchmarks.ettr` (same snapshot bandwidth cap, same accounting, start-up charged alike):

  1. sparse checkpointing alone: every stage rolls back (`fault.scope global`), frozen operators still
     compute their weight gradient (`fault.frozen_weight_grad true`), operators in the model's order
     (`checkpoint.ordering fixed`)
  2. + frozen operators skip their weight gradient
  3. + popularity order (`checkpoint.ordering count`)
  4. + upstream logging and localized recovery: MoEvement as it ships

Per step it prints

    step=<n> name="<step>" ettr=<x> gain=<x> recovery_s=<x> per_failure_s=<x> convert_s=<x> catchup_s=<x>
        failures=<n> digest=equal|DIFFERS

(`gain`: relative ETTR gain over the step before; `recovery_s`: wall time lost to failures, recovery plus
recomputed iterations; `per_failure_s`: the mean of the `recovery step=` lines' seconds; `convert_s`,
`catchup_s`: their means of those parts, where frozen operators and the order matter only in the
conversion; `digest`: whether the final `state_digest` is the fault-free reference's, as
every step is exact), then the simulator's four steps for the paper's DeepSeek-MoE setting
(`simulator.ablation`, the calibration of `python -m simulator --paper-tables`), and writes
`<out>/ablation.csv` and `<out>/ablation.png`.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

from benchmarks import ettr
from benchmarks.ettr_runs import Run, bracket, parse_run, summarize
from simulator.ablation import ablation
from simulator.calibrated import FITTED
from simulator.paper_tables import FIG13_MTBF_S, FIG13_SKEW, testbed_settings
from trainer.config import load_config
from trainer.records.event_log import run_events

STEPS = (
    (
        "sparse checkpointing, global rollback",
        "moevement@fault.scope=global@fault.frozen_weight_grad=true@checkpoint.ordering=fixed",
    ),
    ("+ skip B_weight when frozen", "moevement@fault.scope=global@checkpoint.ordering=fixed"),
    ("+ popularity order", "moevement@fault.scope=global"),
    ("+ upstream logging, localized recovery", "moevement"),
)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/bench_moe.toml")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mtbf-iters", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1, help="seed of the Poisson failure schedule")
    parser.add_argument("--dense-snapshot-iters", type=float, default=3.0)
    parser.add_argument("--bandwidth-gbps", type=float, default=0.0, help="snapshot copy cap (0: calibrate)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--out", default="outputs/ablation")
    parser.set_defaults(fault_mode="kill", none_steps=0, target_ettr=0.9)  # what benchmarks.ettr's runs read
    return parser.parse_known_args(argv)


def recovery_seconds(run: Run) -> tuple[float, float, float]:
    """Means of the seconds, convert and catch-up seconds of a run's `recovery step=` lines (zeros: none)."""
    reports = run.recoveries
    figures = [[r.seconds for r in reports], [r.convert for r in reports], [r.catchup for r in reports]]
    return tuple(statistics.fmean(values) if values else 0.0 for values in figures)


def measure(args: argparse.Namespace, extra: list[str], out: Path) -> list[dict]:
    """Every step's run between two fault-free references; a row per step, printed as it finishes."""
    cfg = load_config(args.config, extra)
    tokens = cfg.training.batch_size * cfg.training.seq_len
    first, reference = ettr.reference_run(args, extra, out, tokens, 0)
    references = [reference]
    cap = ettr.snapshot_cap(args, cfg, reference.iteration_s)
    faults, restarts = ettr.fault_flags(args, cap, args.seed)
    fault_free = first.final.state_digest
    rows: list[dict] = []
    for i, (_, spec) in enumerate(STEPS):
        stdout = ettr.launch(args.config, spec, args.steps, args.pp, [*extra, *faults], args.threads, restarts)
        (out / f"step{i + 1}.log").write_text(stdout)
        run = parse_run(run_events(stdout))
        references.append(ettr.reference_run(args, extra, out, tokens, i + 1)[1])
        ref = bracket(references[i], references[i + 1])
        summary = summarize(run, ref, tokens)
        measured = ettr.primitives(run, ref, tokens, args, cfg, cap)
        digest = "equal" if run.final.state_digest == fault_free else "DIFFERS"
        rows.append(step_row(i + 1, spec, summary, measured, recovery_seconds(run), digest, rows))
        print(_line(rows[-1]), flush=True)
    ettr.print_references(references)
    return rows


def step_row(
    step: int, spec: str, summary: dict, measured: dict, recovery: tuple[float, float, float], digest: str, rows: list
) -> dict:
    """Step `step`'s row of ablation.csv: its name and gain over the step before (`rows`), the recovery
    lines' means, and the columns of `benchmarks.ettr`'s ettr.csv (`simulator.measured.COLUMNS`: its
    summary and primitives, the variant as its strategy), which `python -m simulator --paper-tables
    --measured ablation.csv` reads as our own Figure 13."""
    per_failure, convert, catchup = recovery
    before = rows[-1]["ettr"] if rows else None
    return {
        "step": step,
        "name": STEPS[step - 1][0],
        "strategy": spec,
        **summary,
        **measured,
        "run": f"step {step}",
        "gain": summary["ettr"] / before - 1 if before else 0.0,
        "per_failure_s": per_failure,
        "convert_s": convert,
        "catchup_s": catchup,
        "digest": digest,
    }


def _line(row: dict) -> str:
    return (
        f'step={row["step"]} name="{row["name"]}" ettr={row["ettr"]:.4f} gain={row["gain"]:+.4f} '
        f"recovery_s={row['recovery_s']:.2f} per_failure_s={row['per_failure_s']:.2f} "
        f"convert_s={row['convert_s']:.2f} catchup_s={row['catchup_s']:.2f} failures={row['failures']} "
        f"digest={row['digest']}"
    )


def simulated() -> list[str]:
    """The simulator's four steps for the paper's DeepSeek-MoE setting (Figure 13's own)."""
    rows = ablation(testbed_settings()["DeepSeek-MoE"], FITTED, FIG13_MTBF_S, FIG13_SKEW)
    lines, before = [], None
    for i, row in enumerate(rows):
        gain = row.ettr / before - 1 if before else 0.0
        lines.append(
            f'simulated step={i + 1} name="{row.step}" ettr={row.ettr:.4f} gain={gain:+.4f} '
            f"per_failure_s={row.recovery_s:.1f} window={row.window}"
        )
        before = row.ettr
    return lines


def plot(path: Path, rows: list[dict]) -> None:
    """ETTR and seconds lost per failure of each step, as Figure 13 draws them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [f"{r['step']}. {r['name']}" for r in rows]
    y = range(len(rows))
    left.barh(y, [r["ettr"] for r in rows], color="#4c72b0")
    left.set(yticks=list(y), yticklabels=labels, xlabel="ETTR", xlim=(0, 1))
    left.invert_yaxis()
    right.barh(y, [r["per_failure_s"] for r in rows], color="#dd8452")
    right.set(yticks=list(y), yticklabels=[], xlabel="seconds per failure (recovery line)")
    right.invert_yaxis()
    fig.suptitle("MoEvement's techniques added one at a time (real deaths)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_rows(path: Path, rows: list[dict]) -> None:
    """ablation.csv: one row per step (`step_row`)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    args, extra = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = measure(args, extra, out)
    for line in simulated():
        print(line)
    write_rows(out / "ablation.csv", rows)
    plot(out / "ablation.png", rows)
    print(f"wrote {out / 'ablation.csv'}, {out / 'ablation.png'}")


if __name__ == "__main__":
    main()
