"""A GPU's snapshot copy: issued from the training thread in O(chunks) calls, checksummed on the device.

A launch-bound training thread takes the GIL back at every kernel launch, so any other thread's Python
(a copy thread walking chunks, a hash call) makes it wait; the cost grows with those hand-overs, not with
bytes (docs/design/sparse-checkpointing.md). So on a GPU the training thread issues the whole copy itself, on a side
stream, and never waits for it on the host:

1. the side stream waits for the training stream (the work that produced `state_t`);
2. per chunk (64 MB, or the layout's largest entry where longer: `staged_chunk_bytes`): the staging slot
   is zeroed (unless the chunk's entries fill its blocks exactly), the chunk's runs gathered into it with
   one device-to-device foreach copy (the fast path), the slot brought into the pinned buffer with one
   non-blocking copy, and its block sums (`moevement.storage.word_checksum`) computed on the device; slots
   are taken in turn, and the stream's order keeps a slot from being gathered into again before its copy
   to the host is done;
3. every chunk's checksum is combined from its block sums at once, the sums come to pinned host memory
   with one copy, and one event marks the end;
4. the optimizer step's pre-hook makes the training stream wait for that event (`IssuedCopy.order_step`);
5. at commit (after the step is issued) `IssuedCopy.result` waits for the event, normally long passed,
   and encodes the header with the checksums.

Chunks whose sources live on the host (a GPU optimizer's step counters) are copied and summed on the
training thread at once, over their entries' words alone (`word_checksum.SparseWords`): a few KB of values
in padded entries.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from moevement.storage import word_checksum
from moevement.storage.cpu_cost import measure
from moevement.storage.snapshot import (
    BLOCK,
    CHUNK_BYTES,
    STAGING_SLOTS,
    EncodedHeader,
    Entry,
    SnapshotHeader,
    padded,
    span,
)
from moevement.storage.snapshot_copy import chunk_ends, runs, zero_padding


@dataclass(frozen=True)
class Chunk:
    """Entries `start:stop`, `nbytes` in the buffer (padding included) at `host`: gathered into `slot` (its
    whole 64 KiB blocks) with one foreach copy of `targets` from `sources`, or, with `slot` None (host
    sources), copied straight into `host` and summed over the entries' words (`words`)."""

    start: int
    stop: int
    nbytes: int
    targets: list[torch.Tensor]
    sources: list[torch.Tensor]
    host: torch.Tensor
    slot: torch.Tensor | None
    words: word_checksum.SparseWords | None = None
    zeroed: bool = True  # the slot is zeroed first: the entries leave padding or a partial last block in it


def slot_bytes(entries: list[Entry], sources: list[torch.Tensor], chunk_bytes: int, device: torch.device) -> int:
    """The staging slot a layout's chunks on `device` need: the largest, in whole 64 KiB blocks."""
    largest, start = 0, 0
    for stop in chunk_ends(entries, chunk_bytes, sources, at_most=True):
        if sources[start].device == device:
            lo, hi = span(entries, start, stop)
            largest = max(largest, hi - lo)
        start = stop
    return word_checksum.block_rounded(largest)


def staged_chunk_bytes(
    entries: list[Entry], sources: list[torch.Tensor], chunk_bytes: int, device: torch.device
) -> int:
    """The chunk size of a layout's staged copy: `chunk_bytes`, or its largest entry on `device` where that
    is larger. The ring holds that entry whole anyway (`ring_bytes`), so chunks as long cost no device
    memory, and a stage with a large embedding or head takes a few long chunks instead of many of 64 MB
    (each chunk is seven launches on the training thread)."""
    largest = max((padded(e.nbytes) for e, src in zip(entries, sources) if src.device == device), default=0)
    return max(chunk_bytes, largest)


