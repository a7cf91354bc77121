"""Snapshot `SS_t`: layout in a flat byte buffer, throttled copy, per-tensor checksums, reading back.

`SS_t` (docs/design.md §2) is taken of `state_t` during iteration t and holds, for slot `i = t - t0`,
the FP32 master weights, buffers and optimizer state (with step counters) of the slot's operators
("master" entries) and the compute weights of the operators of later slots ("compute" entries,
cast to the compute dtype while copying), plus the iteration's metadata. The header is
self-describing JSON: every entry's operator, name, dtype, shape, byte range and checksum.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import xxhash

from moevement.operators import LocalViews, Operator
from moevement.storage.cpu_cost import measure
from moevement.storage.host_memory import encode_json

BLOCK = 1024  # entries start on block boundaries (aligned copies; zeroed padding)
CHUNK_BYTES = 4 << 20  # copy granularity; the bandwidth cap is enforced between chunks


class SnapshotError(RuntimeError):
    """A snapshot that is incomplete, corrupted or does not match what was asked for."""


@dataclass
class Entry:
    op: str
    name: str  # global tensor name: a parameter, a buffer, or `optim.<param>.<key>`
    role: str  # master | compute
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    checksum: str = ""


class EntryTable(Protocol):
    """What reading a buffer back needs of its header: its entries, its size, and the iteration it holds
    the state of (named in errors). `SnapshotHeader` is one, a survivor's `LiveHeader` another."""

    @property
    def iteration(self) -> int: ...

    @property
    def entries(self) -> list[Entry]: ...

    @property
    def nbytes(self) -> int: ...


@dataclass
class SnapshotHeader:
    iteration: int
    window_start: int
    slot: int
    window: int
    rank: int
    active: list[str]  # operators whose FP32 state this snapshot holds (slot `slot`)
    frozen: list[str]  # operators whose compute weights it holds (later slots)
    entries: list[Entry]
    nbytes: int
    meta: dict = field(default_factory=dict)  # data position, RNG seeds, scalar log of `iteration`

    def to_json(self) -> dict:
        """A JSON-ready copy (`dataclasses.asdict` would deep-copy ~1000 entries: ~25 ms per snapshot)."""
        entries = [dict(vars(e)) for e in self.entries]
        return {**self._fields(), "entries": entries, "meta": copy.deepcopy(self.meta)}

    def encode_without_meta(
        self, entries: EncodedEntries | None = None, checksums: Sequence[str] = ()
    ) -> EncodedHeader:
        """The commit record but for `meta`, encoded: the copy thread prepares it once the checksums are in,
        and the training thread adds the iteration's `meta` (`EncodedHeader.with_meta`). `entries`: this
        header's entries encoded once for their layout, with this snapshot's `checksums` spliced in."""
        body = entries.encode(checksums) if entries is not None else encode_json([dict(vars(e)) for e in self.entries])
        prefix = encode_json(self._fields())[:-1] + b', "entries": ' + body
        return EncodedHeader(self.slot, self.window_start, self.nbytes, prefix)

    def commit_record(self) -> CommitRecord:
        """The whole header as committed (its checksums already in its entries)."""
        return self.encode_without_meta().with_meta(self.meta)

    def _fields(self) -> dict:
        """Every field but `entries` and `meta`, which the encoding puts last, in that order."""
        fields = {**vars(self), "active": list(self.active), "frozen": list(self.frozen)}
        del fields["entries"], fields["meta"]
        return fields

    @classmethod
    def from_json(cls, payload: dict) -> SnapshotHeader:
        try:
            entries = [Entry(**e) for e in payload["entries"]]
            return cls(**{**payload, "entries": entries})
        except (KeyError, TypeError) as e:
            raise SnapshotError(f"malformed snapshot header: {e}") from None


@dataclass(frozen=True)
class CommitRecord:
    """A committed snapshot as persistence and replication need it: where it belongs, its byte size, and
    the exact bytes of its header (what its `.json` holds)."""

    slot: int
    window_start: int
    nbytes: int
    encoded: bytes


@dataclass(frozen=True)
class EncodedHeader:
    """A snapshot's header without `meta` (`SnapshotHeader.encode_without_meta`): where it belongs, and
    its JSON encoding without the closing brace."""

    slot: int
    window_start: int
    nbytes: int
    prefix: bytes

    def with_meta(self, meta: dict) -> CommitRecord:
        """The whole header, encoded byte for byte as `encode_json(header.to_json())` for a header with this
        `meta`: only `meta` is encoded here."""
        encoded = self.prefix + b', "meta": ' + encode_json(meta) + b"}"
        return CommitRecord(self.slot, self.window_start, self.nbytes, encoded)


