"""`python -m simulator --paper-tables`: every compared cell of Table 3, Table 4, Figures 1a, 11, 13 and 16.

Each line: simulated, paper, difference, and whether the cell was used to fit or derives from the cells
that were (`fitted`: Table 3's 2H and 1H ETTR rows, the zero-failure intercepts through them, Figure
13's last step, which is the 1H row), is an input (`input`: the overhead cells that give T and MoC's
first-K cost), is compared only (`held out`), or is printed without a score (`shown`: cells the paper
contradicts, see docs/simulator.md; Table 3's one overhead percentage per model stands beside the 2H
row). Table 3 uses the 12-hour run with Poisson failures (`simulator.run`); the closed form is printed
beside it, and MoEvement's W beside every MoEvement row. Our own Table 4 and Figure 13 put the same
mechanisms on runs measured here (`simulator.measured`), read from the ETTR benchmark's CSVs (`--measured`;
by default the committed records in simulator/measurements/), beside their measured ETTR.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from moevement.checkpoint.schedule import find_window_size
from simulator import paper_numbers as pn
from simulator.ablation import ablation
from simulator.calibrated import Calibration
from simulator.measured import (
    RECORDED_ABLATION_CSV,
    RECORDED_CSV,
    MeasuredRun,
    ablation_of,
    predict,
    predicted_cost,
    read_csv,
    unrecorded,
)
from simulator.mechanisms import gemini_cost
from simulator.model import run_all
from simulator.paper import scale_study
from simulator.profile import snapshot_bandwidth
from simulator.run import RunResult
from simulator.setting import Setting, from_testbed
from simulator.skew_study import skew_study
from simulator.testbed import OVERHEAD_CELLS, TESTBEDS

FIG13_MTBF_S = 3600.0  # Fig. 13's final ETTR (~0.97) is Table 3's 1H row (its MTBF is not given)
FIG13_SKEW = 0.25  # the trained model's skew is not given: Appendix D's mildest level


@dataclass(frozen=True)
class Cell:
    section: str
    label: str
    simulated: float
    paper: float | None
    status: str  # fitted | held out | input | shown
    closed: float | None = None  # Table 3 ETTR: the closed form beside the finite run

    @property
    def diff(self) -> float | None:
        return None if self.paper is None else self.simulated - self.paper


Settings = dict[str, Setting]


def testbed_settings(zero1: bool = True) -> Settings:
    """Table 2's four models on the testbed, ZeRO-1 or not."""
    return {name: from_testbed(tb, zero1) for name, tb in TESTBEDS.items()}


def _table3_runs(cal: Calibration, settings: Settings) -> dict[tuple[str, str], dict[str, RunResult]]:
    return {
        (name, row): run_all(setting, cal, mtbf * 60)
        for name, setting in settings.items()
        for row, mtbf in pn.MTBFS_MIN.items()
    }


