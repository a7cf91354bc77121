"""Which inputs move a preset's ETTR at one MTBF most: one input changed at a time, the rest kept.

    python -m simulator --sensitivity [--preset 671B-16384] [--mtbf-min 10] [--json]

The model is `simulator.model`'s (the calibrated one every command runs). Inputs: the GPU-to-host
copy bandwidth, the node's NIC line rate, a cap on snapshot copies while training runs, the fixed
restart, every fitted constant at -20% and +20% (no refit), the number of pipeline stages (GPUs,
expert parallelism and global batch kept; only splits that divide evenly and leave every stage a
layer), MoEvement's window W (forced instead of Algorithm 1's) and the micro-batch count M.

Then where the paper's figures would be reached, by bisection (ETTR is monotone in each input):
the NIC line rate at which Gemini reaches its figure, the fixed restart at which Gemini or MoEvement
does (not MoEvement's NIC: W steps with it, so its ETTR is not monotone); and the
largest MoEvement / Gemini ratio over snapshot caps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from simulator.calibrated import FITTED, Calibration
from simulator.cluster import Preset
from simulator.model import NO_OVERRIDES, Overrides, predict_setting, preset_setting, speedup
from simulator.presets import layout_for

HOST_GBS = (100.0, 5.0, 1.0, 0.25)
NIC_GBPS = (400.0, 200.0, 40.0)
CAP_GBS = (2.0, 1.0, 0.5, 0.1)
SPEEDUP_CAPS_GBS = tuple(10 ** (-2 + i / 20) for i in range(61))  # 0.01 to 10 GB/s
RESTART_S = (0.0, 30.0, 120.0, 300.0)
WINDOWS = (1, 2, 4, 8, 16)
MICRO_BATCH_FACTORS = (0.5, 2.0)
PERTURBATION = 0.2


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


def _pair(preset: Preset, mtbf_s: float, ov: Overrides, cal: Calibration = FITTED, window: int | None = None):
    s = preset_setting(preset, ov)
    m, g = predict_setting(s, mtbf_s, ("moevement", "gemini"), window=window, cal=ov.calibration(cal))
    return s, m, g


def _row(name: str, value: str, preset: Preset, mtbf_s: float, ov: Overrides, **kw) -> SensitivityRow:
    s, m, g = _pair(preset, mtbf_s, ov, **kw)
    return SensitivityRow(name, value, m.ettr, g.ettr, m.window, g.interval, s.iteration_s)


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


def _hardware_rows(preset: Preset, mtbf_s: float, ov: Overrides) -> list[SensitivityRow]:
    rows = [_row("host link (GB/s)", f"{g:g}", preset, mtbf_s, replace(ov, host_gbs=g)) for g in HOST_GBS]
    rows += [_row("NIC (Gb/s)", f"{g:g}", preset, mtbf_s, replace(ov, nic_gbps=g)) for g in NIC_GBPS]
    rows += [_row("snapshot cap (GB/s)", f"{g:g}", preset, mtbf_s, replace(ov, snapshot_cap_gbs=g)) for g in CAP_GBS]
    return rows + [_row("restart (s)", f"{r:g}", preset, mtbf_s, replace(ov, restart_s=r)) for r in RESTART_S]


def _constant_rows(preset: Preset, mtbf_s: float, ov: Overrides) -> list[SensitivityRow]:
    rows = []
    for name, value in asdict(FITTED).items():
        for f in (1 - PERTURBATION, 1 + PERTURBATION):
            changed = replace(FITTED, **{name: min(1.0, value * f) if name == "nic_efficiency" else value * f})
            rows.append(_row(f"fitted {name}", f"{f:.1f}x", preset, mtbf_s, ov, cal=changed))
    return rows


def sensitivity(preset: Preset, mtbf_s: float, ov: Overrides = NO_OVERRIDES) -> list[SensitivityRow]:
    """The baseline row, then one row per changed input."""
    rows = [_row("as assumed", "fitted constants, stated hardware", preset, mtbf_s, ov)]
    rows += _hardware_rows(preset, mtbf_s, ov) + _constant_rows(preset, mtbf_s, ov)
    for p in stage_variants(preset):
        value = f"{p.layout.pp} (pipelines {p.layout.pipelines}, M {p.layout.micro_batches})"
        rows.append(_row("stages", value, p, mtbf_s, ov))
    rows += [_row("window W", f"{w}", preset, mtbf_s, ov, window=w) for w in WINDOWS]
    lay = preset.layout
    for f in MICRO_BATCH_FACTORS:
        m = max(1, round(lay.micro_batches * f))
        changed = replace(preset, layout=replace(lay, micro_batches=m))
        rows.append(_row("micro-batches M", f"{m}", changed, mtbf_s, ov))
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


@dataclass(frozen=True)
class Search:
    """Move `field` of `Overrides` over [lo, hi] until `strategy` reaches its target; `assumed` is its value."""

    strategy: str
    input: str
    field: str
    lo: float
    hi: float
    assumed: float


SEARCHES = (
    Search("gemini", "NIC (Gb/s)", "nic_gbps", 1.0, 10000.0, 80.0),
    Search("gemini", "restart (s)", "restart_s", 0.0, 86400.0, FITTED.restart_s),
    Search("moevement", "restart (s)", "restart_s", 0.0, 86400.0, FITTED.restart_s),
)


def _search(preset: Preset, mtbf_s: float, target: float, search: Search, ov: Overrides) -> BreakEven:
    other = "moevement" if search.strategy == "gemini" else "gemini"

    def at(x: float, strategy: str = search.strategy) -> float:
        _, m, g = _pair(preset, mtbf_s, replace(ov, **{search.field: x}))
        return m.ettr if strategy == "moevement" else g.ettr

    value = bisect(at, search.lo, search.hi, target)
    other_ettr = None if value is None else at(value, other)
    return BreakEven(search.strategy, target, search.input, value, search.assumed, other, other_ettr)


def break_even(
    preset: Preset, mtbf_s: float, targets: dict[str, float], ov: Overrides = NO_OVERRIDES
) -> list[BreakEven]:
    """Where each strategy of `targets` reaches its target ETTR, moving one input of `SEARCHES`."""
    return [_search(preset, mtbf_s, targets[s.strategy], s, ov) for s in SEARCHES if s.strategy in targets]


@dataclass(frozen=True)
class BestSpeedup:
    """The snapshot cap of `SPEEDUP_CAPS_GBS` at which MoEvement's ETTR over Gemini's is largest."""

    cap_gbs: float
    speedup: float
    moevement: float
    gemini: float


def best_speedup(preset: Preset, mtbf_s: float, ov: Overrides = NO_OVERRIDES) -> BestSpeedup:
    """Sweep the snapshot cap over `SPEEDUP_CAPS_GBS` and keep the largest MoEvement / Gemini ratio."""
    candidates = []
    for cap in SPEEDUP_CAPS_GBS:
        _, m, g = _pair(preset, mtbf_s, replace(ov, snapshot_cap_gbs=cap))
        candidates.append(BestSpeedup(cap, speedup(m.ettr, g.ettr), m.ettr, g.ettr))
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
