"""Where every rank of the job sits, and where its snapshots' replicas go (gathered once at start-up)."""

from __future__ import annotations

from dataclasses import dataclass, field


def peer_map(world: int, replicas: int, stage_of: list[int], node_of: list[int]) -> list[list[int]]:
    """peers[rank]: the ranks holding `rank`'s replicas, in fetch order (every rank computes the same map).

    Rank by rank, each takes `replicas` peers: of another pipeline stage first (a stage's recovery then
    finds its replicas outside the stage), then of another node, then the peers holding the fewest
    replicas so far, then the nearest after it. The load term spreads the replicas evenly (`replicas` per
    rank when the preferred peers are as many as the ranks choosing them): by distance alone, every rank
    of a stage would put its replicas on the same first ranks of the next one."""
    held = [0] * world
    peers = []
    for rank in range(world):
        others = [c for c in range(world) if c != rank]
        others.sort(
            key=lambda c: (stage_of[c] == stage_of[rank], node_of[c] == node_of[rank], held[c], (c - rank) % world)
        )
        chosen = others[: min(replicas, world - 1)]
        for c in chosen:
            held[c] += 1
        peers.append(chosen)
    return peers


@dataclass
class Topology:
    """This rank, and per rank: pipeline rank, data-parallel rank and node; per pipeline rank: its stages."""

    rank: int
    pp_of: list[int]
    dp_of: list[int]
    node_of: list[int]
    stages_of_pp: list[list[int]]
    _peers: dict[int, list[list[int]]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def single(cls, stages: list[int] | None = None) -> Topology:
        return cls(0, [0], [0], [0], [stages or [0]])

    @property
    def world(self) -> int:
        return len(self.pp_of)

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

    def replica_peers(self, replicas: int) -> list[list[int]]:
        """peers[r]: the ranks holding rank r's replicas, in fetch order (`peer_map`, computed once)."""
        if self.world == 1:
            return [[]]
        if replicas not in self._peers:
            self._peers[replicas] = peer_map(self.world, replicas, self.pp_of, self.node_of)
        return self._peers[replicas]

    def replica_holders(self, rank: int, replicas: int) -> list[int]:
        """The ranks holding `rank`'s replicas, in fetch order."""
        return self.replica_peers(replicas)[rank] if self.world > 1 else []
