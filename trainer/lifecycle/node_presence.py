"""Which nodes of a torchrun job are still there: a lost node told apart from a worker's death
(docs/design/lifecycle/replacement.md, "A lost node").

A dead worker is replaced in place by its slot's standby; a lost node takes every slot it held, standbys
included, and no replacement comes. Without this, the survivors would wait for them as long as a later
generation's join is bounded (twice `fault.timeout_s`). So:

- every trainer under a rank shell says that its node is there, once a second, beside its `alive` to the
  shell: it adds one to `<round>/node<GROUP_RANK>/beat` on torchrun's store (`start_node_beat`);
- a rank waiting to join a later generation watches the next node in ring order (`NodeWatch`); a node
  whose count has not moved for `fault.node_loss_s` is lost (`NodeLost`), and the rank hands over to
  torchrun's restart of every worker, which an elastic job (`parallelism.elastic`) continues on the nodes
  that remain.

Every rank of a live node waits in the same join, so every lost node has a watcher: its nearest live
predecessor (a run of lost nodes is found one node at a time, the first ending the wait). A check reads one
key. A node none of whose trainers is running (all died at once, their standbys still importing) reads as
lost too: torchrun's restart then recovers it, as it would without shells.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from parallelisms.distributed import STORE_ERRORS, store_round, torchrun_store_client
from trainer.lifecycle import rank_shell
from trainer.lifecycle.job_end import GenerationCannotForm
from trainer.lifecycle.verdict import a_lost_node

BEAT_S = 1.0  # how often a trainer adds to its node's count


class NodeLost(GenerationCannotForm):
    """A generation this process waited to join will not form: node `node` is gone with its ranks."""

    def __init__(self, generation: int, node: int, silent_s: float, node_loss_s: float):
        super().__init__(
            f"restart: generation {generation} will not form: node {node} has said nothing on torchrun's store "
            f"for {silent_s:.0f} s (fault.node_loss_s={node_loss_s:g} s), so its ranks cannot be replaced in "
            "place: torchrun restarts every worker on the nodes that remain"
        )
        self.node = node


def beat_key(node: int) -> str:
    return f"{store_round()}/node{node}/beat"


def this_node() -> tuple[int, int]:
    """(this node's number, the number of nodes) in the torchrun round: its agent's GROUP_RANK and GROUP_WORLD_SIZE."""
    return int(os.environ.get("GROUP_RANK", "0")), int(os.environ.get("GROUP_WORLD_SIZE", "1"))


def start_node_beat() -> threading.Event | None:
    """In a shell's trainer, once its imports are done: add one to its node's count every `BEAT_S` from a
    daemon thread, until the event returned is set (None: no beat outside a shell, or with one node). A store
    that cannot be reached is asked again at the next beat."""
    if os.environ.get(rank_shell.ROLE) != "trainer" or "MASTER_ADDR" not in os.environ or this_node()[1] < 2:
        return None
    key, stop = beat_key(this_node()[0]), threading.Event()

    def beat() -> None:
        store = None
        while not stop.is_set():
            try:
                store = store or torchrun_store_client(BEAT_S * 5)
                store.add(key, 1)
            except STORE_ERRORS:
                store = None
            stop.wait(BEAT_S)

    threading.Thread(target=beat, name="moevement-node-beat", daemon=True).start()
    return stop


class NodeWatch:
    """Polled while this rank waits to join later generation `generation` (with the store `GenerationWatch`
    reads): returns `NodeLost` once the node after `node`, in ring order over `nodes`, is lost
    (`verdict.a_lost_node`: its count has not moved for `node_loss_s` since this watch first read it), else
    None. `clock` gives monotonic seconds (a test's own)."""

    def __init__(
        self, generation: int, node_loss_s: float, node: int, nodes: int, clock: Callable[[], float] = time.monotonic
    ):
        self.generation, self.node_loss_s, self.clock = generation, node_loss_s, clock
        self.watched = (node + 1) % nodes if nodes > 1 else None
        self.last: tuple[int, float] | None = None  # its count, and when it last moved (or was first read)

    def __call__(self, store: dist.Store) -> NodeLost | None:
        if self.watched is None:
            return None
        count, now = store.add(beat_key(self.watched), 0), self.clock()
        if self.last is None or self.last[0] != count:
            self.last = (count, now)
            return None
        silent = now - self.last[1]
        return (
            NodeLost(self.generation, self.watched, silent, self.node_loss_s)
            if a_lost_node(silent, self.node_loss_s)
            else None
        )
