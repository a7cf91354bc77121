"""A strategy over a run (Table 3's 12 hours) and in the paper's closed form.

Failures are a Poisson process over the whole run, recovery included: a failure that strikes while
a strategy recovers restarts its recovery. A recovery of R seconds then costs, per failure,
E[min(X, R)] = MTBF (1 - exp(-R / MTBF)) (X the exponential time to the next failure), and the
useful share of wall time is exp(-R / MTBF); R near or above the MTBF (CheckFreq's at 10 minutes)
no longer drives ETTR below zero. Training between failures advances at 1 / (1 + o), and a strategy
loses its failure-independent share `zero_loss` (`simulator.mechanisms.Cost`):

    ETTR = (1 - zero_loss) exp(-R / MTBF) / (1 + o)

The paper's closed form (Appendix C), printed beside it with the same zero_loss, so that the two differ
only in their failure law: (1 - zero_loss) / (1 + o) x 1 / (1 + R / MTBF).

MoC's o changes during the run: Dynamic-K (MoC-System §4.4) recomputes the accumulated proportion
of lost tokens (PLT: iterations' worth of expert updates lost / iterations trained) after every
failure (run / MTBF of them, at their expected times); once PLT has passed its budget, the expert
fraction f doubles at that and every later failure ("reiterated until checkpointing all experts").
Its closed form uses the run's time-averaged overhead.

A benchmark injects a fixed schedule of failures instead (`scheduled_ettr`: wall = useful (1 + o) + F R),
the law `simulator.measured` applies to a measured run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from simulator.calibrated import MOC_PLT_BUDGET, MOC_START_FRACTION, Calibration
from simulator.mechanisms import Cost, moc_overhead, moc_recovery_s
from simulator.moc_loss import moc_lost_iterations
from simulator.setting import Setting
from simulator.testbed import RUN_S


@dataclass(frozen=True)
class RunResult:
    strategy: str
    ettr: float  # over the run, Poisson failures
    ettr_closed: float
    overhead: float  # time-averaged over the run
    recovery_total_s: float
    interval: int | None = None
    window: int | None = None
    plt: float | None = None
    moc_fraction: float | None = None  # MoC's expert fraction at the end of the run
    recovery_s: float = 0.0  # per failure, before failures during recovery
    zero_loss: float = 0.0
    fixed_s: float = 0.0  # the part of recovery_s that does not scale with the failed scope


def closed_form(overhead: float, recovery_s: float, mtbf_s: float, zero_loss: float = 0.0) -> float:
    """The paper's Appendix C form, with the same failure-independent loss: (1 - zero_loss) / ((1 + o)(1 + R/MTBF))."""
    if math.isinf(mtbf_s):
        return (1 - zero_loss) / (1 + overhead)
    return (1 - zero_loss) / ((1 + overhead) * (1 + recovery_s / mtbf_s))


def failures_in(run_s: float, mtbf_s: float) -> int:
    return 0 if math.isinf(mtbf_s) else int(round(run_s / mtbf_s))


def lost_per_failure(recovery_s: float, mtbf_s: float) -> float:
    """Expected wall seconds one failure costs when the next may strike during its recovery."""
    return 0.0 if math.isinf(mtbf_s) else mtbf_s * -math.expm1(-recovery_s / mtbf_s)


def finite(cost: Cost, mtbf_s: float, run_s: float = RUN_S) -> RunResult:
    """A constant-cost strategy over the run: (1 - zero_loss) exp(-R / MTBF) / (1 + o)."""
    useful = 1.0 if math.isinf(mtbf_s) else math.exp(-cost.recovery_s / mtbf_s)
    lost = run_s * (1 - useful)
    return RunResult(
        cost.strategy,
        (1 - cost.zero_loss) * useful / (1 + cost.overhead),
        closed_form(cost.overhead, cost.recovery_s, mtbf_s, cost.zero_loss),
        cost.overhead,
        lost,
        cost.interval,
        cost.window,
        recovery_s=cost.recovery_s,
        zero_loss=cost.zero_loss,
        fixed_s=cost.restart_s,
    )


def scheduled_ettr(cost: Cost, failures: int, useful_s: float) -> float:
    """A run with a fixed number of failures (a benchmark's injected schedule) instead of Poisson ones:
    useful time over useful (1 + o) + F R, times (1 - zero_loss). `useful_s`: the iterations' fault-free time."""
    wall = useful_s * (1 + cost.overhead) + failures * cost.recovery_s
    return (1 - cost.zero_loss) * useful_s / wall if wall > 0 else 0.0


def moc_run(
    s: Setting, cal: Calibration, mtbf_s: float, shares: Sequence[Sequence[float]] | None = None, run_s: float = RUN_S
) -> RunResult:
    """MoC over the run, with Dynamic-K reacting failure by failure."""
    n, t, recovery = failures_in(run_s, mtbf_s), s.iteration_s, moc_recovery_s(s, cal)
    lost_each = lost_per_failure(recovery, mtbf_s)
    fraction, clock, useful, iterations, lost_iters, weighted_o = MOC_START_FRACTION, 0.0, 0.0, 0.0, 0.0, 0.0
    escalating = False
    for i in range(n + 1):
        until = run_s if i == n else min(run_s, (i + 0.5) * mtbf_s)
        o = moc_overhead(s, fraction, cal)
        span = max(0.0, until - clock)
        useful, iterations, weighted_o = (
            useful + span / (1 + o),
            iterations + span / ((1 + o) * t),
            weighted_o + span * o,
        )
        clock = until
        if i == n:
            break
        lost_iters += moc_lost_iterations(cal, fraction, int(iterations), shares)
        escalating = escalating or (iterations > 0 and lost_iters / iterations > MOC_PLT_BUDGET)
        if escalating:
            fraction = min(1.0, 2 * fraction)
        clock += lost_each
    lost = min(run_s, n * lost_each)
    mean_o = weighted_o / max(1e-9, run_s - lost)
    plt = lost_iters / iterations if iterations else 0.0
    ettr = (1 - cal.zero_loss_moc) * useful / run_s
    closed = closed_form(mean_o, recovery, mtbf_s, cal.zero_loss_moc)
    return RunResult(
        "moc", ettr, closed, mean_o, lost, 1, None, plt, fraction, recovery, cal.zero_loss_moc, cal.restart_s
    )
