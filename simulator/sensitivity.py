"""Which inputs move a preset's ETTR at one MTBF most: one input changed at a time, the rest kept.

    python -m simulator --sensitivity [--preset 671B-16384] [--mtbf-min 10] [--json]

Inputs: the host link bandwidth (snapshot copies and recovery fetches), a cap on snapshot copies
during training only (as `benchmarks.ettr` caps them; also the cap at which a dense copy takes 3
iterations, the benchmarks' `--dense-snapshot-iters 3`), the restart constant, the number of
pipeline stages (GPUs, expert parallelism and global batch kept: pipelines and micro-batches
follow; only splits that divide evenly and leave every stage a layer), MoEvement's window W
(forced instead of Algorithm 1's) and the micro-batch count M (the global batch changes with it).

Then where the paper's figures would be reached, by bisection (ETTR is monotone in each input):
the host link or snapshot cap at which Gemini reaches its figure, the restart constant at which
Gemini or MoEvement does; and the largest MoEvement / Gemini ratio over snapshot caps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from simulator.cluster import GB, Preset
from simulator.presets import layout_for
from simulator.strategies import Scenario, simulate

HOST_GBS = (100.0, 5.0, 1.0, 0.25)
CAP_GBS = (2.0, 1.0, 0.5)
SPEEDUP_CAPS_GBS = tuple(10 ** (-1 + i / 20) for i in range(61))  # 0.1 to 100 GB/s
RESTART_S = (0.0, 30.0, 120.0, 300.0)
WINDOWS = (1, 2, 4, 8, 16)
MICRO_BATCH_FACTORS = (0.5, 2.0)


@dataclass(frozen=True)
class SensitivityRow:
    """MoEvement's and Gemini's ETTR with one input changed."""

    input: str
    value: str
    moevement: float
    gemini: float
    window: int
    gemini_interval: int
    iteration_s: float


@dataclass(frozen=True)
class BreakEven:
    """The value of `input` at which `strategy` reaches `target`, and the other strategy's ETTR there."""

    strategy: str
    target: float
    input: str
    value: float | None  # None: not reached within the searched range
    assumed: float
    other: str
    other_ettr: float | None


def _row(name: str, value: str, preset: Preset, mtbf_s: float, window: int | None = None) -> SensitivityRow:
    res = {r.strategy: r for r in simulate(preset, mtbf_s, ("moevement", "gemini"), window=window)}
    m, g = res["moevement"], res["gemini"]
    return SensitivityRow(name, value, m.ettr, g.ettr, m.window, g.interval, Scenario.of(preset).iteration_s)


def _with_hw(preset: Preset, **changes: float) -> Preset:
    return replace(preset, hw=replace(preset.hw, **changes))


