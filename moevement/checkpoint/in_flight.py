"""The snapshot the running iteration takes, from its copy to its commit, and the newest committed one
(docs/design/state-and-snapshots.md).

`start` (in `begin(t)`) starts the copy of SS_t once its buffer's old window is garbage
(`SnapshotHandoff.wait_until_reusable`): on a CPU the copy thread waits for that, copies and hashes; on a GPU
the training thread issues the copy on a side stream at once (or, if the old window is not yet garbage,
just before the step). The optimizer step pre-hook orders the step after the copy (`wait`): on a CPU by
waiting for the copy thread, on a GPU by making the training stream wait for the copy's event, so SS_t is
complete before the step mutates any of its tensors and the host never waits. `commit` (in `end(t)`) adds
the iteration's `meta` to the encoded header and hands the snapshot to the hand-off. With
`checkpoint.overlap = iteration` the copy of SS_t starts in `end(t-1)`, right after SS_{t-1}'s commit:
state_t is complete once the step of t-1 is done. A copy on the copy thread can be cancelled between two
chunks (`drop`: a recovery, or a speculative copy the run's end leaves unused): nothing writes its buffer
once `drop` returns.

Threads: `_copy` runs on the copy thread, everything else on the training thread. `pending` is the
training thread's alone: the copy thread gets what it needs as arguments when the copy is submitted.
"""

from __future__ import annotations

import threading
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
    """A copy on the copy thread, which `cancelled` ends between two chunks; `started`: when it began copying
    (perf_counter; None before), set by the copy thread."""

    def __init__(self, future: Future, cancelled: threading.Event, started: list[float]):
        self.future, self.cancelled, self.started = future, cancelled, started

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

    def issued_now(self) -> IssuedCopy:
        """The copy, issued now if it was not yet (`issue` blocks until its buffer is free)."""
        if self.issued is None:
            self.issued = self.issue()
        return self.issued

    def order_step(self) -> None:
        self.issued_now().order_step()

    def result(self) -> EncodedHeader:
        return self.issued_now().result()

    def exception(self) -> BaseException | None:
        return self.issued.exception() if self.issued is not None else None


@dataclass
class _Pending:
    window_index: int
    header: SnapshotHeader
    buffer: HostBuffer
    copy: _Copy
    issued_at: float  # perf_counter when `start` handed it on

    def copy_started(self) -> float:
        """When its copy began copying (a threaded one after waiting for its buffer); its hand-on time if that
        is not known."""
        started = self.copy.started if isinstance(self.copy, _Threaded) else []
        return started[0] if started else self.issued_at


class SnapshotInFlight:
    """At most one snapshot in flight (`pending`), copied into `buffers` at the pace `throttle(cancelled=...)`
    gives, and committed through `handoff`; `copied(nbytes, working_s)` hears of every threaded copy done."""

    def __init__(
        self,
        buffers: SnapshotBuffers,
        handoff: SnapshotHandoff,
        throttle: Callable[..., Throttle],
        job_meta: dict,
        copied: Callable[[int, float], None] = lambda nbytes, working_s: None,
    ):
        """`job_meta`: what every snapshot's `meta` begins with (`MetaEncoder`)."""
        self.buffers, self.handoff, self.throttle, self.copied = buffers, handoff, throttle, copied
        self.encode_meta = MetaEncoder(job_meta).encode
        self.pending: _Pending | None = None
        self.latest_buffer: HostBuffer | None = None  # the newest committed snapshot's

    def start(self, window_index: int, header: SnapshotHeader, sources: list[torch.Tensor], buffer: HostBuffer) -> None:
        """Training thread: start the copy of SS_t (`header`, `sources`) into `buffer`, of window `window_index`."""
        copy: _Copy
        if not self.buffers.staged:
            cancelled, started = threading.Event(), []
            args = (window_index, buffer, header, sources, cancelled, started)
            copy = _Threaded(self.buffers.submit(self._copy, *args), cancelled, started)
        elif self.handoff.reusable(window_index):
            copy = self.buffers.issue(buffer, header, sources)
        else:
            copy = _Deferred(lambda: self._issue_when_reusable(window_index, buffer, header, sources))
        self.pending = _Pending(window_index, header, buffer, copy, time.perf_counter())

    def issue_if_reusable(self) -> None:
        """Training thread (GPU): a copy deferred because its buffer's old window was not yet garbage when it
        started (at the end of the iteration before) is issued now if that window is garbage by now."""
        pending = self.pending
        if pending is None or not isinstance(pending.copy, _Deferred) or pending.copy.issued is not None:
            return
        if self.handoff.reusable(pending.window_index):
            pending.copy.issued_now()

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
        """Training thread (a recovery, a speculative copy left unused): the snapshot in flight, if any, is
        forgotten uncommitted; a copy on the copy thread is cancelled and ended, one issued on a GPU is let finish
        (nothing writes a buffer after it is dropped)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._end(pending.copy)

    def _end(self, copy: _Copy) -> None:
        """Cancel a threaded copy (waking it if it waits for its buffer) and wait for any copy to end."""
        if isinstance(copy, _Threaded):
            copy.cancelled.set()
            with self.handoff.persisted.cond:
                self.handoff.persisted.cond.notify_all()
        copy.exception()

    def finish(self) -> None:
        """Training thread: the copy in flight has completed (its errors raised)."""
        if self.pending is not None:
            self.pending.copy.result()

    def abandon(self) -> None:
        """Training thread, a peer died: the copy in flight is cancelled and has ended (its errors are the dead
        peer's)."""
        if self.pending is not None:
            self._end(self.pending.copy)

    @property
    def latest(self) -> tuple[SnapshotHeader, torch.Tensor] | None:
        """The newest committed snapshot: its header as committed, and its bytes."""
        if self.latest_buffer is None:
            return None
        return SnapshotHeader.from_json(read_header(self.latest_buffer.path)), self.latest_buffer.data

    def _copy(
        self, window_index: int, buffer: HostBuffer, header: SnapshotHeader, sources, cancelled, started: list
    ) -> EncodedHeader:
        """Copy thread: wait until the buffer's old window is garbage, copy SS_t into it (noting in `started` when
        it began), and encode its header but for the iteration's `meta` (which `commit` adds); `cancelled` ends it
        between two chunks (`CopyCancelled`)."""
        self.handoff.wait_until_reusable(window_index, cancelled)
        throttle = self.throttle(cancelled=cancelled)
        started.append(throttle.start)
        encoded = self.buffers.copy(buffer, header, sources, throttle)
        self.copied(header.nbytes, throttle.working_s)
        return encoded

    def _issue_when_reusable(self, window_index: int, buffer: HostBuffer, header, sources) -> IssuedCopy:
        """Training thread (GPU): wait until the buffer's old window is garbage, then issue the copy."""
        self.handoff.wait_until_reusable(window_index)
        return self.buffers.issue(buffer, header, sources)
