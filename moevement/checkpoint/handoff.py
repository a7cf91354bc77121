"""The hand-off of committed snapshots: commit record, replication, persistence, disk (docs/design/snapshot-path.md).

A snapshot whose bytes are complete in its buffer is committed (`commit`): its commit record is written
after the bytes, then the snapshot goes to the replicator. When every rank has replicated a window's last
snapshot the window is persisted (`PersistedCheckpoint.window_replicated`, which garbage-collects the
window before it), and every `persist_every`-th one is handed to the disk writer, but for the window a
restarted job adopted (`adopted`: it came from a persisted checkpoint and is not written again).

Threads: `commit`, `drain`, `flush_disk`, `close` and `abandon` run on the training thread;
`_on_window_replicated` on the replication thread (or, without replication, on the training thread
inside `commit`); `wait_until_reusable` on the copy thread. `adopted` is set on the training thread
before the adopted window is committed, so the replication thread reads it only after.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from moevement.checkpoint.options import SparseOptions
from moevement.checkpoint.persisted import PersistedCheckpoint
from moevement.storage.host_memory import HostBuffer
from moevement.storage.persistence import DiskWriter
from moevement.storage.replication import Outgoing, ReplicaStore, start_replication
from moevement.storage.snapshot import CommitRecord
from moevement.storage.snapshot_copy import CopyCancelled
from moevement.topology import Topology

# How long `abandon` waits for the replicator where its group has no bound (`group_timeout_s` None: a test or
# benchmark; the trainer passes `fault.timeout_s`, the bound a dead peer's round fails after).
UNBOUNDED_STOP_S = 60.0


class SnapshotHandoff:
    """Replication (`cfg.replicas` peers over `topology`, collective to build) and disk writes
    (`cfg.persist_dir`, the newest `disk_keep` windows kept) of the snapshots committed into `persisted`.
    `rank_dirs` and `group_timeout_s` are the replication group's (`start_replication`)."""

    def __init__(
        self,
        cfg: SparseOptions,
        topology: Topology,
        persisted: PersistedCheckpoint,
        replicas: ReplicaStore,
        rank_dirs: Callable[[int], Path] | None,
        group_timeout_s: float | None,
        disk_keep: int,
    ):
        self.persist_every, self.persisted, self.group_timeout_s = cfg.persist_every, persisted, group_timeout_s
        self.disk = None
        if cfg.persist_dir:
            self.disk = DiskWriter(Path(cfg.persist_dir), topology.rank, disk_keep, cfg.background_priority)
        self.replicator = start_replication(
            topology,
            cfg.replicas,
            replicas,
            self._on_window_replicated,
            rank_dirs,
            cfg.background_priority,
            group_timeout_s,
        )
        self.adopted = -1  # index of the window a restarted job kept (`adopt_window`; -1: none)

    @property
    def backlog(self) -> int:
        """Snapshots handed to the replicator and not yet replicated."""
        return self.replicator.backlog if self.replicator is not None else 0

    def commit(self, window_index: int, commit: CommitRecord, buffer: HostBuffer, last: bool) -> None:
        """Training thread: a snapshot's bytes are complete in `buffer`: record it (the local commit record and
        the replicas' are the same bytes) and hand it to the replicator; `last`: the window's last slot."""
        buffer.commit(commit.parts)
        self.persisted.committed(window_index, commit)
        if self.replicator is not None:
            payload = buffer.data[: commit.nbytes]
            self.replicator.submit(Outgoing(window_index, commit.slot, last, commit.parts, payload))
        elif last:
            self._on_window_replicated(window_index)

    def reusable(self, window_index: int) -> bool:
        """Training thread: whether window `window_index` may overwrite the buffers of its parity now (what
        `wait_until_reusable` waits for, without waiting)."""
        if not self.persisted.is_persisted(window_index - 1):
            return False
        return self.disk is None or not self.disk.busy(window_index % 2)

    def wait_until_reusable(self, window_index: int, cancelled: threading.Event | None = None) -> None:
        """Copy thread: block until window `window_index` may overwrite the buffers of its parity: the window
        before it is persisted (so the one before that is garbage) and the disk writer has finished reading them.
        Once `cancelled` is set (and `persisted.cond` notified) it raises `CopyCancelled` instead."""

        def check() -> None:
            if self.replicator is not None:
                self.replicator.raise_if_failed()
            if cancelled is not None and cancelled.is_set():
                raise CopyCancelled

        self.persisted.wait_until_persisted(window_index - 1, check)
        if self.disk is not None:
            self.disk.wait(window_index % 2)

    def drain(self) -> None:
        """Training thread: every committed snapshot is replicated (collective: all ranks drain together)."""
        if self.replicator is not None:
            self.replicator.drain()

    def flush_disk(self) -> None:
        """Every disk write that was going to land has landed."""
        if self.disk is not None:
            self.disk.close()

    def close(self) -> None:
        """Training thread, the copy thread finished: replicate every submitted round, then finish the disk writes."""
        if self.replicator is not None:
            self.replicator.close()
        self.flush_disk()

    def abandon(self, rank: int) -> None:
        """Training thread, a peer died: replication ends after the rounds already submitted and the disk writes
        finish; errors met here are the dead peer's (a dropped disk write is said, not raised)."""
        if self.replicator is not None:
            self.replicator.stop(UNBOUNDED_STOP_S if self.group_timeout_s is None else self.group_timeout_s)
        try:
            self.flush_disk()
        except (OSError, RuntimeError) as e:  # the new generation writes the next window again
            print(f"restart: rank {rank}: an in-flight disk write was dropped ({e})", flush=True)

    def _on_window_replicated(self, window_index: int) -> None:
        """Replication thread: window `window_index` is complete on every rank and its replicas: it is persisted."""
        due = window_index % self.persist_every == 0 and window_index != self.adopted
        self.persisted.window_replicated(window_index, self.disk if due else None)
