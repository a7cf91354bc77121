"""Copying a snapshot into its buffer: chunk by chunk, in runs, hashed once per chunk.

A layout (`moevement.storage.snapshot.layout_of`) puts the slices of one stacked tensor next to each other,
in storage order, so most of a snapshot's thousands of entries fall into a few *runs* that are copied with
one `copy_` each:

- a contiguous run: consecutive entries whose sources follow one another in one storage and whose bytes
  follow one another in the buffer (no padding between them): one flat copy;
- a repeated run: consecutive entries of the same source (a stacked tensor's optimizer step counter, one per
  slice): one broadcast copy into a strided view of their slots.

A `CopyPlan` resolves the runs of a layout in one buffer once; every snapshot of that layout reuses it, so
the copy thread does no Python work per entry, and the C++ work per call is per run, not per entry.
Padding is zeroed when a plan is made: copies never write it, and a plan lives only as long as its buffer's
mapping and layout (`SnapshotBuffers._resolved`). This is a CPU's snapshot copy (and any synchronous one); a
GPU's is issued from the training thread through a device staging ring (`moevement.storage.device_copy`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

from moevement.storage.cpu_cost import measure
from moevement.storage.snapshot import BLOCK, CHUNK_BYTES, Entry, checksum, padded, span, stored_dtype


class CopyCancelled(Exception):
    """A snapshot copy was cancelled between two chunks (`Throttle.cancel`): its buffer holds a torn copy."""


class Throttle:
    """Caps the copy rate at `bytes_per_s` (0: unlimited) by sleeping between chunks, and ends the copy between
    two chunks once `cancel` was called (from any thread). `slept`: the seconds it held the copy back, so
    that the copy's own rate (`working_s`) is known apart from the cap."""

    def __init__(self, bytes_per_s: float = 0.0, cancelled: threading.Event | None = None):
        self.rate, self.cancelled = bytes_per_s, cancelled or threading.Event()
        self.start, self.done, self.slept = time.perf_counter(), 0, 0.0

    def consume(self, nbytes: int) -> None:
        self.done += nbytes
        if self.rate > 0:
            ahead = self.done / self.rate - (time.perf_counter() - self.start)
            if ahead > 0:
                self.cancelled.wait(ahead)
                self.slept += ahead
        if self.cancelled.is_set():
            raise CopyCancelled

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def working_s(self) -> float:
        """Seconds the copy ran so far, not counting what the cap held it back."""
        return time.perf_counter() - self.start - self.slept


@dataclass(frozen=True)
class CopyGroup:
    """Entries `start:stop` of a layout, about one chunk together: copied with one foreach copy of its runs
    (`targets[i]` from `sources[i]`), and hashed with one call over `raw`, the chunk's bytes and padding
    (contiguous in the buffer)."""

    start: int
    stop: int
    targets: list[torch.Tensor]
    sources: list[torch.Tensor]
    raw: memoryview
    nbytes: int

    def issue(self) -> None:
        """Copy the chunk (done on return). Padding stays zero: the plan zeroed it, copies never write it."""
        torch._foreach_copy_(self.targets, self.sources)


@dataclass(frozen=True)
class CopyPlan:
    """How a layout's entries are copied into one buffer, chunk by chunk, run by run."""

    groups: list[CopyGroup]

    @classmethod
    def of(
        cls,
        buffer: torch.Tensor,
        entries: list[Entry],
        sources: list[torch.Tensor],
        chunk_bytes: int = CHUNK_BYTES,
    ) -> CopyPlan:
        """The plan of `entries` (from `sources`) in `buffer`, its padding zeroed."""
        whole = memoryview(buffer.numpy())
        groups, start = [], 0
        for stop in chunk_ends(entries, chunk_bytes, sources):
            lo, hi = span(entries, start, stop)
            targets, srcs = runs(buffer, entries, sources, start, stop)
            nbytes = sum(e.nbytes for e in entries[start:stop])
            groups.append(CopyGroup(start, stop, targets, srcs, whole[lo:hi], nbytes))
            start = stop
        zero_padding(buffer, entries)
        return cls(groups)

    @property
    def runs(self) -> int:
        """Copy calls per snapshot (the C++ work of a foreach copy is per run)."""
        return sum(len(g.targets) for g in self.groups)


def zero_padding(buffer: torch.Tensor, entries: list[Entry]) -> None:
    """Zero the padding after every entry of `buffer` (copies never write it)."""
    pads = [buffer[e.offset + e.nbytes : e.offset + padded(e.nbytes)] for e in entries if e.nbytes % BLOCK]
    if pads:
        torch._foreach_zero_(pads)


