"""Gemini's oracle interval under the run model's own ETTR (`simulator.run`): the k maximising

    g(k) = exp(-(fixed + (k / 2 + 1) T) / MTBF) / (1 + stall / (k T))

(Poisson failures over the whole run, recovery included). ln g has derivative
a / (k (k + a)) - c with a = stall / T and c = T / (2 MTBF), zero at k* = (-a + sqrt(a^2 + 4 a / c)) / 2;
g is unimodal, so the best integer is the floor or the ceiling of k*.
"""

from __future__ import annotations

import math

NO_FAILURE_INTERVAL = 10**6  # "never" for a checkpoint that costs something when nothing fails


def poisson_ettr(k: int, stall_s: float, iteration_s: float, fixed_s: float, mtbf_s: float) -> float:
    """ETTR of a checkpoint every k iterations under Poisson failures (no failure-independent loss)."""
    useful = 1.0 if math.isinf(mtbf_s) else math.exp(-(fixed_s + (k / 2 + 1) * iteration_s) / mtbf_s)
    return useful / (1 + stall_s / (k * iteration_s))


def oracle_interval(stall_s: float, iteration_s: float, fixed_s: float, mtbf_s: float) -> int:
    """The k >= 1 maximising `poisson_ettr`."""
    if stall_s <= 0:
        return 1
    if math.isinf(mtbf_s):
        return NO_FAILURE_INTERVAL
    a, c = stall_s / iteration_s, iteration_s / (2 * mtbf_s)
    x = (-a + math.sqrt(a * a + 4 * a / c)) / 2
    candidates = sorted({max(1, math.floor(x)), max(1, math.ceil(x))})
    return max(candidates, key=lambda k: poisson_ettr(k, stall_s, iteration_s, fixed_s, mtbf_s))
