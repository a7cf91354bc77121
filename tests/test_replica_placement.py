"""Where replicas go (moevement/topology.py `peer_map`): outside the stage and the node when possible, on
distinct nodes (any `replicas` node losses leave a copy when there are more nodes than that), and evenly, so
that no rank holds the snapshots of a whole stage (nothing proportional to the model on one rank)."""

from collections import Counter

import pytest

from moevement.topology import peer_map

LAYOUTS = {  # name: (world, replicas, pipeline rank of each rank, node of each rank)
    "pp4-dp16-8-per-node": (64, 2, [r // 16 for r in range(64)], [r // 8 for r in range(64)]),
    "pp1-dp16-two-nodes": (16, 1, [0] * 16, [r // 8 for r in range(16)]),
    "pp4-dp2-one-node": (8, 2, [r // 2 for r in range(8)], [0] * 8),
    "pp2-one-rank-each": (2, 1, [0, 1], [0, 0]),
    "pp4-dp4-two-nodes": (16, 2, [r // 4 for r in range(16)], [r // 8 for r in range(16)]),
    "pp4-dp16-8-per-node-3-replicas": (64, 3, [r // 16 for r in range(64)], [r // 8 for r in range(64)]),
    "pp16-dp256-8-per-node": (4096, 2, [r // 256 for r in range(4096)], [r // 8 for r in range(4096)]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replicas_spread_evenly_outside_the_stage_and_the_node(layout):
    world, replicas, stage_of, node_of = LAYOUTS[layout]
    peers = peer_map(world, replicas, stage_of, node_of)
    assert all(len(p) == replicas and len(set(p)) == replicas and r not in p for r, p in enumerate(peers))
    held = Counter(h for p in peers for h in p)
    assert [held[r] for r in range(world)] == [replicas] * world, held
    stages, nodes = len(set(stage_of)), len(set(node_of))
    distinct = min(replicas, nodes - 1)  # the first peers on that many distinct other nodes
    for r, p in enumerate(peers):
        assert stages == 1 or all(stage_of[h] != stage_of[r] for h in p), (r, p)
        assert nodes == 1 or all(node_of[h] != node_of[r] for h in p), (r, p)
        assert len({node_of[h] for h in p[:distinct]}) == distinct, (r, p)
