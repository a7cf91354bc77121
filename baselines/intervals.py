"""When the interval baselines (gemini, checkfreq, moc) checkpoint: every `k` iterations, by policy.

A checkpoint snapshots `state_t` during iteration t's forward/backward; what the copy needs beyond
that overlap is a stall of the optimizer step: `cost = max(0, bytes / bandwidth - overlap)`.

  fixed    `checkpoint.interval = N`.
  capped   CheckFreq's policy: the smallest k whose overhead `cost / (k * T)` is at most 3%,
           re-derived from the stalls measured at earlier checkpoints.
  oracle   Gemini with a known MTBF (`checkpoint.mtbf_iters`, else `fault.mtbf_iters`: M, i.e. M T
           seconds): the k maximising
           `ETTR(k) = 1 / (1 + cost / (k T)) * max(0, 1 - (k / 2 + 1) T / (M T))`: checkpoint
           overhead against the iterations a failure loses on average (Young/Daly, in integers).
  every    MoC-System's: a checkpoint every iteration, its size (K_pec) chosen so the copy overlaps the
           iteration (`baselines.moc.adaptive_k`; the MoEvement paper runs MoC so, §5.2).
`ettr` gives the steady state of a measured profile (`simulator.calibration`) and `checkfreq_*` is
CheckFreq's policy in `simulator.mechanisms`; the scale study's Gemini interval is `simulator.oracle`.
`auto` is the strategy's own policy: every iteration for moc, oracle for gemini when the MTBF is known,
else capped.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

CHECKFREQ_MAX_OVERHEAD = 0.03


def checkpoint_cost(snapshot_bytes: float, bandwidth: float, overlap_s: float) -> float:
    """Seconds the optimizer step waits for a snapshot copied at `bandwidth` during `overlap_s`."""
    return max(0.0, snapshot_bytes / bandwidth - overlap_s) if bandwidth > 0 else 0.0


def ettr(overhead: float, recovery_s: float, mtbf_s: float) -> float:
    """Steady state: 1 / (1 + o) * max(0, 1 - R / MTBF); no failures (MTBF = inf) gives 1 / (1 + o)."""
    if math.isinf(mtbf_s):
        return 1.0 / (1.0 + overhead)
    return max(0.0, 1.0 - recovery_s / mtbf_s) / (1.0 + overhead)


def periodic_ettr(k: int, stall_s: float, iteration_s: float, fixed_s: float, mtbf_s: float) -> float:
    """ETTR of a dense checkpoint every k iterations: overhead s/(kT), R = fixed + (k/2 + 1) T."""
    return ettr(stall_s / (k * iteration_s), fixed_s + (k / 2 + 1) * iteration_s, mtbf_s)


def oracle_interval(stall_s: float, iteration_s: float, fixed_s: float, mtbf_s: float) -> int:
    """The k >= 1 maximising `periodic_ettr`: stationary point of the continuous form, best neighbour.

    g(x) = x / (x + a) * (b - d x) with a = s / T, b = 1 - (fixed + T) / MTBF, d = T / (2 MTBF) is
    unimodal on x > 0 with its maximum at x* = -a + sqrt(a^2 + a b / d).
    """
    if math.isinf(mtbf_s):  # no failures: only the overhead counts
        return 1 if stall_s <= 0 else 10**6
    a, b, d = stall_s / iteration_s, 1 - (fixed_s + iteration_s) / mtbf_s, iteration_s / (2 * mtbf_s)
    if a <= 0 or b <= 0 or d <= 0:
        return 1
    x = -a + math.sqrt(a * a + a * b / d)
    candidates = {max(1, math.floor(x)), max(1, math.ceil(x))}
    return max(sorted(candidates), key=lambda k: periodic_ettr(k, stall_s, iteration_s, fixed_s, mtbf_s))


def checkfreq_overhead(k: int, stall_s: float, persist_s: float, iteration_s: float) -> float:
    """Snapshot stall plus the wait for the previous persist when it outlasts k iterations, per kT."""
    return (stall_s + max(0.0, persist_s - k * iteration_s)) / (k * iteration_s)


def checkfreq_interval(
    stall_s: float, persist_s: float, iteration_s: float, cap: float = CHECKFREQ_MAX_OVERHEAD
) -> int:
    """Smallest k with `checkfreq_overhead` <= cap (overhead falls as k grows, so the search ends)."""
    k = 1
    while checkfreq_overhead(k, stall_s, persist_s, iteration_s) > cap:
        k += 1
    return k


@dataclass
class IntervalPolicy:
    """Checkpoint iterations of an interval baseline; `choose` is called at each checkpoint.

    `select()` names the operators the next checkpoint holds (all of them, or MoC's partial set)."""

    strategy: str
    spec: str  # "auto" | "oracle" | "capped" | a positive integer
    mtbf_iters: float
    select: Callable[[], list[str]]
    next_due: int = 0
    interval: int = 1
    stalls: list[float] = field(default_factory=list)

    def due(self, iteration: int) -> bool:
        return iteration >= self.next_due

    def mode(self) -> str:
        if self.spec.isdigit() or (self.spec == "auto" and self.strategy == "moc"):
            return "fixed"
        if self.spec == "oracle" or (self.spec == "auto" and self.strategy == "gemini" and self.mtbf_iters > 0):
            return "oracle"
        return "capped"

    def choose(self, snapshot_bytes: float, bandwidth: float, overlap_s: float) -> int:
        """The interval from this checkpoint to the next (measured stalls win over the estimate)."""
        mode = self.mode()
        if mode == "fixed":
            return int(self.spec) if self.spec.isdigit() else 1  # moc's own: every iteration
        cost = (
            statistics.median(self.stalls[-3:])
            if self.stalls
            else checkpoint_cost(snapshot_bytes, bandwidth, overlap_s)
        )
        if mode == "oracle":
            return oracle_interval(cost, overlap_s, 0.0, self.mtbf_iters * overlap_s)
        return checkfreq_interval(cost, 0.0, overlap_s)

    def scheduled(self, iteration: int, interval: int) -> None:
        """A checkpoint is taken at `iteration`; the next one `interval` iterations later."""
        self.interval, self.next_due = interval, iteration + interval

    def observe_stall(self, seconds: float) -> None:
        self.stalls.append(seconds)

    def rolled_back(self, iteration: int) -> None:
        """Training resumes at `iteration`, whose state is the restored checkpoint's."""
        self.next_due = iteration + self.interval
