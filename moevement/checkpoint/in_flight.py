"""The snapshot the running iteration takes, from its copy to its commit, and the newest committed one
(docs/design.md §2).

`start` (in `begin(t)`) starts the copy of SS_t once its buffer's old window is garbage
(`SnapshotHandoff.wait_until_reusable`): on a CPU the copy thread waits for that, copies and hashes; on a GPU
the training thread issues the copy on a side stream at once (or, if the old window is not yet garbage,
just before the step). The optimizer step pre-hook orders the step after the copy (`wait`): on a CPU by
waiting for the copy thread, on a GPU by making the training stream wait for the copy's event, so SS_t is
complete before the step mutates any of its tensors and the host never waits. `commit` (in `end(t)`) adds
the iteration's `meta` to the encoded header and hands the snapshot to the hand-off.

Threads: `_copy` runs on the copy thread, everything else on the training thread. `pending` is the
training thread's alone: the copy thread gets what it needs as arguments when the copy is submitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from moevement.checkpoint.handoff import SnapshotHandoff
from moevement.storage.device_copy import IssuedCopy
from moevement.storage.host_memory import HostBuffer, read_header
from moevement.storage.snapshot import EncodedHeader, MetaEncoder, SnapshotHeader
from moevement.storage.snapshot_buffers import SnapshotBuffers
from moevement.storage.snapshot_copy import Throttle


class _Copy(Protocol):
    """A snapshot copy under way (training thread)."""

    def order_step(self) -> None:
        """Before the optimizer step: order it after the copy (a host wait, or a stream wait on a GPU)."""

    def result(self) -> EncodedHeader:
        """The header but for `meta`, checksums in (waits for the copy; raises its error)."""

    def exception(self) -> BaseException | None:
        """Wait for the copy to end; its error, if any."""


class _Threaded:
    """A copy on the copy thread."""

    def __init__(self, future: Future):
        self.future = future

    def order_step(self) -> None:
        self.future.result()

    def result(self) -> EncodedHeader:
        return self.future.result()

    def exception(self) -> BaseException | None:
        return self.future.exception()


class _Deferred:
    """A GPU copy whose buffer's old window was not yet garbage at `start`: issued just before the step,
    after waiting for it (`issue` blocks), or at commit at the latest."""

    def __init__(self, issue: Callable[[], IssuedCopy]):
        self.issue, self.issued = issue, None

    def _issued(self) -> IssuedCopy:
        if self.issued is None:
            self.issued = self.issue()
        return self.issued

    def order_step(self) -> None:
        self._issued().order_step()

    def result(self) -> EncodedHeader:
        return self._issued().result()

    def exception(self) -> BaseException | None:
        return self.issued.exception() if self.issued is not None else None


@dataclass
class _Pending:
    window_index: int
    header: SnapshotHeader
    buffer: HostBuffer
    copy: _Copy


class SnapshotInFlight:
    """At most one snapshot in flight (`pending`), copied into `buffers` at the pace `throttle()` gives, and
    committed through `handoff`."""

    def __init__(
        self, buffers: SnapshotBuffers, handoff: SnapshotHandoff, throttle: Callable[[], Throttle], job_meta: dict
    ):
        """`job_meta`: what every snapshot's `meta` begins with (`MetaEncoder`)."""
        self.buffers, self.handoff, self.throttle = buffers, handoff, throttle
        self.encode_meta = MetaEncoder(job_meta).encode
        self.pending: _Pending | None = None
        self.latest_buffer: HostBuffer | None = None  # the newest committed snapshot's

    def start(self, window_index: int, header: SnapshotHeader, sources: list[torch.Tensor], buffer: HostBuffer) -> None:
        """Training thread: start the copy of SS_t (`header`, `sources`) into `buffer`, of window `window_index`."""
        copy: _Copy
        if not self.buffers.staged:
            copy = _Threaded(self.buffers.submit(self._copy, window_index, buffer, header, sources))
        elif self.handoff.reusable(window_index):
            copy = self.buffers.issue(buffer, header, sources)
        else:
            copy = _Deferred(lambda: self._issue_when_reusable(window_index, buffer, header, sources))
        self.pending = _Pending(window_index, header, buffer, copy)

    def wait(self) -> float | None:
        """Training thread, before the optimizer step: order the step after the copy; the seconds the host
        waited for that (None: no snapshot in flight)."""
        if self.pending is None:
            return None
        start = time.perf_counter()
        self.pending.copy.order_step()
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
        commit = pending.copy.result().with_meta(pending.header.meta, self.encode_meta)
        last = pending.header.slot == pending.header.window - 1
        self.handoff.commit(pending.window_index, commit, pending.buffer, last)
        self.latest_buffer = pending.buffer

    def drop(self) -> None:
        """Training thread, recovery: the snapshot in flight, if any, is forgotten uncommitted (a copy issued on a
        GPU is let finish first: nothing writes a buffer after it is dropped)."""
        if self.pending is not None and isinstance(self.pending.copy, (IssuedCopy, _Deferred)):
            self.pending.copy.exception()
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

    def _copy(self, window_index: int, buffer: HostBuffer, header: SnapshotHeader, sources) -> EncodedHeader:
        """Copy thread: wait until the buffer's old window is garbage, copy SS_t into it, and encode its header
        but for the iteration's `meta` (which `commit` adds)."""
        self.handoff.wait_until_reusable(window_index)
        return self.buffers.copy(buffer, header, sources, self.throttle())

    def _issue_when_reusable(self, window_index: int, buffer: HostBuffer, header, sources) -> IssuedCopy:
        """Training thread (GPU): wait until the buffer's old window is garbage, then issue the copy."""
        self.handoff.wait_until_reusable(window_index)
        return self.buffers.issue(buffer, header, sources)
