"""Replicating each snapshot to `r` peer ranks over a dedicated gloo process group.

Every rank takes exactly one snapshot per iteration of a window (windows are global), so
replication runs in lockstep rounds on a background thread: in each round a rank sends its
snapshot (sizes, header, bytes) to its peers with point-to-point ops and receives the snapshots of
the ranks it is a peer of into shared-memory replica buffers. A peer on the same node instead makes
its replica file another name of the sender's shared-memory buffer file (a hard link: no copy, where
loopback TCP costs a copy and about 4x its CPU) and acknowledges it in the same round: a sender's
round ends only when every peer holds its bytes, so once `drain` or `close` returns the sender may
drop its own name of the buffer (a wipe, `HostBuffer.scrub`, or the end of the run), even when the
window it belongs to never completes (an aborted window, the last window of a run). The sender
writes into that file again only for the window two later, once the window in between is persisted
everywhere (`SnapshotBuffers`), when this replica is garbage too. Every round also
checks that sender and receiver are at the same (window, slot). After the last round of a window an
all-reduce on the same group tells every rank that the whole window is replicated everywhere:
the sparse checkpoint is then *persisted*.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moevement.storage.background import enter_background
from moevement.storage.cpu_cost import measure
from moevement.storage.host_memory import HostBuffer
from moevement.storage.private_files import make_private_dir
from moevement.storage.sealed import Record, SealError, seal_parts, sealed_record
from moevement.storage.snapshot_buffers import local_buffer
from moevement.topology import Topology
from parallelisms import collectives


class ReplicaStore:
    """Replicas this rank holds for other ranks: `<root>/from<src>/w<parity>-s<slot>.{bin,json}`."""

    def __init__(self, root: Path):
        self.root = make_private_dir(root)
        self.buffers: dict[tuple[int, int, int], HostBuffer] = {}

    def buffer(self, src: int, parity: int, slot: int) -> HostBuffer:
        key = (src, parity, slot)
        if key not in self.buffers:
            directory = make_private_dir(self.root / f"from{src}")
            self.buffers[key] = HostBuffer(directory / f"w{parity}-s{slot}", replica=True)
        return self.buffers[key]

    def invalidate(self, parity: int) -> None:
        for (_, p, _), buf in self.buffers.items():
            if p == parity:
                buf.invalidate()

    def nbytes(self) -> int:
        return sum(b.capacity for b in self.buffers.values())


@dataclass
class Outgoing:
    window_index: int
    slot: int
    last_in_window: bool
    header: Record  # the snapshot's JSON commit record, whole or in parts (`CommitRecord.parts`)
    payload: torch.Tensor  # uint8, exactly the header's "nbytes" long


class Replicator:
    """`local_buffer(src, parity, slot)`: where rank `src` keeps that snapshot buffer, for the ranks in
    `same_node` (their replicas are links to it; everyone else's bytes travel over `group`)."""

    def __init__(
        self,
        rank: int,
        peers: list[list[int]],
        store: ReplicaStore,
        group,
        on_window_replicated: Callable[[int], None],
        same_node: frozenset[int] = frozenset(),
        local_buffer: Callable[[int, int, int], Path] | None = None,
        priority: str = "idle",
    ):
        self.rank, self.group, self.store = rank, group, store
        self.peers = peers[rank]
        self.sources = [src for src, targets in enumerate(peers) if rank in targets]
        self.same_node, self.local_buffer, self.priority = same_node, local_buffer, priority
        self.on_window_replicated = on_window_replicated
        self.queue: queue.Queue[Outgoing | None] = queue.Queue()
        self.backlog = 0  # snapshots submitted and not yet replicated
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="moevement-replication", daemon=True)
        self.thread.start()

    def submit(self, item: Outgoing) -> None:
        self.raise_if_failed()
        self.backlog += 1
        self.queue.put(item)

    def drain(self) -> None:
        """Wait until every submitted snapshot is replicated (all ranks drain together)."""
        while self.queue.unfinished_tasks:
            self.raise_if_failed()
            time.sleep(0.001)
        self.raise_if_failed()

    def close(self) -> None:
        """Finish every submitted round (all ranks submit the same number), then stop."""
        self.queue.put(None)
        self.thread.join()
        self.raise_if_failed()

    def stop(self, timeout_s: float) -> None:
        """A peer died: end after the rounds already submitted (a round with the dead peer fails at once),
        waiting at most `timeout_s`; errors are the peer's death and stay unreported."""
        self.queue.put(None)
        self.thread.join(timeout_s)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"snapshot replication failed on rank {self.rank}") from self.error

    def _run(self) -> None:
        try:
            enter_background(self.priority)
            while (item := self.queue.get()) is not None:
                with measure("replication"):
                    self._round(item)
                self.backlog -= 1
                if item.last_in_window:
                    done = torch.tensor([item.window_index], dtype=torch.int64)
                    with measure("replication"):
                        collectives.all_reduce(done, op=dist.ReduceOp.MIN, group=self.group)
                    self.on_window_replicated(int(done))
                self.queue.task_done()
        except BaseException as e:  # surfaced on the training thread at the next submit/close
            self.error = e

    def _round(self, item: Outgoing) -> None:
        sealed = bytearray().join(seal_parts(item.header))  # checked by the receiver
        header = torch.frombuffer(sealed, dtype=torch.uint8)
        sizes = torch.tensor([header.numel(), item.payload.numel(), item.window_index, item.slot], dtype=torch.int64)
        incoming = {src: torch.empty(4, dtype=torch.int64) for src in self.sources}
        works = [collectives.isend(sizes, peer, group=self.group, tag=0) for peer in self.peers]
        works += [collectives.irecv(buf, src, group=self.group, tag=0) for src, buf in incoming.items()]
        _wait(works)
        works, acks = [], []
        for peer in self.peers:
            works.append(collectives.isend(header, peer, group=self.group, tag=1))
            if item.payload.numel():
                if peer in self.same_node:  # the peer links this rank's buffer: wait for its acknowledgement
                    acks.append(torch.empty(1, dtype=torch.int64))
                    works.append(collectives.irecv(acks[-1], peer, group=self.group, tag=3))
                else:
                    works.append(collectives.isend(item.payload, peer, group=self.group, tag=2))
        received = {}
        parity = item.window_index % 2
        for src, (header_len, payload_len, window_index, slot) in ((s, b.tolist()) for s, b in incoming.items()):
            if (window_index, slot) != (item.window_index, item.slot):
                raise RuntimeError(
                    f"replication out of step: rank {src} sends its snapshot of window {window_index} "
                    f"slot {slot} while rank {self.rank} is at window {item.window_index} slot {item.slot}"
                )
            replica = self.store.buffer(src, parity, item.slot)
            replica.invalidate()
            header_buf = torch.empty(header_len, dtype=torch.uint8)
            works.append(collectives.irecv(header_buf, src, group=self.group, tag=1))
            if payload_len:
                if src in self.same_node:
                    replica.link(self.local_buffer(src, parity, item.slot).with_suffix(".bin"))
                    works.append(collectives.isend(_ACK, src, group=self.group, tag=3))  # its name may go now
                else:
                    data = replica.ensure(payload_len)[:payload_len]
                    works.append(collectives.irecv(data, src, group=self.group, tag=2))
            received[src] = (replica, header_buf)
        _wait(works)
        for src, (replica, header_buf) in received.items():
            try:  # the sender's commit record, byte for byte, once its seal holds
                replica.commit(sealed_record(header_buf.numpy().tobytes(), f"replica header from rank {src}"))
            except SealError as e:  # left uncommitted: a recovery takes another copy
                print(f"replication: rank {self.rank} rejected {e}", flush=True)


