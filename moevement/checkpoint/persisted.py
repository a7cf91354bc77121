"""The newest persisted sparse checkpoint of a rank: the rollback point recovery reads.

A window's snapshots are committed one per iteration (`committed`); when every rank has replicated
the whole window it is *persisted* (`publish`): `persisted.json` names it, and the window before it
becomes garbage. Recovery reads only through `rollback_point`, `span`, `snapshot`, `snapshot_buffer`,
`replica_buffer` and `scalars`.

Threads: `committed`, `log_scalars`, `restore_scalars`, `abort_in_flight`, `forget` and `restored` run on
the training thread; `window_replicated` on the replication thread (or the training thread without
replication); `wait_until_persisted` on the copy thread. Every field is read and written under `cond`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from moevement.checkpoint.schedule import WindowSpan
from moevement.storage.host_memory import HostBuffer, read_header
from moevement.storage.persistence import DiskWriter
from moevement.storage.private_files import write_json_atomic
from moevement.storage.replication import ReplicaStore
from moevement.storage.snapshot import CommitRecord, SnapshotHeader, read_entries
from moevement.storage.snapshot_buffers import SnapshotBuffers, local_buffer

MANIFEST = "persisted.json"


class PersistedCheckpoint:
    def __init__(self, rank_dir: Path, rank: int, buffers: SnapshotBuffers, replicas: ReplicaStore):
        self.rank_dir, self.rank, self.buffers, self.replicas = rank_dir, rank, buffers, replicas
        self.cond = threading.Condition()
        self.index = -1  # index of the newest persisted window (-1: none yet)
        self.span: WindowSpan | None = None  # its iterations
        self.headers: dict[int, list[CommitRecord]] = {}  # window index -> snapshots committed so far
        self.scalar_log: dict[int, dict] = {}  # iteration -> logged scalars, kept from rollback_point()

    def rollback_point(self) -> int:
        """First iteration of the newest persisted checkpoint (1: none yet, roll back to the initial state)."""
        with self.cond:
            return self.span.start if self.span else 1

    def snapshot_buffer(self, slot: int) -> HostBuffer:
        """This rank's buffer of slot `slot` of the newest persisted checkpoint."""
        return self.buffers.buffer(self.index % 2, slot)

    def snapshot(self, slot: int, verify: bool = False) -> tuple[SnapshotHeader, dict]:
        """SS_{t0+slot} of the newest persisted checkpoint from this rank's buffer (checksums checked if
        `verify`; localized recovery verifies when it fetches)."""
        buf = self.snapshot_buffer(slot)
        header = SnapshotHeader.from_json(read_header(buf.path))
        return header, read_entries(buf.data, header, source=str(buf.path), verify=verify)

    def replica_buffer(self, src: int, slot: int) -> HostBuffer:
        """The replica this rank holds of rank `src`'s slot `slot` of the newest persisted checkpoint."""
        return self.replicas.buffer(src, self.index % 2, slot)

    def scalars(self, first: int, stop: int) -> dict[int, dict]:
        """The logged scalars of iterations `first..stop-1` (all kept since the rollback point)."""
        with self.cond:
            return {t: self.scalar_log[t] for t in range(first, stop)}

    def scalars_since(self, first: int) -> dict[int, dict]:
        """Every logged scalar set of iterations `first` onwards."""
        with self.cond:
            return {t: dict(v) for t, v in self.scalar_log.items() if t >= first}

    def log_scalars(self, iteration: int, scalars: dict[str, float]) -> None:
        with self.cond:
            self.scalar_log[iteration] = dict(scalars)
            first = self.span.start if self.span else 1
            for old in [t for t in self.scalar_log if t < first]:
                del self.scalar_log[old]

    def restore_scalars(self, log: dict[int, dict]) -> None:
        """A failed rank's scalar log is back (from a survivor): it may serve the next recovery."""
        with self.cond:
            self.scalar_log.update(log)

    def committed(self, window_index: int, commit: CommitRecord) -> None:
        """A snapshot of window `window_index` is complete in its local buffer."""
        with self.cond:
            self.headers.setdefault(window_index, []).append(commit)

    def window_replicated(self, window_index: int, disk: DiskWriter | None) -> None:
        """Every rank has replicated window `window_index`: the window before it is garbage, this one is
        handed to `disk` (if given), recorded, and a copy waiting for its buffers is woken."""
        with self.cond:
            self.headers.pop(window_index - 1, None)
            headers = self.headers.pop(window_index)
        parity = window_index % 2
        self.buffers.invalidate(1 - parity)
        self.replicas.invalidate(1 - parity)
        if disk is not None:  # before the index is published: the copy thread waits on the disk writer
            disk.submit(parity, [(h, self.buffers.buffer(parity, h.slot).data) for h in headers])
        span = WindowSpan(headers[0].window_start, len(headers))
        self._write_manifest(window_index, span)
        with self.cond:
            self.index, self.span = window_index, span
            self.cond.notify_all()

    def is_persisted(self, window_index: int) -> bool:
        """Whether window `window_index` (or a later one) is persisted, without waiting."""
        with self.cond:
            return self.index >= window_index

    def wait_until_persisted(self, window_index: int, check: Callable[[], None]) -> None:
        """Block until window `window_index` is persisted (`check` raises if it never will be)."""
        with self.cond:
            while self.index < window_index:
                check()
                self.cond.wait(timeout=1.0)

    def abort_in_flight(self) -> int:
        """Drop the in-flight window's headers; returns the newest persisted window's index."""
        with self.cond:
            for index in [i for i in self.headers if i > self.index]:
                del self.headers[index]
            return self.index

    def forget(self) -> None:
        """This rank failed: its manifest and scalar log are gone (recovery fetches them back)."""
        (self.rank_dir / MANIFEST).unlink(missing_ok=True)
        with self.cond:
            self.scalar_log.clear()

    def restored(self) -> None:
        """Every slot of the persisted checkpoint is back in the local buffers: record it again."""
        with self.cond:
            index, span = self.index, self.span
        self._write_manifest(index, span)

    def _write_manifest(self, window_index: int, span: WindowSpan) -> None:
        write_json_atomic(
            self.rank_dir / MANIFEST,
            {
                "window_index": window_index,
                "window_start": span.start,
                "window": span.size,
                "rank": self.rank,
                "snapshots": [str(local_buffer(Path(), window_index % 2, slot)) for slot in range(span.size)],
            },
        )
