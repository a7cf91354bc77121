"""How likely simultaneous node losses leave every rank's newest window in memory, under a replica placement.

A rank's newest window lies on its own node and on its replica peers' nodes (`moevement.topology`
`peer_map`); it is recoverable from memory when one of those nodes survives, else only from
`checkpoint.persist_dir`. With k of the n nodes lost, every k-subset equally likely, the job recovers from
memory when no rank has all its copies inside the lost set. Exact: a ranks' node set that contains another's
adds no failure combination (only minimal sets count), sets sharing no node fail independently (connected
components of the sets multiply as generating functions), and a component counts its surviving subsets by
enumeration when small, by inclusion-exclusion over its sets otherwise.
"""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations
from math import comb

ENUMERATED_NODES = 16  # a component of at most this many nodes counts its subsets one by one
INCLUSION_EXCLUSION_TERMS = 1_000_000  # the most terms inclusion-exclusion may take on one component


def copy_node_sets(peers: list[list[int]], node_of: list[int]) -> list[frozenset[int]]:
    """Per rank: the nodes holding its newest window (its own and its replica peers')."""
    return [frozenset([node_of[rank], *(node_of[p] for p in held_by)]) for rank, held_by in enumerate(peers)]


def minimal_sets(sets: list[frozenset[int]]) -> list[frozenset[int]]:
    """The distinct sets of `sets` containing no other one (a superset is lost only when its subset is)."""
    out: list[frozenset[int]] = []
    for s in sorted(set(sets), key=len):
        if not any(m <= s for m in out):
            out.append(s)
    return out


def components(nodes: list[int], sets: list[frozenset[int]]) -> list[tuple[list[int], list[frozenset[int]]]]:
    """`nodes` and `sets` split into groups sharing no node: [(its nodes, its sets)] (a node in no set: alone)."""
    parent = {n: n for n in nodes}

    def root(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for s in sets:
        first, *rest = s
        for n in rest:
            parent[root(n)] = root(first)
    groups: dict[int, tuple[list[int], list[frozenset[int]]]] = {}
    for n in nodes:
        groups.setdefault(root(n), ([], []))[0].append(n)
    for s in sets:
        groups[root(next(iter(s)))][1].append(s)
    return list(groups.values())


def surviving_by_enumeration(nodes: list[int], sets: list[frozenset[int]], up_to: int) -> list[int]:
    """good[j], j = 0..up_to: the j-subsets of `nodes` containing none of `sets` (one by one)."""
    index = {n: i for i, n in enumerate(nodes)}
    masks = [sum(1 << index[n] for n in s) for s in sets]
    good = []
    for j in range(up_to + 1):
        lost_sets = (sum(1 << i for i in picked) for picked in combinations(range(len(nodes)), j))
        good.append(sum(1 for lost in lost_sets if not any(lost & m == m for m in masks)))
    return good


def surviving_by_inclusion_exclusion(nodes: list[int], sets: list[frozenset[int]], up_to: int) -> list[int]:
    """good[j], j = 0..up_to, by inclusion-exclusion over families of `sets` whose union has at most `up_to`
    nodes (a larger union fits in no j-subset). Raises ValueError past INCLUSION_EXCLUSION_TERMS terms."""
    lost = [0] * (up_to + 1)  # j-subsets containing one of the sets
    terms = 0
    ordered = [s for s in sets if len(s) <= up_to]
    stack: list[tuple[int, frozenset[int], int]] = [(i, ordered[i], 1) for i in range(len(ordered))]
    while stack:
        last, union, size = stack.pop()
        terms += 1
        if terms > INCLUSION_EXCLUSION_TERMS:
            raise ValueError(f"more than {INCLUSION_EXCLUSION_TERMS} inclusion-exclusion terms")
        sign = 1 if size % 2 else -1
        for j in range(len(union), up_to + 1):
            lost[j] += sign * comb(len(nodes) - len(union), j - len(union))
        for nxt in range(last + 1, len(ordered)):
            wider = union | ordered[nxt]
            if len(wider) <= up_to:
                stack.append((nxt, wider, size + 1))
    return [comb(len(nodes), j) - lost[j] for j in range(up_to + 1)]


def surviving_subsets(node_sets: list[frozenset[int]], nodes: list[int], up_to: int) -> list[int]:
    """good[j], j = 0..up_to: the j-subsets of `nodes` that contain none of `node_sets` (exact)."""
    good = [1] + [0] * up_to
    for comp_nodes, comp_sets in components(nodes, minimal_sets(node_sets)):
        top = min(up_to, len(comp_nodes))
        if len(comp_nodes) <= ENUMERATED_NODES:
            part = surviving_by_enumeration(comp_nodes, comp_sets, top)
        else:
            part = surviving_by_inclusion_exclusion(comp_nodes, comp_sets, top)
        good = [sum(good[i] * part[j - i] for i in range(max(0, j - top), j + 1)) for j in range(up_to + 1)]
    return good


def recovery_probabilities(peers: list[list[int]], node_of: list[int], losses: list[int]) -> dict[int, Fraction]:
    """{k: the exact probability that losing k of the nodes at once (every k-subset of the nodes in `node_of`
    equally likely) leaves every rank a copy of its newest window in memory}, for each k in `losses` with
    1 <= k <= the number of nodes (others are left out)."""
    nodes = sorted(set(node_of))
    wanted = [k for k in losses if 1 <= k <= len(nodes)]
    if not wanted:
        return {}
    good = surviving_subsets(copy_node_sets(peers, node_of), nodes, max(wanted))
    return {k: Fraction(good[k], comb(len(nodes), k)) for k in wanted}


def always_survived(peers: list[list[int]], node_of: list[int]) -> int:
    """The most simultaneous node losses that always leave every rank a copy in memory (one fewer than the
    fewest nodes any rank's copies lie on)."""
    return min(len(s) for s in copy_node_sets(peers, node_of)) - 1
