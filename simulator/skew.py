"""Expert-popularity skew (Appendix D): Dirichlet(alpha) token shares and the skew S they give.

    E[HHI] = (alpha + 1) / (alpha E + 1),   S = (HHI - 1/E) / (1 - 1/E)

`popularity` draws one share vector per MoE layer (seeded, so every run of the simulator sees the
same draw); alpha = None means uniform shares. Tiny alphas (S = 0.99 needs 1.6e-4) are drawn in log
space: Gamma(a) = Gamma(a + 1) U^(1/a).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def expected_skew(alpha: float, experts: int) -> float:
    """Appendix D's E[S] for a symmetric Dirichlet(alpha) over `experts` experts."""
    hhi = (alpha + 1) / (alpha * experts + 1)
    return (hhi - 1 / experts) / (1 - 1 / experts)


def alpha_for_skew(skew: float, experts: int) -> float:
    """The alpha whose E[S] is `skew` (0 < skew < 1): E[S] inverted."""
    hhi = skew * (1 - 1 / experts) + 1 / experts
    return (1 - hhi) / (hhi * experts - 1)


def _dirichlet(alpha: float, n: int, rng: random.Random) -> list[float]:
    logs = [math.log(rng.gammavariate(alpha + 1, 1.0)) + math.log(1.0 - rng.random()) / alpha for _ in range(n)]
    top = max(logs)
    weights = [math.exp(v - top) for v in logs]
    total = sum(weights)
    return [w / total for w in weights]


def popularity(alpha: float | None, experts: int, layers: int, seed: int = 0) -> list[list[float]]:
    """Token shares per MoE layer (each sums to 1): uniform when `alpha` is None."""
    if alpha is None:
        return [[1 / experts] * experts for _ in range(layers)]
    rng = random.Random(seed)
    return [_dirichlet(alpha, experts, rng) for _ in range(layers)]


def measured_skew(shares: Sequence[Sequence[float]]) -> float:
    """Mean S over layers of drawn shares."""
    out = []
    for p in shares:
        e = len(p)
        out.append((sum(x * x for x in p) - 1 / e) / (1 - 1 / e))
    return sum(out) / len(out)


def round_robin_staleness(shares: Sequence[float], period: int, phase: int) -> float:
    """Iterations of one layer's expert updates lost when its round-robin checkpoint (expert e saved
    at iterations = e mod period) is restored at `phase`: sum of share x iterations since its save."""
    return sum(p * ((phase - e) % period) for e, p in enumerate(shares))
