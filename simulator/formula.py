"""The paper's ETTR model (Appendix C): checkpoint overhead and expected loss per failure.

    ETTR = 1 / (1 + T_ckpt / (T_iter * k)) * 1 / (1 + E[R] / MTBF)

The first factor is the overhead o of a T_ckpt-second stall every k iterations; the second charges
each failure E[R] seconds per MTBF seconds of useful work. For an interval-based strategy the
paper's E[R] is half an interval of iterations; here E[R] = fixed + (k / 2 + 1) T, one iteration
more: the aborted iteration (T / 2 on average) and the newest checkpoint being usable only once
its iteration has finished (T / 2). `fixed` is restart + load.
"""

from __future__ import annotations

import math

NO_FAILURE_INTERVAL = 10**6  # "never" for a checkpoint that costs something when nothing fails


def paper_ettr(overhead: float, recovery_s: float, mtbf_s: float) -> float:
    """1 / (1 + o) * 1 / (1 + E[R] / MTBF); MTBF = inf (no failures) gives 1 / (1 + o)."""
    if math.isinf(mtbf_s):
        return 1.0 / (1.0 + overhead)
    return 1.0 / ((1.0 + overhead) * (1.0 + recovery_s / mtbf_s))


def interval_ettr(k: int, stall_s: float, iteration_s: float, fixed_s: float, mtbf_s: float) -> float:
    """ETTR of a checkpoint every k iterations: o = stall / (k T), E[R] = fixed + (k / 2 + 1) T."""
    return paper_ettr(stall_s / (k * iteration_s), fixed_s + (k / 2 + 1) * iteration_s, mtbf_s)


def best_interval(stall_s: float, iteration_s: float, fixed_s: float, mtbf_s: float) -> int:
    """The k >= 1 maximising `interval_ettr` (Gemini's ETTR-optimal interval).

    With x = k T, a = stall, c = 1 + (fixed + T) / MTBF and d = 1 / (2 MTBF), ETTR =
    x / ((x + a)(c + d x)); its derivative vanishes only at x* = sqrt(a c / d), so the best integer
    is the floor or the ceiling of x* / T.
    """
    if stall_s <= 0:
        return 1
    if math.isinf(mtbf_s):
        return NO_FAILURE_INTERVAL
    x = math.sqrt(stall_s * (1 + (fixed_s + iteration_s) / mtbf_s) * 2 * mtbf_s)
    candidates = {max(1, math.floor(x / iteration_s)), max(1, math.ceil(x / iteration_s))}
    return max(sorted(candidates), key=lambda k: interval_ettr(k, stall_s, iteration_s, fixed_s, mtbf_s))