class EncodedEntries:
    """A layout's entries as JSON, cut where each entry's checksum goes: a snapshot of that layout encodes
    its entries by splicing its checksums in, byte for byte `encode_json` of them with those checksums.
    Encoding ~3000 entries afresh for every snapshot held the GIL for milliseconds on the copy thread."""

    _CUT = b'"\\u0000"'  # a checksum of one NUL character, as JSON encodes it

    def __init__(self, entries: list[Entry]):
        self.entries = entries
        parts = encode_json([{**vars(e), "checksum": "\0"} for e in entries]).split(self._CUT)
        self.parts = parts if len(parts) == len(entries) + 1 else None  # None: a name is a NUL character

    def encode(self, checksums: Sequence[str]) -> bytes:
        if self.parts is None:
            return encode_json([{**vars(e), "checksum": c} for e, c in zip(self.entries, checksums, strict=True)])
        pieces: list[bytes] = [b""] * (2 * len(self.parts) - 1)
        pieces[0::2] = self.parts
        pieces[1::2] = [b'"' + c.encode() + b'"' for c in checksums]
        return b"".join(pieces)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SnapshotError(f"unknown dtype {name!r} in snapshot header")
    return dtype


def entry_layout(
    active: list[Operator],
    frozen: list[Operator],
    optimizer: torch.optim.Optimizer,
    compute_dtype: torch.dtype,
    views: LocalViews | None = None,
) -> tuple[list[Entry], list[torch.Tensor], int]:
    """Entries (without checksums), their source tensors, and the total byte size (tensors resolved
    through `views`, if given)."""
    items = [(op.name, name, "master", t, t.dtype) for op in active for name, t in op.master_tensors(optimizer, views)]
    for op in frozen:
        for name, t in op.compute_tensors(views):
            items.append((op.name, name, "compute", t, compute_dtype if t.is_floating_point() else t.dtype))
    return layout_of(items)


def layout_of(
    items: Iterable[tuple[str, str, str, torch.Tensor, torch.dtype]],
) -> tuple[list[Entry], list[torch.Tensor], int]:
    """Entries for (operator, tensor name, role, source, stored dtype) items, laid out one after another;
    their source tensors; the total byte size."""
    entries, sources, offset = [], [], 0
    for op, name, role, src, dtype in items:
        nbytes = src.numel() * dtype.itemsize
        entries.append(Entry(op, name, role, _dtype_name(dtype), list(src.shape), offset, nbytes))
        sources.append(src)
        offset += _padded(nbytes)
    return entries, sources, offset


class Throttle:
    """Caps the copy rate at `bytes_per_s` (0: unlimited) by sleeping between chunks."""

    def __init__(self, bytes_per_s: float = 0.0):
        self.rate = bytes_per_s
        self.start, self.done = time.perf_counter(), 0

    def consume(self, nbytes: int) -> None:
        self.done += nbytes
        if self.rate > 0:
            ahead = self.done / self.rate - (time.perf_counter() - self.start)
            if ahead > 0:
                time.sleep(ahead)


