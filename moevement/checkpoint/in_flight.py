"""The snapshot the running iteration takes, from its copy to its commit, and the newest committed one
(docs/design.md §2).

`start` (in `begin(t)`) submits the copy of SS_t to the copy thread, which first waits until its buffer's
old window is garbage (`SnapshotHandoff.wait_until_reusable`); the optimizer step pre-hook waits for the
copy (`wait`), so SS_t is complete before the step mutates any of its tensors; `commit` (in `end(t)`)
adds the iteration's `meta` to the encoded header and hands the snapshot to the hand-off.

Threads: `_copy` runs on the copy thread, everything else on the training thread. `pending` is the
training thread's alone: the copy thread gets what it needs as arguments when the copy is submitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from moevement.checkpoint.handoff import SnapshotHandoff
from moevement.storage.host_memory import HostBuffer, read_header
from moevement.storage.snapshot import EncodedHeader, SnapshotHeader
from moevement.storage.snapshot_buffers import SnapshotBuffers
from moevement.storage.snapshot_copy import Throttle


@dataclass
class _Pending:
    window_index: int
    header: SnapshotHeader
    buffer: HostBuffer
    copy: Future


class SnapshotInFlight:
    """At most one snapshot in flight (`pending`), copied into `buffers` at the pace `throttle()` gives, and
    committed through `handoff`."""

    def __init__(self, buffers: SnapshotBuffers, handoff: SnapshotHandoff, throttle: Callable[[], Throttle]):
        self.buffers, self.handoff, self.throttle = buffers, handoff, throttle
        self.pending: _Pending | None = None
        self.latest_buffer: HostBuffer | None = None  # the newest committed snapshot's

    def start(self, window_index: int, header: SnapshotHeader, sources: list[torch.Tensor], buffer: HostBuffer) -> None:
        """Training thread: submit the copy of SS_t (`header`, `sources`) into `buffer`, of window `window_index`."""
        ready = self.buffers.sources_ready()
        copy = self.buffers.submit(self._copy, window_index, buffer, header, sources, ready)
        self.pending = _Pending(window_index, header, buffer, copy)

    def wait(self) -> float | None:
        """Training thread, before the optimizer step: the seconds spent waiting for the copy to complete
        (None: no snapshot in flight)."""
        if self.pending is None:
            return None
        start = time.perf_counter()
        self.pending.copy.result()
        return time.perf_counter() - start

    @property
    def meta(self) -> dict | None:
        """The header metadata of the snapshot in flight (None: none)."""
        return self.pending.header.meta if self.pending is not None else None

    def commit(self, scalars: dict[str, float]) -> None:
        """Training thread, after the optimizer step: add the iteration's `scalars` to the header of the snapshot
        in flight, which must exist, and commit it."""
        pending, self.pending = self.pending, None
        pending.header.meta["scalars"] = dict(scalars)
        commit = pending.copy.result().with_meta(pending.header.meta)
        last = pending.header.slot == pending.header.window - 1
        self.handoff.commit(pending.window_index, commit, pending.buffer, last)
        self.latest_buffer = pending.buffer

    def drop(self) -> None:
        """Training thread, recovery: the snapshot in flight, if any, is forgotten uncommitted."""
        self.pending = None

    def finish(self) -> None:
        """Training thread: the copy in flight has completed (its errors raised)."""
        if self.pending is not None:
            self.pending.copy.result()

    def abandon(self) -> None:
        """Training thread, a peer died: the copy in flight has ended (its errors are the dead peer's)."""
        if self.pending is not None:
            self.pending.copy.exception()

    @property
    def latest(self) -> tuple[SnapshotHeader, torch.Tensor] | None:
        """The newest committed snapshot: its header as committed, and its bytes."""
        if self.latest_buffer is None:
            return None
        return SnapshotHeader.from_json(read_header(self.latest_buffer.path)), self.latest_buffer.data

    def _copy(self, window_index: int, buffer: HostBuffer, header: SnapshotHeader, sources, ready) -> EncodedHeader:
        """Copy thread: wait until the buffer's old window is garbage, copy SS_t into it (after `ready` on GPU),
        and encode its header but for the iteration's `meta` (which `commit` adds)."""
        self.handoff.wait_until_reusable(window_index)
        return self.buffers.copy(buffer, header, sources, self.throttle(), ready)
