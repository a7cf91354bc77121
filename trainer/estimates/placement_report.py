"""The dry run's replica-placement line: where `moevement.topology` puts each rank's snapshot replicas for a
config's layout, which node losses always leave every rank's newest window in memory, and how likely 1, 2 and
3 simultaneous node losses do (`moevement.placement_probability`, exact); past that, recovery reads
`checkpoint.persist_dir`. Ranks are laid out as `trainer.estimates.host_estimate` lays them (pipeline rank r // dp,
`RANKS_PER_NODE` consecutive ranks per node: no config key names it)."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

from moevement.placement_probability import always_survived, recovery_probabilities
from moevement.topology import peer_map, replica_rings
from trainer.config import Config
from trainer.estimates.host_estimate import RANKS_PER_NODE, dry_run_topology, replicas_in_memory

NODE_LOSSES = (1, 2, 3)


def probability_text(p: Fraction) -> str:
    """`p` short: 1 and 0 exactly, 1-<small> when close to one, else four decimals."""
    if p in (0, 1):
        return str(p)
    return f"1-{float(1 - p):.3g}" if 1 - p < Fraction(1, 10_000) else f"{float(p):.4f}"


def line(cfg: Config, ranks_per_node: int = RANKS_PER_NODE) -> str:
    """One line: the placement (ranks, nodes, replicas, rings of nodes), the node losses always survived in
    memory, and the recovery probability from memory for each of NODE_LOSSES nodes lost at once."""
    topo = dry_run_topology(cfg, ranks_per_node)
    world, stage_of, node_of = topo.world, topo.pp_of, topo.node_of
    nodes = len(set(node_of))
    replicas = min(replicas_in_memory(cfg), world - 1)
    peers = peer_map(world, replicas, stage_of, node_of)
    survived = always_survived(peers, node_of)
    rings = Counter(len(ring) for ring in replica_rings(replicas, stage_of, node_of)) if replicas else Counter()
    shape = " ".join(f"{count}x{size}" for size, count in sorted(rings.items())) or "none"
    guarantee = "yes" if survived >= replicas else f"no, any {survived} ({nodes} node(s) for {replicas + 1} copies)"
    if replicas == 0:
        guarantee = "no replicas in memory"
    probs = recovery_probabilities(peers, node_of, list(NODE_LOSSES))
    odds = " ".join(f"k={k}:{probability_text(probs[k])}" if k in probs else f"k={k}:n/a" for k in NODE_LOSSES)
    fallback = cfg.checkpoint.persist_dir or "unset: none"
    return (
        f"replica_placement ranks={world} nodes={nodes} ({ranks_per_node} ranks per node assumed) "
        f"replicas={replicas} node_rings={shape}: any {replicas} node losses leave every rank's newest window "
        f"in memory: {guarantee}; P(all recoverable from memory | k nodes lost) {odds}; "
        f"else persist_dir ({fallback})"
    )