def _padded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def entry_bytes(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The entry's bytes inside `buffer` (a uint8 tensor), without copying."""
    return buffer[entry.offset : entry.offset + entry.nbytes]


def entry_view(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The entry's tensor inside `buffer`, without copying."""
    return entry_bytes(buffer, entry).view(_dtype(entry.dtype)).view(entry.shape)


@dataclass(frozen=True)
class CopyGroup:
    """Consecutive entries `start:stop` of a layout, about CHUNK_BYTES together, in one buffer: copied
    with one foreach copy and hashed while their bytes are still in cache."""

    start: int
    stop: int
    targets: list[torch.Tensor]  # each entry's typed tensor in the buffer
    pads: list[torch.Tensor]  # the non-empty padding after them
    raw: list[memoryview]  # each entry's bytes, as the hash reads them
    nbytes: int


@dataclass(frozen=True)
class EntryViews:
    """Where a layout's entries lie in one buffer, group by group. Resolving these costs a few tensor
    dispatches per entry; a snapshot of a layout the buffer has held before reuses them
    (`SnapshotBuffers._resolved`), so the copy thread does almost no Python work per entry: every
    moment it holds the GIL is one the training thread may wait for."""

    groups: list[CopyGroup]

    @classmethod
    def of(cls, buffer: torch.Tensor, entries: list[Entry]) -> EntryViews:
        whole = memoryview(buffer.numpy())
        groups, start = [], 0
        for stop in _group_ends(entries):
            part = entries[start:stop]
            targets = [entry_view(buffer, e) for e in part]
            pads = [buffer[e.offset + e.nbytes : e.offset + _padded(e.nbytes)] for e in part if e.nbytes % BLOCK]
            raw = [whole[e.offset : e.offset + e.nbytes] for e in part]
            groups.append(CopyGroup(start, stop, targets, pads, raw, sum(e.nbytes for e in part)))
            start = stop
        return cls(groups)


def copy_entries(
    buffer: torch.Tensor,
    entries: list[Entry],
    sources: list[torch.Tensor],
    throttle: Throttle,
    stream: torch.cuda.Stream | None = None,
    views: EntryViews | None = None,
) -> list[str]:
    """Copy (and cast) each source into its entry, zero the padding, and return every entry's checksum
    (`entries` are not changed: a layout's entries serve many snapshots).

    Entries are copied group by group (`EntryViews`), one foreach copy each (on `stream`, device to host,
    when given), and a group's entries are hashed once its bytes are in (while still in cache on CPU);
    the bandwidth cap is enforced between groups. `views`: the entries' views of `buffer`, if already
    resolved."""
    views = views or EntryViews.of(buffer, entries)
    sums: list[str] = []
    for group in views.groups:
        with measure("copy"):
            torch._foreach_copy_(group.targets, sources[group.start : group.stop], non_blocking=stream is not None)
            if stream is not None:
                stream.synchronize()
            if group.pads:
                torch._foreach_zero_(group.pads)
        with measure("checksum"):
            sums.extend(map(checksum, group.raw))
        throttle.consume(group.nbytes)
    return sums


def with_checksums(entries: list[Entry], sums: list[str]) -> list[Entry]:
    """New entries: `entries` with these checksums."""
    return [
        Entry(e.op, e.name, e.role, e.dtype, e.shape, e.offset, e.nbytes, c) for e, c in zip(entries, sums, strict=True)
    ]


def _group_ends(entries: list[Entry]) -> list[int]:
    """Indices ending consecutive groups of entries of about CHUNK_BYTES each."""
    ends, size = [], 0
    for i, entry in enumerate(entries):
        size += entry.nbytes
        if size >= CHUNK_BYTES or i == len(entries) - 1:
            ends.append(i + 1)
            size = 0
    return ends


def checksums(buffer: torch.Tensor, entries: list[Entry]) -> list[str]:
    """The checksum of every entry's bytes in `buffer` (which holds them all)."""
    if any(e.offset % BLOCK for e in entries):
        raise SnapshotError(f"entries are not aligned to {BLOCK} bytes (a snapshot of an older format)")
    whole = memoryview(buffer.numpy())
    return [checksum(whole[e.offset : e.offset + e.nbytes]) for e in entries]


def checksum(data: memoryview) -> str:
    """XXH3-64 of these bytes, as 16 hex digits.

    A real hash (every bit of every byte, order and length included): compensating flips or swapped
    words that a sum passes change it. xxHash hashes at memory speed and releases the GIL while it does."""
    return xxhash.xxh3_64_hexdigest(data)


def verify_entries(buffer: torch.Tensor, header: EntryTable, source: str = "snapshot") -> None:
    """Raise SnapshotError (naming `source`) unless every entry of `header` lies in `buffer` with its checksum."""
    if buffer.numel() < header.nbytes:
        raise SnapshotError(f"{source}: truncated ({buffer.numel()} bytes, header says {header.nbytes})")
    for entry in header.entries:
        if entry.offset + _padded(entry.nbytes) > header.nbytes:
            raise SnapshotError(f"{source}: entry {entry.name} lies outside the snapshot")
    try:
        found = checksums(buffer, header.entries)
    except SnapshotError as e:
        raise SnapshotError(f"{source}: {e}") from None
    for entry, value in zip(header.entries, found, strict=True):
        if value != entry.checksum:
            raise SnapshotError(
                f"{source}: checksum mismatch in {entry.role} tensor {entry.name} (iteration {header.iteration})"
            )


def read_entries(
    buffer: torch.Tensor, header: EntryTable, source: str = "snapshot", verify: bool = True
) -> dict[tuple[str, str], torch.Tensor]:
    """{(role, tensor name): tensor copy} of a snapshot; checksums verified (SnapshotError names `source`)."""
    if verify:
        verify_entries(buffer, header, source)
    elif buffer.numel() < header.nbytes:
        raise SnapshotError(f"{source}: truncated ({buffer.numel()} bytes, header says {header.nbytes})")
    return {(entry.role, entry.name): entry_view(buffer, entry).clone() for entry in header.entries}
