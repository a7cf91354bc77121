"""What `benchmarks.ettr` prints and writes of its runs: one line per run, the median and range per strategy
over the seeds, `ettr.csv`, one `profile-seed<n>.json` per seed and the plots.

Beside every measured ETTR it puts the simulator's columns (`SIMULATED`): `predicted_ettr`
(`simulator.measured.predict`: the trainer's mechanism of a failure on the run's own costs), `replayed_ettr`
(the same failure law on the measured overhead and loss per failure) and `steady_ettr` (1/(1+o) (1 - R/MTBF)
on the measured costs at the nominal MTBF). MoC's rows also carry `ettr_charged` and its final `plt`
(`benchmarks.ettr_moc`), flagged where PLT ends above MoC-System's 3.75% budget.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from baselines.intervals import ettr as steady_ettr
from benchmarks.ettr_moc import PLT_BUDGET
from simulator.calibration import MeasuredProfile
from simulator.measured import from_row, predict, replayed

SIMULATED = ("predicted_ettr", "replayed_ettr", "steady_ettr")


@dataclass
class Row:
    """One run's figures: `summary` (`benchmarks.ettr_runs.summarize`, MoC's `ettr_charged` and `plt`),
    `measured` (the costs `simulator.measured` reads; empty for the `none` reference), `simulated`."""

    seed: int | None  # None: the fault-free reference
    strategy: str
    summary: dict
    measured: dict = field(default_factory=dict)
    simulated: dict = field(default_factory=dict)


def measured_profile(rows: list[Row], iteration_s: float, mtbf_iters: float, steps: int) -> dict:
    """The measured profile of one seed's rows that `python -m simulator --profile` reads."""
    return {
        "iteration_s": iteration_s,
        "mtbf_s": mtbf_iters * iteration_s,
        "steps": steps,
        "strategies": {
            r.strategy: {
                "overhead": r.summary["overhead"],
                "recovery_s": r.summary["recovery_per_failure_s"],
                "failures": r.summary["failures"],
            }
            for r in rows
        },
    }


def simulate(rows: list[Row], profiles: dict[int, dict]) -> None:
    """Fill each strategy row's `simulated` columns (`profiles`: each seed's `measured_profile`)."""
    for r in rows:
        if r.seed is None:
            continue
        run = from_row({"strategy": r.strategy, **r.summary, **r.measured})
        steady = MeasuredProfile.from_json(profiles[r.seed]).steady_ettr(r.strategy)
        r.simulated = {"predicted_ettr": predict(run), "replayed_ettr": replayed(run), "steady_ettr": steady}


def write_csv(path: Path, rows: list[Row]) -> None:
    """One row per run: seed, strategy, summary, measured costs and the simulator's columns (empty where none)."""
    columns = ["strategy", "seed"]
    for r in rows:
        columns += [c for c in (*r.summary, *r.measured) if c not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*columns, *SIMULATED], restval="")
        writer.writeheader()
        for r in rows:
            sim = {k: "" if v is None else v for k, v in r.simulated.items()}
            seed = "" if r.seed is None else r.seed
            writer.writerow({"strategy": r.strategy, "seed": seed, **r.summary, **r.measured, **sim})


def _moc(summary: dict) -> str:
    if "plt" not in summary:
        return ""
    above = " (above the 3.75% budget)" if summary["plt"] > PLT_BUDGET else ""
    return f" ettr_charged={summary['ettr_charged']:.4f} plt={summary['plt']:.4f}{above}"


def print_rows(rows: list[Row]) -> None:
    """Every run's line: measured ETTR (MoC's charged ETTR and PLT beside it), the simulator's beside it."""
    for r in rows:
        s, sim = r.summary, r.simulated
        if r.seed is None:
            note = " (fault-free reference: cannot recover)"
        else:
            p = sim.get("predicted_ettr")
            note = " predicted_ettr=-" if p is None else f" predicted_ettr={p:.4f} error={p - s['ettr']:+.4f}"
            note += f" replayed_ettr={sim['replayed_ettr']:.4f} steady_ettr={sim['steady_ettr']:.4f}"
        seed = "" if r.seed is None else f"seed={r.seed} "
        print(
            f"{seed}strategy={r.strategy} ettr={s['ettr']:.4f}{_moc(s)} overhead={s['overhead']:.4f} "
            f"recovery_s={s['recovery_s']:.3f} failures={s['failures']} lost_tokens={s['lost_tokens']}{note}",
            flush=True,
        )


