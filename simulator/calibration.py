"""A benchmark's measured costs (`profile.json`, `python -m simulator --profile`) through the model's failure law.

A finite run (steps iterations of T s, F failures each costing R s, checkpointing stretching each
iteration by a fraction o) has wall = steps T (1 + o) + F R and ETTR = steps T / wall =
1 / (1 + o) * (1 - F R / wall) (`simulator.run.scheduled_ettr`, the law `simulator.measured` applies to
the benchmark's rows): it checks the law on measured costs, not the mechanisms, which
`simulator.measured.predict` runs on the same run's primitives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from baselines.intervals import ettr
from simulator.mechanisms import Cost
from simulator.run import scheduled_ettr


@dataclass(frozen=True)
class MeasuredStrategy:
    overhead: float  # measured checkpoint overhead, fraction of the fault-free iteration
    recovery_s: float  # mean seconds lost per failure (recovery + recomputation)
    failures: int


@dataclass(frozen=True)
class MeasuredProfile:
    """A benchmark run on this machine: {"iteration_s", "mtbf_s", "steps", "strategies": {name: {...}}}.

    `iteration_s` is the fault-free iteration time of `none`; each strategy has `overhead`,
    `recovery_s` and `failures` (see `MeasuredStrategy`).
    """

    iteration_s: float
    mtbf_s: float
    steps: int
    strategies: dict[str, MeasuredStrategy]

    @classmethod
    def from_json(cls, data: str | dict[str, Any]) -> MeasuredProfile:
        d = json.loads(data) if isinstance(data, str) else data
        try:
            strategies = {
                name: MeasuredStrategy(float(s["overhead"]), float(s["recovery_s"]), int(s["failures"]))
                for name, s in d["strategies"].items()
            }
            return cls(float(d["iteration_s"]), float(d["mtbf_s"]), int(d["steps"]), strategies)
        except KeyError as err:
            raise ValueError(f"profile: missing key {err}") from None

    def finite_ettr(self, name: str) -> float:
        """ETTR over the measured run: 1/(1+o) * (1 - F R / wall), wall = steps T (1+o) + F R."""
        s = self.strategies[name]
        return scheduled_ettr(Cost(name, s.overhead, s.recovery_s), s.failures, self.steps * self.iteration_s)

    def steady_ettr(self, name: str) -> float:
        """The MTBF-based steady-state ETTR 1/(1+o) * (1 - R/MTBF) with the measured overhead and recovery."""
        s = self.strategies[name]
        return ettr(s.overhead, s.recovery_s, self.mtbf_s)


def predict_from_profile(profile: dict[str, Any] | MeasuredProfile) -> dict[str, float]:
    """Finite-run ETTR per strategy of a measured profile (see `MeasuredProfile.finite_ettr`)."""
    p = profile if isinstance(profile, MeasuredProfile) else MeasuredProfile.from_json(profile)
    return {name: p.finite_ettr(name) for name in p.strategies}