def table3_cells(cal: Calibration, settings: Settings) -> Iterator[Cell]:
    runs = _table3_runs(cal, settings)
    for (name, row), res in runs.items():
        status = "fitted" if row in pn.CALIBRATION_ROWS else "held out"
        for i, s in enumerate(pn.STRATEGIES):
            r = res[s]
            window = f", W {r.window} vs {pn.TABLE3_WINDOW[name]}" if s == "moevement" else ""
            yield Cell(
                "table3 ettr",
                f"{name} {row} {s} (closed {r.ettr_closed:.3f}{window})",
                r.ettr,
                pn.TABLE3_ETTR[name][row][i],
                status,
                r.ettr_closed,
            )
            cell_pct = OVERHEAD_CELLS[name][i][1] if row == "2H" else None  # one per model: beside 2H
            yield Cell("table3 overhead %", f"{name} {row} {s}", 100 * r.overhead, cell_pct, "shown")
            yield Cell(
                "table3 recovery s",
                f"{name} {row} {s} (R {r.recovery_s:.0f} s/failure, {r.fixed_s:.0f} s of it scope-independent)",
                r.recovery_total_s,
                pn.TABLE3_RECOVERY_S[name][row][i],
                "shown",
            )
        gem = res["gemini"].interval
        yield Cell("table3 gemini interval", f"{name} {row}", gem, None, "shown")
    for name in TESTBEDS:
        res = runs[(name, "2H")]
        yield Cell(
            "table3 interval",
            f"{name} checkfreq",
            res["checkfreq"].interval,
            pn.TABLE3_CHECKFREQ_INTERVAL[name],
            "held out",
        )
        yield Cell(
            "table3 interval", f"{name} moevement W", res["moevement"].window, pn.TABLE3_WINDOW[name], "held out"
        )
        w1 = _window_one_replica(settings[name])
        yield Cell("table3 interval", f"{name} moevement W at r = 1 (Table 6)", w1, pn.TABLE3_WINDOW[name], "shown")
        yield Cell("table3 interval", f"{name} moc", res["moc"].interval, 1, "held out")
        for (seconds, _), s in zip(OVERHEAD_CELLS[name], pn.STRATEGIES):
            yield Cell("table3 overhead s (T source)", f"{name} {s}", seconds, seconds, "input")


def _window_one_replica(s: Setting) -> int:
    """Algorithm 1's W if each snapshot went to one peer (Table 6's memory) instead of §4's two."""
    ops = s.operators
    return find_window_size([o.fp32 for o in ops], [o.compute for o in ops], s.iteration_s, snapshot_bandwidth(s, 1))[0]


def gemini_range_cells(cal: Calibration, settings: Settings) -> Iterator[Cell]:
    """Gemini's intervals at 2H and 10M against §5.2's ranges (the middle of the range as `paper`)."""
    for row, (lo, hi) in (("2H", pn.GEMINI_INTERVAL_2H), ("10M", pn.GEMINI_INTERVAL_10M)):
        for name, setting in settings.items():
            k = gemini_cost(setting, cal, pn.MTBFS_MIN[row] * 60).interval
            inside = "inside" if lo <= k <= hi else "outside"
            yield Cell("gemini interval range", f"{name} {row} ({lo}-{hi}: {inside})", k, (lo + hi) / 2, "held out")


def table4_cells(cal: Calibration, settings: Settings) -> Iterator[Cell]:
    """Our simulated minus Table 3's measured ETTR (%), beside the paper's own Table 4 difference."""
    runs = _table3_runs(cal, settings)
    for name, per in pn.TABLE4_PERCENT.items():
        for s, cells in per.items():
            for row, paper_pct in cells.items():
                ours = 100 * (runs[(name, row)][s].ettr - pn.TABLE3_ETTR[name][row][pn.STRATEGIES.index(s)])
                status = "fitted" if row in pn.CALIBRATION_ROWS else "held out"
                yield Cell("table4 sim-measured %", f"{name} {s} {row}", ours, paper_pct, status)


def figure_cells(cal: Calibration, settings: Settings) -> Iterator[Cell]:
    ds = settings["DeepSeek-MoE"]
    every = gemini_cost(ds, cal, 600.0, interval=1)
    yield Cell(
        "fig1a", "DeepSeek-MoE gemini every iteration: slowdown", 1 + every.overhead, pn.FIG1A_SLOWDOWN, "held out"
    )
    for r in scale_study(cal=cal):
        paper = pn.FIG11_671B_10M if (r.preset, r.mtbf_min) == ("671B-16384", 10.0) else {}
        for s in ("moevement", "gemini"):
            at_1h = s == "moevement" and r.mtbf_min == 60.0
            ref = paper.get(s, pn.FIG11_MIN_MOEVEMENT_1H if at_1h else None)
            label = f"{r.preset} {r.mtbf_min:g}min {s} (T {r.iteration_s:.1f} s, W {r.window}, k {r.gemini_interval})"
            label += " [paper: at least]" if at_1h else ""
            yield Cell("fig11", label, r.ettr[s], ref, "held out" if ref is not None else "shown")
    yield from fig13_cells(cal, settings)
    yield from _skew_cells(ds, cal)