_ACK = torch.ones(1, dtype=torch.int64)  # a same-node peer holds its own name of the sender's buffer file


def _wait(works: list) -> None:
    for work in works:
        collectives.wait(work)


def start_replication(
    topology: Topology,
    replicas: int,
    store: ReplicaStore,
    on_window_replicated: Callable[[int], None],
    rank_dirs: Callable[[int], Path] | None,
    priority: str,
    timeout_s: float | None = None,
) -> Replicator | None:
    """This rank's replicator over a dedicated gloo group (collective; None on one rank or without
    replicas). `rank_dirs(r)`: where rank r keeps its host state, so that a peer on the same node copies
    from its shared memory; None: everything goes over the group. `timeout_s`: the group's bound on an
    operation without progress (None: PyTorch's default, 30 minutes)."""
    if topology.world == 1 or replicas == 0:
        return None
    group = dist.new_group(backend="gloo", timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
    node = topology.node_of[topology.rank]
    same_node = frozenset()
    if rank_dirs is not None:
        same_node = frozenset(r for r, n in enumerate(topology.node_of) if n == node and r != topology.rank)
    return Replicator(
        topology.rank,
        topology.replica_peers(replicas),
        store,
        group,
        on_window_replicated,
        same_node,
        lambda src, parity, slot: local_buffer(rank_dirs(src), parity, slot),
        priority,
    )
