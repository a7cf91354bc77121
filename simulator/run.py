"""A strategy over a finite run (Table 3's 12 hours) and in closed form (the paper's formula).

Finite run: N = run / MTBF failures, the i-th at wall time (i - 1/2) MTBF; each costs its recovery
in wall time, and training between failures advances at 1 / (1 + o). ETTR = useful time / run. For
constant o and R this is (1 - N R / run) / (1 + o). Closed form (Appendix C):
1 / (1 + o) x 1 / (1 + R / MTBF).

MoC's o changes during the run: Dynamic-K (MoC-System §4.4) recomputes the accumulated proportion
of lost tokens (PLT: iterations' worth of expert updates lost / iterations trained) after every
failure; once PLT has passed its budget, the expert fraction f doubles at that and every later
failure ("reiterated until checkpointing all experts"). Its closed form uses the run's
time-averaged overhead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from simulator.calibrated import MOC_PLT_BUDGET, MOC_START_FRACTION, Calibration
from simulator.mechanisms import (
    Cost,
    checkfreq_cost,
    gemini_cost,
    moc_overhead,
    moc_recovery_s,
    moevement_cost,
)
from simulator.setting import Setting
from simulator.skew import round_robin_staleness
from simulator.testbed import RUN_S


@dataclass(frozen=True)
class RunResult:
    strategy: str
    ettr: float  # finite run
    ettr_closed: float
    overhead: float  # time-averaged over the run
    recovery_total_s: float
    interval: int | None = None
    window: int | None = None
    plt: float | None = None
    moc_fraction: float | None = None  # MoC's expert fraction at the end of the run


def closed_form(overhead: float, recovery_s: float, mtbf_s: float) -> float:
    if math.isinf(mtbf_s):
        return 1 / (1 + overhead)
    return 1 / ((1 + overhead) * (1 + recovery_s / mtbf_s))


def failures_in(run_s: float, mtbf_s: float) -> int:
    return 0 if math.isinf(mtbf_s) else int(round(run_s / mtbf_s))


def finite(cost: Cost, mtbf_s: float, run_s: float = RUN_S) -> RunResult:
    """A constant-cost strategy over the run."""
    n = failures_in(run_s, mtbf_s)
    lost = min(run_s, n * cost.recovery_s)
    return RunResult(
        cost.strategy,
        (1 - lost / run_s) / (1 + cost.overhead),
        closed_form(cost.overhead, cost.recovery_s, mtbf_s),
        cost.overhead,
        lost,
        cost.interval,
        cost.window,
    )


def _moc_loss(s: Setting, cal: Calibration, fraction: float, iteration: int, shares) -> float:
    """Iterations' worth of expert updates one failure loses at expert fraction `fraction`."""
    period = max(1, round(1 / fraction))
    if shares is None:
        return cal.moc_loss_scale * (period - 1) / 2
    stale = [round_robin_staleness(p, period, iteration) for p in shares]
    return cal.moc_loss_scale * sum(stale) / len(stale)


def moc_run(
    s: Setting, cal: Calibration, mtbf_s: float, shares: Sequence[Sequence[float]] | None = None, run_s: float = RUN_S
) -> RunResult:
    """MoC over the run, with Dynamic-K reacting failure by failure."""
    n, t, recovery = failures_in(run_s, mtbf_s), s.iteration_s, moc_recovery_s(s, cal)
    fraction, clock, useful, iterations, lost_iters, weighted_o = MOC_START_FRACTION, 0.0, 0.0, 0.0, 0.0, 0.0
    escalating = False
    for i in range(n + 1):
        until = run_s if i == n else min(run_s, (i + 0.5) * mtbf_s)
        o = moc_overhead(s, fraction)
        span = max(0.0, until - clock)
        useful, iterations, weighted_o = (
            useful + span / (1 + o),
            iterations + span / ((1 + o) * t),
            weighted_o + span * o,
        )
        clock = until
        if i == n:
            break
        lost_iters += _moc_loss(s, cal, fraction, int(iterations), shares)
        escalating = escalating or (iterations > 0 and lost_iters / iterations > MOC_PLT_BUDGET)
        if escalating:
            fraction = min(1.0, 2 * fraction)
        clock += recovery
    mean_o = weighted_o / max(1e-9, run_s - min(run_s, n * recovery))
    plt = lost_iters / iterations if iterations else 0.0
    lost = min(run_s, n * recovery)
    return RunResult("moc", useful / run_s, closed_form(mean_o, recovery, mtbf_s), mean_o, lost, 1, None, plt, fraction)


def run_all(
    s: Setting, cal: Calibration, mtbf_s: float, shares: Sequence[Sequence[float]] | None = None
) -> dict[str, RunResult]:
    """Every strategy on one setting and MTBF (finite run and closed form)."""
    return {
        "checkfreq": finite(checkfreq_cost(s, cal), mtbf_s),
        "gemini": finite(gemini_cost(s, cal, mtbf_s), mtbf_s),
        "moc": moc_run(s, cal, mtbf_s, shares),
        "moevement": finite(moevement_cost(s, cal, shares), mtbf_s),
    }