def fig13_cells(cal: Calibration, settings: Settings) -> Iterator[Cell]:
    """Figure 13's four steps per model at Table 3's 1H MTBF (the text's ~0.97 final step is that row, so
    the final step is a calibration cell: `fitted`)."""
    for name, s in settings.items():
        rows = ablation(s, cal, FIG13_MTBF_S, FIG13_SKEW)
        refs = [pn.FIG13_SPARSE[name], None, None, pn.FIG13_FINAL]
        for row, ref, status in zip(rows, refs, ("held out", "shown", "shown", "fitted")):
            label = f"{name} {row.step} (W {row.window}, R {row.recovery_s:.0f} s/failure)"
            yield Cell("fig13", label, row.ettr, ref, status if ref is not None else "shown")
        gain = rows[2].ettr / rows[1].ettr - 1
        yield Cell("fig13", f"{name} gain of reordering", gain, pn.FIG13_REORDER_GAIN[name], "held out")
        if name == "DeepSeek-MoE":
            gain = rows[3].ettr / rows[2].ettr - 1
            yield Cell("fig13", f"{name} gain of upstream logging", gain, pn.FIG13_DEEPSEEK_LOGGING_GAIN, "held out")


def zero_failure_cells(cal: Calibration, settings: Settings) -> Iterator[Cell]:
    """Each strategy's ETTR without failures ((1 - zero_loss) / (1 + o)) beside the intercept Table 3's 2H
    and 1H rows imply under the run's failure law (E = A exp(-n r) through both rows: A = E_2H^2 / E_1H,
    a calibration quantity: `fitted`; MoC's escalation breaks the law, so it has none)."""
    for name, s in settings.items():
        res = run_all(s, cal, math.inf)
        for i, strategy in enumerate(pn.STRATEGIES):
            e2, e1 = pn.TABLE3_ETTR[name]["2H"][i], pn.TABLE3_ETTR[name]["1H"][i]
            r = res[strategy]
            label = f"{name} {strategy} (overhead {r.overhead:.3f}, zero-failure loss {r.zero_loss:.3f})"
            implied = None if strategy == "moc" else e2 * e2 / e1
            yield Cell("table3 zero failures", label, r.ettr, implied, "shown" if implied is None else "fitted")


def _skew_cells(ds, cal: Calibration) -> Iterator[Cell]:
    rep = pn.FIG16_REPORTED
    for r in skew_study(ds, cal):
        for s, v in r.ettr.items():
            ref = {"checkfreq": rep["checkfreq"], "gemini": rep["gemini"]}.get(s)
            if s == "moc" and r.skew in (0.0, 0.99):
                ref = rep["moc_s0"] if r.skew == 0.0 else rep["moc_s099"]
            label = f"S {r.skew:.2f} (drawn {r.drawn_skew:.2f}) {s}"
            label += f" (PLT {r.moc_plt:.3f}, final K {r.moc_fraction:.3f})" if s == "moc" else ""
            yield Cell("fig16", label, v, ref, "held out" if ref is not None else "shown")


def own_table4_cells(runs: list[MeasuredRun], source: str) -> Iterator[Cell]:
    """The model on each measured run's primitives (`simulator.measured`) against its measured ETTR; the
    runs of Figure 13's variants (`fault.scope=global`) form our own Figure 13, with the measured gain of
    upstream logging beside the predicted one."""
    ablation = any(not ablation_of(r.strategy)[1].localized for r in runs)
    section = f"own {'fig13' if ablation else 'table4'} ({source})"
    predicted = {}
    for r in runs:
        cost, ettr = predicted_cost(r), predict(r)
        if cost is None or ettr is None:
            continue
        predicted[r.run] = (ettr, r.ettr)
        base, kept = ablation_of(r.strategy)
        dropped = [n for n, on in (("global", kept.localized), ("frozen B_w", kept.skip_bweight)) if not on]
        dropped += [] if kept.reorder else ["model order"]
        name = f"{base} [{', '.join(dropped)}]" if dropped else base
        label = f"{r.run} {name} (o {cost.overhead:.3f}, R {cost.recovery_s:.1f} s"
        label += f", W {cost.window}" if cost.window else f", k {cost.interval}"
        label += f"; not recorded: {', '.join(unrecorded(r))})" if unrecorded(r) else ")"
        yield Cell(section, label, ettr, r.ettr, "held out")
    if ablation and len(predicted) >= 2:
        (p3, m3), (p4, m4) = list(predicted.values())[-2:]
        yield Cell(
            section, "gain of upstream logging (last step over the one before)", p4 / p3 - 1, m4 / m3 - 1, "held out"
        )


