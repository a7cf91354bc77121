"""Recovery from memory under node losses (moevement/placement_probability.py) against brute-force enumeration
of every set of lost nodes, and what `peer_map`'s placement guarantees: any `replicas` node losses survived
when there are enough nodes, and the most probable recovery beyond (Lazarus's maximum overlap)."""

from fractions import Fraction
from itertools import combinations
from math import comb

import pytest

from moevement import placement_probability
from moevement.placement_probability import always_survived, recovery_probabilities
from moevement.topology import peer_map

# name: (world, replicas, pipeline ranks, ranks per node); ranks laid out as parallelisms.mesh lays them
SHAPES = {
    "4-nodes-r1": (16, 1, 2, 4),
    "5-nodes-r2": (20, 2, 1, 4),
    "6-nodes-r2-pp2": (24, 2, 2, 4),
    "7-nodes-r2-pp7": (14, 2, 7, 2),
    "8-nodes-r2-pp4": (64, 2, 4, 8),
    "8-nodes-r3-pp4": (32, 3, 4, 4),
    "3-nodes-r2-uneven": (20, 2, 2, 8),
    "2-nodes-r2": (16, 2, 4, 8),
    "3-nodes-r4": (12, 4, 1, 4),
}


def layout(world: int, pp: int, per_node: int) -> tuple[list[int], list[int]]:
    dp = world // pp
    return [r // dp for r in range(world)], [r // per_node for r in range(world)]


def brute_force(peers: list[list[int]], node_of: list[int], lost: int) -> Fraction:
    """Every `lost`-subset of the nodes, and per rank whether one of its copies' nodes is outside it."""
    nodes = sorted(set(node_of))
    copies = [{node_of[r], *(node_of[p] for p in held_by)} for r, held_by in enumerate(peers)]
    subsets = list(combinations(nodes, lost))
    survived = sum(1 for gone in subsets if all(c - set(gone) for c in copies))
    return Fraction(survived, len(subsets))


def random_peers(world: int, replicas: int, seed: int) -> list[list[int]]:
    """A placement with no structure (to check the counting on placements peer_map never makes)."""
    import random

    rng = random.Random(seed)
    return [rng.sample([c for c in range(world) if c != r], replicas) for r in range(world)]


def placed(shape: str) -> tuple[list[list[int]], list[int], int, int]:
    """(peer map, node of each rank, replicas, nodes) of one of SHAPES as `peer_map` places it."""
    world, replicas, pp, per_node = SHAPES[shape]
    stage_of, node_of = layout(world, pp, per_node)
    return peer_map(world, replicas, stage_of, node_of), node_of, replicas, len(set(node_of))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_exact_probabilities_match_brute_force_on_peer_map(shape):
    peers, node_of, _, n = placed(shape)
    exact = recovery_probabilities(peers, node_of, list(range(0, n + 2)))
    assert sorted(exact) == list(range(1, n + 1))
    assert exact == {k: brute_force(peers, node_of, k) for k in range(1, n + 1)}


@pytest.mark.parametrize("seed", range(6))
def test_exact_probabilities_match_brute_force_on_unstructured_placements(seed):
    per_node = 1 + seed % 3
    world, replicas = 6 * per_node, 1 + seed % 2
    node_of = [r // per_node for r in range(world)]
    peers = random_peers(world, replicas, seed)
    assert recovery_probabilities(peers, node_of, list(range(1, 7))) == {
        k: brute_force(peers, node_of, k) for k in range(1, 7)
    }


def test_inclusion_exclusion_matches_enumeration(monkeypatch):
    world, per_node = 24, 2  # 12 nodes, random replicas: one connected component
    node_of = [r // per_node for r in range(world)]
    peers = random_peers(world, 1, seed=7)
    enumerated = recovery_probabilities(peers, node_of, [1, 2, 3, 4, 5])
    monkeypatch.setattr(placement_probability, "ENUMERATED_NODES", 0)
    assert recovery_probabilities(peers, node_of, [1, 2, 3, 4, 5]) == enumerated
    assert enumerated == {k: brute_force(peers, node_of, k) for k in range(1, 6)}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_any_replicas_node_losses_leave_every_rank_a_copy_when_nodes_suffice(shape):
    peers, node_of, replicas, n = placed(shape)
    guaranteed = min(replicas, n - 1)
    for r, held_by in enumerate(peers):  # distinct other nodes first
        nodes = [node_of[p] for p in held_by[:guaranteed]]
        assert node_of[r] not in nodes and len(set(nodes)) == guaranteed, (r, held_by)
    assert always_survived(peers, node_of) == guaranteed
    assert all(brute_force(peers, node_of, k) == 1 for k in range(1, guaranteed + 1))


def test_maximum_overlap_beats_an_even_spread_without_it():
    """6 nodes, 2 replicas: two disjoint groups of 3 nodes lose a rank in 2 of the 20 triples of lost nodes;
    the ring over all 6 (also even, also on 3 distinct nodes) in 6 of them."""
    world, replicas, per_node = 24, 2, 4
    stage_of, node_of = layout(world, 1, per_node)
    peers = peer_map(world, replicas, stage_of, node_of)
    assert recovery_probabilities(peers, node_of, [3])[3] == 1 - Fraction(2, comb(6, 3))
    ring = [[(r + per_node) % world, (r + 2 * per_node) % world] for r in range(world)]
    assert brute_force(ring, node_of, 3) == 1 - Fraction(6, comb(6, 3))
    for k in range(3, 6):
        assert brute_force(peers, node_of, k) >= brute_force(ring, node_of, k)


def test_large_cluster_is_counted_exactly_and_quickly():
    world, replicas, per_node = 4096, 2, 8  # 512 nodes
    stage_of, node_of = layout(world, 8, per_node)
    peers = peer_map(world, replicas, stage_of, node_of)
    probs = recovery_probabilities(peers, node_of, [1, 2, 3])
    assert probs[1] == probs[2] == 1
    rings = 512 // 3 - 1 + (3 + 512 % 3)  # 169 rings of 3 nodes, one of 5: a set each, and 5 sets
    assert probs[3] == 1 - Fraction(rings, comb(512, 3))


def test_dry_run_line_names_the_placement_and_its_odds():
    from trainer.config import load_config
    from trainer.estimates.placement_report import line

    layout_args = ["--parallelism.pp", "4", "--parallelism.ep", "4", "--checkpoint.strategy", "moevement"]
    two_nodes = load_config("train_configs/deepseek_moe_16b.toml", [*layout_args, "--parallelism.dp", "4"])
    text = line(two_nodes)
    assert "ranks=16 nodes=2 " in text and "replicas=2 node_rings=1x2" in text, text
    assert "no, any 1 (2 node(s) for 3 copies)" in text and "k=1:1 k=2:0 k=3:n/a" in text, text
    eight_nodes = load_config("train_configs/deepseek_moe_16b.toml", [*layout_args, "--parallelism.dp", "16"])
    text = line(eight_nodes)
    assert "nodes=8 " in text and "in memory: yes;" in text and "k=1:1 k=2:1 k=3:0.8571" in text, text
