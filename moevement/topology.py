"""Where every rank of the job sits, and where its snapshots' replicas go (gathered once at start-up)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate


def nodes_in_order(node_of: list[int]) -> dict[int, list[int]]:
    """{node: its ranks, ascending}, the nodes in the order of their first rank."""
    ranks: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of):
        ranks.setdefault(node, []).append(rank)
    return ranks


def interleaved_by_stages(nodes: dict[int, list[int]], stage_of: list[int]) -> list[int]:
    """The nodes, one of each group of nodes running the same pipeline stages in turn (nodes 0 1 | 2 3 | 4 5
    running stages 0 | 1 | 2: 0 2 4 1 3 5), so that neighbours in this order run other stages."""
    groups: dict[frozenset[int], list[int]] = {}
    for node, ranks in nodes.items():
        groups.setdefault(frozenset(stage_of[r] for r in ranks), []).append(node)
    longest = max(len(g) for g in groups.values())
    return [g[i] for i in range(longest) for g in groups.values() if i < len(g)]


def cut(order: list[int], sizes: list[int]) -> list[list[int]]:
    """`order` cut into consecutive pieces of `sizes`."""
    ends = list(accumulate(sizes))
    return [order[end - n : end] for end, n in zip(ends, sizes)]


def ring_targets(ring: list[int], replicas: int) -> dict[int, list[int]]:
    """{node: the nodes its ranks' replicas go to, in fetch order}: the `replicas` nodes after it in `ring`,
    cycling past it when the ring is shorter (its own node when alone)."""
    if len(ring) == 1:
        return {ring[0]: ring * replicas}
    after = len(ring) - 1
    return {node: [ring[(i + 1 + j % after) % len(ring)] for j in range(replicas)] for i, node in enumerate(ring)}


def forced_same_stage(ranks: list[int], target_stages: set[int], stage_of: list[int]) -> int:
    """How many of `ranks` can only find a replica peer of their own stage on a node running `target_stages`."""
    return sum(1 for r in ranks if target_stages == {stage_of[r]})


def node_sets_of(rings: list[list[int]], replicas: int) -> int:
    """How many distinct node sets the ranks' copies lie on under `rings` (one per ring of replicas + 1 nodes
    or fewer: all its nodes hold every copy; else one per node of the ring)."""
    return sum(1 if len(ring) <= replicas + 1 else len(ring) for ring in rings)


def replica_rings(replicas: int, stage_of: list[int], node_of: list[int]) -> list[list[int]]:
    """The nodes cut into disjoint rings: a rank's replicas go to the `replicas` nodes after its own in its
    ring (`ring_targets`), so its copies lie on min(replicas + 1, nodes) distinct nodes and any that many
    minus one simultaneous node losses leave one of them.

    Lazarus's maximum overlap (§4): a ring of exactly replicas + 1 nodes gives all its ranks one node set, the
    fewest failure combinations that lose a rank. When the nodes do not divide into such rings, the remainder
    is merged into one ring (fewest node sets) or spread over the rings; the rings take the nodes interleaved
    by stage (`interleaved_by_stages`), so that replicas go to other stages. Chosen: the candidate forcing the
    fewest same-stage replicas, then the fewest distinct node sets (`node_sets_of`)."""
    nodes = nodes_in_order(node_of)
    size = min(replicas + 1, len(nodes))
    order = interleaved_by_stages(nodes, stage_of)
    count, extra = divmod(len(order), size)
    merged = [size] * (count - 1) + [size + extra]
    spread = [size + extra // count + (i < extra % count) for i in range(count)]
    stages = {n: {stage_of[r] for r in ranks} for n, ranks in nodes.items()}
    several_stages = len(set(stage_of)) > 1

    def score(rings: list[list[int]]) -> tuple[int, int]:
        clashes = sum(
            forced_same_stage(nodes[a], stages[b], stage_of)
            for ring in rings
            for a, targets in ring_targets(ring, replicas).items()
            for b in targets
        )
        return (clashes if several_stages else 0), node_sets_of(rings, replicas)

    return min((cut(order, merged), cut(order, spread)), key=score)


def pick_peer(rank: int, pool: list[int], chosen: list[int], held: list[int], cap: int, stage_of: list[int]) -> int:
    """The replica peer of `rank` from `pool` (a node's ranks; every rank when none of them is free), not
    `rank` nor one already chosen: one holding fewer than `cap` replicas first (the even spread: no rank
    holds a whole stage's), then of another pipeline stage (a stage's recovery then finds its replicas
    outside the stage), then holding the fewest replicas so far, then the nearest after `rank`."""
    world, stage = len(stage_of), stage_of[rank]
    best, best_key = -1, (True, True, float("inf"), world)
    for candidates in (pool, range(world)):
        for c in candidates:
            if c == rank or c in chosen:
                continue
            key = (held[c] >= cap, stage_of[c] == stage, held[c], (c - rank) % world)
            if key < best_key:
                best, best_key = c, key
        if best >= 0:
            return best
    raise ValueError(f"rank {rank}: no rank left for a replica (world {world})")


def peer_map(world: int, replicas: int, stage_of: list[int], node_of: list[int]) -> list[list[int]]:
    """peers[rank]: the ranks holding `rank`'s replicas, in fetch order (every rank computes the same map).

    A rank's replicas go to the nodes `replica_rings` assigns its node, one peer on each (`pick_peer`): on
    min(replicas, nodes - 1) distinct other nodes, so that any that many node losses leave a copy in memory
    (with fewer nodes the remaining replicas go round the other nodes again, or to the own node when alone).
    Each rank holds `replicas` ranks' replicas when nodes hold equally many ranks (no rank holds a whole
    stage's). O(world x replicas x ranks per node)."""
    replicas = min(replicas, world - 1)
    if replicas <= 0:
        return [[] for _ in range(world)]
    nodes = nodes_in_order(node_of)
    targets = {}
    for ring in replica_rings(replicas, stage_of, node_of):
        targets.update(ring_targets(ring, replicas))
    held = [0] * world
    peers = []
    for rank in range(world):
        chosen: list[int] = []
        for node in targets[node_of[rank]]:
            chosen.append(pick_peer(rank, nodes[node], chosen, held, replicas, stage_of))
            held[chosen[-1]] += 1
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