def ring_bytes(largest_entry: int, graphed: bool = False, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The most device memory a rank's snapshots take, for a largest entry of `largest_entry` bytes: the
    staging ring (`STAGING_SLOTS` slots of the largest chunk: `chunk_bytes`, or that entry alone) and the
    checksum's transient of one slot, which the caching allocator keeps for the copy stream; `graphed`
    (`checkpoint.copy_graph`): one more, the same transient in the captured graphs' memory pool."""
    return (STAGING_SLOTS + 1 + graphed) * word_checksum.block_rounded(max(chunk_bytes, padded(largest_entry)))


@dataclass(frozen=True)
class DevicePlan:
    """How a layout's entries are copied into one pinned buffer from a device, chunk by chunk, the checksums
    of its staged chunks computed in `sums` on the device and brought to `sums_host`."""

    chunks: list[Chunk]
    sums: word_checksum.ChunkSums
    sums_host: torch.Tensor

    @classmethod
    def of(
        cls,
        buffer: torch.Tensor,
        entries: list[Entry],
        sources: list[torch.Tensor],
        chunk_bytes: int,
        slots: tuple[torch.Tensor, ...],
    ) -> DevicePlan:
        """The plan of `entries` (from `sources`) in `buffer`, its padding zeroed; the chunks whose sources are on
        the staging `slots`' device (each slot at least `slot_bytes` long) take the slots in turn, the others
        (host sources) are copied directly."""
        chunks, start = [], 0
        for stop in chunk_ends(entries, chunk_bytes, sources, at_most=True):
            lo, hi = span(entries, start, stop)
            staged = sources[start].device == slots[0].device
            slot = slots[sum(c.slot is not None for c in chunks) % len(slots)] if staged else None
            into = slot if slot is not None else buffer
            targets, srcs = runs(into, entries, sources, start, stop, base=lo if staged else 0)
            words = None
            if slot is not None:
                slot = slot[: word_checksum.block_rounded(hi - lo)]
            else:
                spans = [(e.offset - lo, e.offset - lo + e.nbytes) for e in entries[start:stop]]
                words = word_checksum.SparseWords(spans, hi - lo)
            fills = (hi - lo) % word_checksum.BLOCK_BYTES == 0 and all(
                e.nbytes % BLOCK == 0 for e in entries[start:stop]
            )
            chunks.append(Chunk(start, stop, hi - lo, targets, srcs, buffer[lo:hi], slot, words, not fills))
            start = stop
        zero_padding(buffer, entries)
        device = slots[0].device
        blocks = [c.slot.numel() // word_checksum.BLOCK_BYTES if c.slot is not None else 0 for c in chunks]
        sums_host = torch.zeros(len(chunks), dtype=torch.int64, pin_memory=device.type == "cuda")
        return cls(chunks, word_checksum.ChunkSums(blocks, device), sums_host)

    def issue(
        self, stream: torch.cuda.Stream | None, device_calls: Callable[[], None] | None = None
    ) -> list[str | None]:
        """Training thread: issue the copy on `stream` (None: a CPU staging ring, done on return), after the
        work already issued on the training stream: the host chunks at once, then `device_calls()` on `stream`
        (default: `issue_device`; a CUDA graph's replay: `moevement.storage.copy_graph`). Returns per chunk its
        checksum where the host computed it now (host sources), None where the device does (in `sums_host` once
        the copy is done)."""
        on_host = self.copy_host_chunks()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            (device_calls or (lambda: self.issue_device(non_blocking=stream is not None)))()
        return on_host

    def copy_host_chunks(self) -> list[str | None]:
        """Copy the chunks of host sources now, on the calling thread: per chunk its checksum, None for a staged
        chunk (the device sums it)."""
        return [_copy_on_host(chunk) if chunk.slot is None else None for chunk in self.chunks]

    def issue_device(self, non_blocking: bool) -> None:
        """The staged chunks' calls on the current stream, and the sums' combination and copy to the host: what
        a CUDA graph of the copy captures (`moevement.storage.copy_graph`)."""
        for chunk, block_sums in zip(self.chunks, self.sums.views):
            if chunk.slot is not None:
                _stage(chunk, block_sums, non_blocking)
        self.sums.combine()
        self.sums_host.copy_(self.sums.sums, non_blocking=non_blocking)

    def checksums(self, on_host: list[str | None]) -> list[list]:
        """A header's `checksums` of the copy `issue` returned `on_host` for, once the copy is done."""
        device = self.sums_host.tolist()
        return [
            [c.start, c.stop, value if value is not None else word_checksum.finish(device[k], c.nbytes)]
            for k, (c, value) in enumerate(zip(self.chunks, on_host))
        ]


def _copy_on_host(chunk: Chunk) -> str:
    """Copy a chunk of host sources into the buffer and sum its entries' words: its checksum."""
    torch._foreach_copy_(chunk.targets, chunk.sources)
    return chunk.words.checksum(chunk.host)


def _stage(chunk: Chunk, block_sums: torch.Tensor, non_blocking: bool) -> None:
    """Gather a staged chunk into its slot, copy the slot into the buffer, and sum its blocks into `block_sums`."""
    if chunk.zeroed:  # else the gather writes every byte of the slot's blocks
        chunk.slot.zero_()
    torch._foreach_copy_(chunk.targets, chunk.sources)
    chunk.host.copy_(chunk.slot[: chunk.nbytes], non_blocking=non_blocking)
    word_checksum.block_sums(chunk.slot, out=block_sums)


class IssuedCopy:
    """A snapshot whose copy the training thread issued (`DevicePlan.issue`): done on the device at `done`.

    Threads: the training thread's alone. It keeps the sources alive until the copy is done: a source freed
    earlier could be reused by the training stream while the copy stream still reads it."""

    def __init__(self, plan, header: SnapshotHeader, encoded: bytes, sources, stream) -> None:
        """`plan`: a `DevicePlan`, or a `moevement.storage.copy_graph.GraphedPlan` (same `issue`, `checksums`)."""
        self.plan, self.header, self.encoded, self.sources = plan, header, encoded, sources
        header.checksum_format = word_checksum.FORMAT
        with measure("copy"):
            self.on_host = plan.issue(stream)
        self.done: torch.cuda.Event | None = None
        self.device = stream.device if stream is not None else None
        if stream is not None:
            self.done = torch.cuda.Event()
            self.done.record(stream)

    def order_step(self) -> None:
        """Before the optimizer step: the training stream waits for the copy on the device (no host wait)."""
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)

    def result(self) -> EncodedHeader:
        """The header, checksums in, but for `meta`, once the copy is done (waits for it on the host)."""
        if self.done is not None:
            with measure("copy"):
                self.done.synchronize()
        self.sources = None
        self.header.checksums = self.plan.checksums(self.on_host)
        with measure("header"):
            return self.header.encode_without_meta(self.encoded)

    def exception(self) -> BaseException | None:
        """The copy has ended; its error, if any."""
        try:
            if self.done is not None:
                self.done.synchronize()
        except Exception as e:  # noqa: BLE001 - a dead peer's or a device error, reported to the caller
            return e
        return None
