"""Where every rank of the job sits, as recovery needs it (gathered once at start-up by the trainer)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RankLayout:
    """Per rank: pipeline rank, data-parallel rank and node; per pipeline rank: the stages it runs."""

    pp_of: list[int]
    dp_of: list[int]
    node_of: list[int]
    stages_of_pp: list[list[int]]

    @property
    def n_stages(self) -> int:
        return sum(len(stages) for stages in self.stages_of_pp)

    @property
    def dp_size(self) -> int:
        return max(self.dp_of) + 1

    def rank_of(self, pp_rank: int, dp_rank: int) -> int:
        return next(r for r, (p, d) in enumerate(zip(self.pp_of, self.dp_of)) if p == pp_rank and d == dp_rank)

    def owner_pp(self, stage: int) -> int:
        return next(p for p, stages in enumerate(self.stages_of_pp) if stage in stages)

    def stages_of(self, pp_ranks: set[int]) -> set[int]:
        return {s for p in pp_ranks for s in self.stages_of_pp[p]}
