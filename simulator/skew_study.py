"""Figure 16 in the simulator: expert-popularity skew S (Appendix D's Dirichlet alpha) against ETTR.

DeepSeek-MoE on the testbed at a 10-minute MTBF over 12 hours. Skew enters two mechanisms: the
FLOPs MoEvement's frozen operators skip during conversion (popular experts, deferred by
reordering, stay frozen longest: `simulator.frozen`), and the expert updates MoC loses per
failure (round-robin staleness weighted by token share: `simulator.skew`), hence when Dynamic-K
escalates. CheckFreq and Gemini checkpoint every expert and do not see the skew.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.calibrated import Calibration
from simulator.model import run_all
from simulator.setting import Setting
from simulator.skew import alpha_for_skew, measured_skew, popularity

SKEWS = (0.0, 0.25, 0.50, 0.75, 0.99)


@dataclass(frozen=True)
class SkewRow:
    skew: float
    alpha: float | None
    drawn_skew: float
    ettr: dict[str, float]
    moc_plt: float
    moc_fraction: float


def skew_study(s: Setting, cal: Calibration, mtbf_s: float = 600.0, skews=SKEWS) -> list[SkewRow]:
    layers = max(1, sum(1 for o in s.operators if o.expert is not None and o.expert[1] == 0))
    rows = []
    for skew in skews:
        alpha = alpha_for_skew(skew, s.experts) if skew > 0 else None
        shares = popularity(alpha, s.experts, layers)
        res = run_all(s, cal, mtbf_s, shares)
        moc = res["moc"]
        rows.append(
            SkewRow(skew, alpha, measured_skew(shares), {k: r.ettr for k, r in res.items()}, moc.plt, moc.moc_fraction)
        )
    return rows