def _spread(values: list[float]) -> str:
    return f"median={statistics.median(values):.4f} range={min(values):.4f}-{max(values):.4f}"


def print_summary(rows: list[Row]) -> None:
    """Per strategy over its seeds: the median and range of the measured ETTR and of `predicted_ettr` (MoC:
    of `ettr_charged` and its final PLT too, and how many seeds end above the budget)."""
    for strategy in dict.fromkeys(r.strategy for r in rows if r.seed is not None):
        mine = [r for r in rows if r.strategy == strategy and r.seed is not None]
        line = f"strategy={strategy} seeds={len(mine)} ettr {_spread([r.summary['ettr'] for r in mine])}"
        predicted = [r.simulated["predicted_ettr"] for r in mine if r.simulated.get("predicted_ettr") is not None]
        line += f" predicted_ettr {_spread(predicted)}" if predicted else " predicted_ettr=-"
        if all("plt" in r.summary for r in mine):
            plts = [r.summary["plt"] for r in mine]
            above = sum(p > PLT_BUDGET for p in plts)
            line += f" ettr_charged {_spread([r.summary['ettr_charged'] for r in mine])} plt {_spread(plts)}"
            line += f" ({above} of {len(mine)} above the 3.75% budget)"
        print(line, flush=True)


def plot(out: Path, rows: list[Row], runs: dict, iteration_s: float, mtbf_iters: float, tokens: int) -> None:
    """ettr_vs_mtbf.png (per strategy the steady curve on its median measured costs, each run a dot),
    goodput.png and moc_k_pec.png of the first seed's runs (`runs`: (seed, strategy) -> `Run`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simulator.colours import colour

    mtbfs = [10 * 1.1**i for i in range(50)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy in dict.fromkeys(r.strategy for r in rows if r.seed is not None):
        mine = [r.summary for r in rows if r.strategy == strategy and r.seed is not None]
        # A negative measured overhead is noise against the references, not a gain: the curve uses 0.
        overhead = max(0.0, statistics.median(s["overhead"] for s in mine))
        recovery = statistics.median(s["recovery_per_failure_s"] for s in mine)
        curve = [min(1.0, steady_ettr(overhead, recovery, m * iteration_s)) for m in mtbfs]
        ax.plot(mtbfs, curve, label=strategy, color=colour(strategy))
        ax.plot([mtbf_iters] * len(mine), [min(1.0, s["ettr"]) for s in mine], "o", color=colour(strategy))
    ax.set(xscale="log", xlabel="MTBF (iterations)", ylabel="ETTR", ylim=(0, 1.0))
    ax.set_title("ETTR vs MTBF (lines: median measured costs; dots: measured runs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ettr_vs_mtbf.png", dpi=120)
    _plot_first_seed(out, runs, tokens, plt)
    plt.close("all")


def _plot_first_seed(out: Path, runs: dict, tokens: int, plt) -> None:
    from simulator.colours import colour

    seed = min(s for s, _ in runs)
    fig, ax = plt.subplots(figsize=(6, 4))
    for (s, strategy), run in runs.items():
        if s != seed:
            continue
        high, xs, ys = 0, [], []
        for r in run.steps:
            high = max(high, int(r["step"]))
            xs.append(r["wall_s"])
            ys.append(high * tokens)
        ax.plot(xs, ys, label=strategy, color=colour(strategy))
    ax.set(xlabel="wall time (s)", ylabel="tokens trained (excl. recomputed)", title=f"Goodput over time, seed {seed}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=120)
    if (seed, "moc") in runs:
        fig, ax = plt.subplots(figsize=(6, 3))
        steps = runs[(seed, "moc")].steps
        ax.step([r["wall_s"] for r in steps], [r["k_pec"] for r in steps], where="post")
        ax.set(xlabel="wall time (s)", ylabel="K_pec", title=f"MoC experts saved per layer, seed {seed}")
        fig.tight_layout()
        fig.savefig(out / "moc_k_pec.png", dpi=120)