def all_cells(cal: Calibration, zero1: bool = True, measured: Sequence[str] | None = None) -> list[Cell]:
    """Every compared cell; `zero1=False` keeps every data-parallel rank's FP32 state unsharded; `measured`:
    the benchmark's ettr.csv files for our own Table 4 and Figure 13 (default: the committed records,
    `simulator.measured.RECORDED_CSV` and `RECORDED_ABLATION_CSV`)."""
    paths = list(measured or (RECORDED_CSV, RECORDED_ABLATION_CSV))
    st = testbed_settings(zero1)
    return [
        *table3_cells(cal, st),
        *zero_failure_cells(cal, st),
        *gemini_range_cells(cal, st),
        *table4_cells(cal, st),
        *figure_cells(cal, st),
        *(cell for path in paths for cell in own_table4_cells(read_csv(path), _source(path))),
    ]


def _source(path) -> str:
    """The section's name for a measured CSV: a committed record by its commit, another by its path."""
    recorded = {
        str(RECORDED_CSV): "recorded bench_moe, commit fbc45b1, 2026-11-26",
        str(RECORDED_ABLATION_CSV): "recorded bench_moe ablation, commit 8c3d74d, 2026-11-26",
    }
    return recorded.get(str(path), f"measured: {path}")


def held_out_errors(cells: list[Cell], closed: bool = False) -> dict[str, tuple[float, float, int]]:
    """Per strategy: (rms, max |diff|, count) over Table 3's held-out ETTR cells (finite run or closed form)."""
    out = {}
    for s in pn.STRATEGIES:
        mine = [c for c in cells if c.section == "table3 ettr" and c.status == "held out" and f" {s} " in c.label]
        diffs = [(c.closed if closed else c.simulated) - c.paper for c in mine]
        if diffs:
            out[s] = (math.sqrt(sum(d * d for d in diffs) / len(diffs)), max(abs(d) for d in diffs), len(diffs))
    return out


def render(cells: list[Cell]) -> str:
    """Cells grouped by section (in first-seen order), then the held-out summary."""
    sections = list(dict.fromkeys(c.section for c in cells))
    lines, section = [], None
    for c in sorted(cells, key=lambda c: sections.index(c.section)):
        if c.section != section:
            section = c.section
            ref = "measured" if section.startswith("own ") else "paper"
            lines.append(f"\n## {section}\n{'cell':<78} {'simulated':>10} {ref:>8} {'diff':>8}  status")
        paper = "-" if c.paper is None else f"{c.paper:.3f}"
        diff = "-" if c.diff is None else f"{c.diff:+.3f}"
        lines.append(f"{c.label:<78} {c.simulated:>10.3f} {paper:>8} {diff:>8}  {c.status}")
    lines.append("\n## held-out Table 3 ETTR per strategy (12 cells each: 30M, 20M, 10M x 4 models)")
    closed = held_out_errors(cells, closed=True)
    for s, (rms, mx, n) in held_out_errors(cells).items():
        tail = f"(closed form: rms {closed[s][0]:.3f}  max {closed[s][1]:.3f})"
        lines.append(f"{s:<10} rms {rms:.3f}  max {mx:.3f}  cells {n}  {tail}")
    return "\n".join(lines)