def copy_entries(
    buffer: torch.Tensor,
    entries: list[Entry],
    sources: list[torch.Tensor],
    throttle: Throttle,
    plan: CopyPlan | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> list[list]:
    """Copy (and cast) each source into its entry, synchronously, and return the checksum of every chunk,
    `[first entry, end entry, XXH3-64]` (a header's `checksums`; `entries` are not changed: a layout's entries
    serve many snapshots).

    Chunk by chunk (`plan`, made here in chunks of `chunk_bytes` if not given): one foreach copy of its runs,
    hashed at once. The bandwidth cap is enforced between chunks."""
    plan = plan or CopyPlan.of(buffer, entries, sources, chunk_bytes)
    sums: list[list] = []
    for group in plan.groups:
        with measure("copy"):
            group.issue()
        with measure("checksum"):
            sums.append([group.start, group.stop, checksum(group.raw)])
        throttle.consume(group.nbytes)
    return sums


def chunk_ends(
    entries: list[Entry], chunk_bytes: int, sources: list[torch.Tensor] | None = None, at_most: bool = False
) -> list[int]:
    """Indices ending consecutive chunks of entries of about `chunk_bytes` each (`at_most`: no more than
    `chunk_bytes` with their padding, but for an entry larger on its own); a chunk also ends where the
    sources' device changes (a GPU's step counters live on the host)."""
    ends, size = [], 0
    for i, entry in enumerate(entries):
        if at_most and size and size + padded(entry.nbytes) > chunk_bytes:
            ends.append(i)
            size = 0
        size += padded(entry.nbytes) if at_most else entry.nbytes
        last = i == len(entries) - 1
        if size >= chunk_bytes or last or (sources is not None and sources[i + 1].device != sources[i].device):
            ends.append(i + 1)
            size = 0
    return ends


def runs(
    buffer: torch.Tensor, entries: list[Entry], sources: list[torch.Tensor], start: int, stop: int, base: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(targets, sources) of the runs that copy entries `start:stop` into `buffer`, where the layout's byte
    `base` is byte 0: each run as long as the entries go on repeating its first source, or else following it
    contiguously; an entry that does neither alone."""
    targets, srcs, i = [], [], start
    while i < stop:
        end = i + 1
        if end < stop and _repeats(sources[i], sources[end]):
            while end < stop and _repeats(sources[i], sources[end]):
                end += 1
            target, source = _repeated_run(buffer, entries[i:end], sources[i], base)
        else:
            while end < stop and _follows(entries[end - 1], sources[end - 1], entries[end], sources[end]):
                end += 1
            target, source = _contiguous_run(buffer, entries[i:end], sources[i], base)
        targets.append(target)
        srcs.append(source)
        i = end
    return targets, srcs


def _repeats(first: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether `other` is the very tensor `first` is (a step counter every slice of its stack names)."""
    return (
        first.numel() > 0
        and other.data_ptr() == first.data_ptr()
        and other.dtype == first.dtype
        and other.shape == first.shape
        and other.stride() == first.stride()
        and other.device == first.device
    )


def _follows(entry: Entry, source: torch.Tensor, next_entry: Entry, next_source: torch.Tensor) -> bool:
    """Whether `next_entry` continues `entry` on both sides: its source starts in the same storage where
    `source` ends, both contiguous and of one dtype, and its bytes start where `entry`'s end (no padding)."""
    return (
        entry.nbytes % BLOCK == 0
        and next_entry.dtype == entry.dtype
        and next_entry.offset == entry.offset + entry.nbytes
        and next_source.dtype == source.dtype
        and source.numel() > 0
        and next_source.numel() > 0
        and source.is_contiguous()
        and next_source.is_contiguous()
        and next_source.device == source.device
        and next_source.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        and next_source.storage_offset() == source.storage_offset() + source.numel()
    )


def _contiguous_run(
    buffer: torch.Tensor, run: list[Entry], first: torch.Tensor, base: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One flat (target, source) pair for entries that follow one another on both sides (one entry: its own)."""
    lo = run[0].offset - base
    if len(run) == 1:
        return buffer[lo : lo + run[0].nbytes].view(stored_dtype(run[0])).view(run[0].shape), first
    numel = sum(math.prod(e.shape) for e in run)
    target = buffer[lo : lo + sum(e.nbytes for e in run)].view(stored_dtype(run[0]))
    return target, first.as_strided((numel,), (1,), first.storage_offset())


def _repeated_run(
    buffer: torch.Tensor, run: list[Entry], first: torch.Tensor, base: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One broadcast (target, source) pair for entries of the same source, a padded slot apart."""
    entry, stride = run[0], padded(run[0].nbytes)
    slots = buffer[entry.offset - base : entry.offset - base + stride * len(run)].view(len(run), stride)
    target = slots[:, : entry.nbytes].view(stored_dtype(entry))
    return target, first.reshape(1, -1).expand(len(run), first.numel())
