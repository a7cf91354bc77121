"""Figure 13 in the simulator: MoEvement's techniques added one at a time (DeepSeek-MoE on the testbed).

Steps (cumulative): sparse checkpointing alone (Algorithm 1's window; recovery a global restart and
a rollback of every stage, with the pipeline bubble, through W conversion and (W - 1) / 2 catch-up
iterations); + frozen operators skipping their weight gradient; + popularity reordering (Appendix
D's skew, `skew`); + upstream logging (localized recovery: a local restart; the replay is §3.6's
whole iterations in every step).
Each step's finite-run ETTR over 12 hours at the given MTBF.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.calibrated import Calibration
from simulator.frozen import Ablation
from simulator.mechanisms import moevement_cost
from simulator.run import finite
from simulator.setting import Setting
from simulator.skew import alpha_for_skew, popularity

STEPS = (
    ("sparse checkpointing", Ablation(skip_bweight=False, reorder=False, localized=False)),
    ("+ skip B_weight when frozen", Ablation(skip_bweight=True, reorder=False, localized=False)),
    ("+ popularity reordering", Ablation(skip_bweight=True, reorder=True, localized=False)),
    ("+ upstream logging", Ablation(skip_bweight=True, reorder=True, localized=True)),
)


@dataclass(frozen=True)
class AblationRow:
    step: str
    ettr: float
    recovery_s: float  # per failure
    window: int


def ablation(s: Setting, cal: Calibration, mtbf_s: float, skew: float) -> list[AblationRow]:
    """Figure 13's four steps on `s` at expert-popularity skew `skew` (0: uniform)."""
    layers = max(1, sum(1 for o in s.operators if o.expert is not None and o.expert[1] == 0))
    shares = popularity(alpha_for_skew(skew, s.experts) if skew > 0 else None, s.experts, layers)
    rows = []
    for name, steps in STEPS:
        cost = moevement_cost(s, cal, shares, steps)
        rows.append(AblationRow(name, finite(cost, mtbf_s).ettr, cost.recovery_s, cost.window))
    return rows
