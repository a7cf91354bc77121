"""Our own Table 4: the simulator's mechanisms fed with primitives measured on this machine, against the
ETTR measured there.

Source: docs/benchmarks.md, "Real deaths, seeds 1 and 3, grouped-GEMM experts: measured 2026-11-25 at
commit f30faf3" (`python -m benchmarks.ettr --config train_configs/bench_moe.toml --mtbf-iters 100
--steps 100 --dense-snapshot-iters 3 --training.mixed_precision bf16 --checkpoint.slots bytes`, pp=2,
two real deaths per run). Primitives taken from that record: the references' mean iteration time,
the snapshot cap (a dense snapshot of a stage takes 3 iterations), each strategy's restart and
checkpoint-read seconds per failure (its `restart`, `fetch`, `resume` columns over 2 failures) and
MoEvement's seconds per replayed stage iteration ((convert + catch-up) / iterations replayed).
Nothing else is measured: MoEvement's window comes from Algorithm 1 at the cap, Gemini's interval
from its oracle at the MTBF, MoC's stall from its first K (1 of bench_moe's 32 experts; expert share
0.841 of the parameters, from `python train.py --config train_configs/bench_moe.toml --dry-run`),
and each failure replays or recomputes the expected, not the drawn, number of iterations.
Finite run: ETTR = steps T / (steps T (1 + o) + F R).
"""

from __future__ import annotations

from dataclasses import dataclass

from baselines.intervals import oracle_interval
from moevement.checkpoint.schedule import find_window_size

STEPS, FAILURES, MTBF_ITERS, DENSE_SNAPSHOT_ITERS = 100, 2, 100, 3
BENCH_MOE_EXPERT_SHARE, BENCH_MOE_EXPERTS, MOC_FIRST_K = 0.841, 32, 1
OPERATORS = 64  # Algorithm 1 on equal operators: the window depends on the byte ratio only


@dataclass(frozen=True)
class Recorded:
    """One benchmark run's primitives (seconds) and its measured ETTR."""

    seed: int
    strategy: str
    iteration_s: float
    restart_s: float  # per failure
    fetch_s: float  # per failure
    replay_iter_s: float  # MoEvement: one stage's replayed iteration; else 0
    measured_ettr: float


RECORDED = (
    Recorded(1, "moevement", 2.931, (11.9 + 1.3) / 2, 0.7 / 2, (19.2 + 10.5) / 18, 0.848),
    Recorded(1, "moc", 2.931, 7.8 / 2, 9.4 / 2, 0.0, 0.854),
    Recorded(1, "gemini", 2.931, 8.2 / 2, 1.0 / 2, 0.0, 0.621),
    Recorded(3, "moevement", 3.033, (10.1 + 1.3) / 2, 1.2 / 2, (18.8 + 13.1) / 21, 0.819),
    Recorded(3, "moc", 3.033, 8.3 / 2, 9.1 / 2, 0.0, 0.885),
)


def moevement_window() -> int:
    """Algorithm 1 with equal operators when a dense (12 B/param) snapshot takes 3 iterations."""
    fp32, compute = [12.0] * OPERATORS, [2.0] * OPERATORS
    return find_window_size(fp32, compute, 1.0, sum(fp32) / DENSE_SNAPSHOT_ITERS)[0]


def predicted(r: Recorded) -> tuple[float, float, float]:
    """(overhead, seconds lost per failure, finite-run ETTR) of `r`'s strategy from its primitives."""
    t, fixed = r.iteration_s, r.restart_s + r.fetch_s
    if r.strategy == "moevement":
        w = moevement_window()
        overhead, recovery = 0.0, fixed + (w + (w - 1) / 2) * r.replay_iter_s + t / 2
    elif r.strategy == "gemini":
        stall = (DENSE_SNAPSHOT_ITERS - 1) * t
        k = oracle_interval(stall, t, fixed, MTBF_ITERS * t)
        overhead, recovery = stall / (k * t), fixed + (k / 2 + 1) * t
    else:
        share = 1 - BENCH_MOE_EXPERT_SHARE + BENCH_MOE_EXPERT_SHARE * MOC_FIRST_K / BENCH_MOE_EXPERTS
        overhead, recovery = max(0.0, DENSE_SNAPSHOT_ITERS * share - 1), fixed + 1.5 * t
    useful = STEPS * t
    return overhead, recovery, useful / (useful * (1 + overhead) + FAILURES * recovery)