def stage_variants(preset: Preset) -> list[Preset]:
    """The preset on S/4, S/2 and 2S stages where the GPUs, ep and global batch split evenly and every
    stage holds a layer."""
    lay, out = preset.layout, []
    for stages in (lay.pp // 4, lay.pp // 2, 2 * lay.pp):
        per_stage = lay.ep * stages
        if stages < 1 or stages > preset.model.layers or lay.gpus % per_stage:
            continue
        try:
            out.append(replace(preset, layout=layout_for(stages, lay.gpus // per_stage, lay.ep, lay.batch_seqs)))
        except ValueError:
            continue
    return out


def _bandwidth_rows(preset: Preset, mtbf_s: float) -> list[SensitivityRow]:
    sc = Scenario.of(preset)
    three = sc.dense_bytes / (3 * sc.iteration_s)  # the benchmarks' regime: a dense copy takes 3 iterations
    caps = [(f"{g:g}", g * GB) for g in CAP_GBS] + [(f"{three / GB:.2f} (dense copy 3 T)", three)]
    rows = [_row("host link (GB/s)", f"{g:g}", _with_hw(preset, host_bw=g * GB), mtbf_s) for g in HOST_GBS]
    return rows + [_row("snapshot cap (GB/s)", v, _with_hw(preset, snapshot_cap_bw=bw), mtbf_s) for v, bw in caps]


def sensitivity(preset: Preset, mtbf_s: float) -> list[SensitivityRow]:
    """The baseline row, then one row per changed input."""
    hw, lay = preset.hw, preset.layout
    rows = [_row("as assumed", f"host {hw.host_bw / GB:g} GB/s, restart {hw.restart_s:g} s", preset, mtbf_s)]
    rows += _bandwidth_rows(preset, mtbf_s)
    rows += [_row("restart (s)", f"{r:g}", _with_hw(preset, restart_s=r), mtbf_s) for r in RESTART_S]
    for p in stage_variants(preset):
        value = f"{p.layout.pp} (pipelines {p.layout.pipelines}, M {p.layout.micro_batches})"
        rows.append(_row("stages", value, p, mtbf_s))
    rows += [_row("window W", f"{w}", preset, mtbf_s, window=w) for w in WINDOWS]
    for f in MICRO_BATCH_FACTORS:
        m = max(1, round(lay.micro_batches * f))
        rows.append(_row("micro-batches M", f"{m}", replace(preset, layout=replace(lay, micro_batches=m)), mtbf_s))
    return rows


def bisect(f: Callable[[float], float], lo: float, hi: float, target: float, steps: int = 60) -> float | None:
    """x in [lo, hi] where the monotone f crosses `target` (geometric midpoints if lo > 0); None if it does not."""
    f_lo, f_hi = f(lo), f(hi)
    if (f_lo - target) * (f_hi - target) > 0:
        return None
    rising = f_hi > f_lo
    for _ in range(steps):
        mid = math.sqrt(lo * hi) if lo > 0 else (lo + hi) / 2
        if (f(mid) < target) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _ettr(preset: Preset, mtbf_s: float, strategy: str) -> float:
    return simulate(preset, mtbf_s, (strategy,))[0].ettr


@dataclass(frozen=True)
class Search:
    """Move `field` of `Hardware` (in units of `unit`) over [lo, hi] until `strategy` reaches its target."""

    strategy: str
    input: str
    field: str
    unit: float
    lo: float
    hi: float


SEARCHES = (
    Search("gemini", "host link (GB/s)", "host_bw", GB, 0.01, 1000.0),
    Search("gemini", "snapshot cap (GB/s)", "snapshot_cap_bw", GB, 0.01, 1000.0),
    Search("gemini", "restart (s)", "restart_s", 1.0, 0.0, 86400.0),
    Search("moevement", "restart (s)", "restart_s", 1.0, 0.0, 86400.0),
)


def _search(preset: Preset, mtbf_s: float, target: float, search: Search) -> BreakEven:
    other = "moevement" if search.strategy == "gemini" else "gemini"

    def at(x: float, strategy: str = search.strategy) -> float:
        return _ettr(_with_hw(preset, **{search.field: x * search.unit}), mtbf_s, strategy)

    value = bisect(at, search.lo, search.hi, target)
    other_ettr = None if value is None else at(value, other)
    assumed = getattr(preset.hw, search.field) / search.unit
    return BreakEven(search.strategy, target, search.input, value, assumed, other, other_ettr)


def break_even(preset: Preset, mtbf_s: float, targets: dict[str, float]) -> list[BreakEven]:
    """Where each strategy of `targets` reaches its target ETTR, moving one input of `SEARCHES`."""
    return [_search(preset, mtbf_s, targets[s.strategy], s) for s in SEARCHES if s.strategy in targets]


@dataclass(frozen=True)
class BestSpeedup:
    """The snapshot cap of `SPEEDUP_CAPS_GBS` at which MoEvement's ETTR over Gemini's is largest."""

    cap_gbs: float
    speedup: float
    moevement: float
    gemini: float


def best_speedup(preset: Preset, mtbf_s: float) -> BestSpeedup:
    """Sweep the snapshot cap over `SPEEDUP_CAPS_GBS` and keep the largest MoEvement / Gemini ratio."""
    candidates = []
    for cap in SPEEDUP_CAPS_GBS:
        at = _with_hw(preset, snapshot_cap_bw=cap * GB)
        m, g = (r.ettr for r in simulate(at, mtbf_s, ("moevement", "gemini")))
        candidates.append(BestSpeedup(cap, m / g if g > 0 else math.inf, m, g))
    return max(candidates, key=lambda c: c.speedup)


def sensitivity_table(rows: list[SensitivityRow]) -> str:
    """Markdown: one row per changed input, with the change from the first (as assumed) row."""
    base = rows[0]
    lines = [
        "| input | value | moevement | gemini | W | gemini k | iteration (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dm, dg = r.moevement - base.moevement, r.gemini - base.gemini
        delta = r is not base
        lines.append(
            f"| {r.input} | {r.value} | {r.moevement:.3f}{f' ({dm:+.3f})' if delta else ''} "
            f"| {r.gemini:.3f}{f' ({dg:+.3f})' if delta else ''} | {r.window} | {r.gemini_interval} "
            f"| {r.iteration_s:.2f} |"
        )
    return "\n".join(lines)


def break_even_lines(points: list[BreakEven], best: BestSpeedup) -> list[str]:
    """One sentence per break-even point, then the largest speedup over snapshot caps."""
    out = []
    for b in points:
        if b.value is None:
            out.append(f"{b.strategy} does not reach {b.target:.2f} for any {b.input} searched")
            continue
        out.append(
            f"{b.strategy} reaches {b.target:.2f} at {b.input} = {b.value:.3g} (assumed {b.assumed:g}); "
            f"{b.other} there: {b.other_ettr:.3f}"
        )
    caps = f"{SPEEDUP_CAPS_GBS[0]:g}-{SPEEDUP_CAPS_GBS[-1]:g} GB/s"
    out.append(
        f"largest moevement / gemini over snapshot caps of {caps}: {best.speedup:.2f}x at {best.cap_gbs:.2f} GB/s "
        f"(moevement {best.moevement:.3f}, gemini {best.gemini:.3f})"
    )
    return out
