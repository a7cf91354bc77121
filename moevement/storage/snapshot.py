"""Snapshot `SS_t`: layout in a flat byte buffer, per-chunk checksums, reading back (the copy itself:
`moevement.storage.snapshot_copy`).

`SS_t` (docs/design/state-and-snapshots.md) is taken of `state_t` during iteration t and holds, for slot `i = t - t0`,
the FP32 master weights, buffers and optimizer state (with step counters) of the slot's operators
("master" entries) and the compute weights of the operators of later slots ("compute" entries,
cast to the compute dtype while copying), plus the iteration's metadata. The header is
self-describing JSON: every entry's operator, name, dtype, shape and byte range, and the checksum of
every *chunk*: consecutive entries of about `checkpoint.chunk_mb` (padding included), copied with one call and
hashed with one. Entries lie in storage order: the slices of a stacked tensor one after another, so that
they are copied as one run. A checksum per chunk instead of per entry keeps the copy thread's calls, and so its
hand-overs of the GIL to a training thread that takes it at every kernel launch, proportional to the
snapshot's bytes rather than to its thousands of small entries.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import xxhash

from moevement.operators import LocalViews, Operator
from moevement.storage import word_checksum
from moevement.storage.private_files import encode_json

BLOCK = 1024  # entries start on block boundaries (aligned copies; zeroed padding)
# copy and checksum granularity (`checkpoint.chunk_mb`'s default): per chunk, a CPU's copy thread makes one copy
# call and one hash call, a GPU's training thread one gather, one device-to-host copy and one device checksum;
# the bandwidth cap is enforced between chunks
CHUNK_BYTES = 64 << 20
STAGING_SLOTS = 2  # a GPU snapshot gathers its chunks into a device ring of this many slots (and sums them there)
FORMAT = "chunk-xxh3"  # what a header's `checksums` are: XXH3-64 per chunk (older headers: one per entry)


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


class EntryTable(Protocol):
    """What reading a buffer back needs of its header: its entries, its chunks' checksums, its size, and
    the iteration it holds the state of (named in errors). `SnapshotHeader` is one, a survivor's
    `LiveHeader` another."""

    @property
    def iteration(self) -> int: ...

    @property
    def entries(self) -> list[Entry]: ...

    @property
    def checksums(self) -> list[list]: ...

    @property
    def checksum_format(self) -> str: ...

    @property
    def nbytes(self) -> int: ...


def entries_of(payload: dict, what: str) -> list[Entry]:
    """The entries of a header's JSON `payload` (a `what`), refusing a header of the older format (a
    checksum per entry) with one line."""
    if payload.get("checksum_format") not in CHECKSUMS:
        raise SnapshotError(
            f"{what} of an older format (a checksum per tensor, not per chunk): not read; it was written by an "
            "earlier version of the trainer"
        )
    return [Entry(**e) for e in payload["entries"]]


@dataclass
class SnapshotHeader:
    iteration: int
    window_start: int
    slot: int
    window: int  # W, the window's size (named `window_size` elsewhere; this key is the on-disk format's)
    rank: int
    active: list[str]  # operators whose FP32 state this snapshot holds (slot `slot`)
    frozen: list[str]  # operators whose compute weights it holds (later slots)
    entries: list[Entry]
    nbytes: int
    meta: dict = field(default_factory=dict)  # data position, RNG seeds, scalar log of `iteration`
    checksums: list[list] = field(default_factory=list)  # [first entry, end entry, checksum] per chunk
    checksum_format: str = FORMAT  # XXH3-64 (a CPU's copy) or word_checksum.FORMAT (a GPU's): `CHECKSUMS`

    def to_json(self) -> dict:
        """A JSON-ready copy (`dataclasses.asdict` would deep-copy ~1000 entries: ~25 ms per snapshot)."""
        entries = [dict(vars(e)) for e in self.entries]
        return {"entries": entries, **self._fields(), "meta": copy.deepcopy(self.meta)}

    def encode_without_meta(self, entries: bytes | None = None) -> EncodedHeader:
        """The commit record but for `meta`, encoded: the copy thread prepares it once the checksums are in,
        and the training thread adds the iteration's `meta` (`EncodedHeader.with_meta`). `entries`: this
        header's entries as JSON, encoded once for their layout (`encode_entries`), kept as a part of their
        own (never copied into the record: `CommitRecord.parts`). The entries come first, so every record
        of a layout begins with the same parts (`moevement.storage.commit_file` rewrites only the rest)."""
        body = entries if entries is not None else encode_entries(self.entries)
        fields = encode_json(self._fields())
        return EncodedHeader(self.slot, self.window_start, self.nbytes, (_ENTRIES_KEY, body, b", " + fields[1:-1]))

    def commit_record(self) -> CommitRecord:
        """The whole header as committed (its checksums already in)."""
        return self.encode_without_meta().with_meta(self.meta)

    def _fields(self) -> dict:
        """Every field but `entries` and `meta`, which the encoding puts first and last."""
        fields = {**vars(self), "active": list(self.active), "frozen": list(self.frozen)}
        del fields["entries"], fields["meta"]
        return fields

    @classmethod
    def from_json(cls, payload: dict) -> SnapshotHeader:
        try:
            return cls(**{**payload, "entries": entries_of(payload, "snapshot header")})
        except (KeyError, TypeError) as e:
            raise SnapshotError(f"malformed snapshot header: {e}") from None


@dataclass(frozen=True)
class CommitRecord:
    """A committed snapshot as persistence and replication need it: where it belongs, its byte size, and
    the exact bytes of its header (what its `.json` holds, sealed), as the parts that make them up in order:
    the layout's entries are one, shared by every snapshot of the layout, and a writer writes the parts
    without joining them (`moevement.storage.sealed.seal_parts`)."""

    slot: int
    window_start: int
    nbytes: int
    parts: tuple[bytes, ...]

    @property
    def encoded(self) -> bytes:
        """The header's bytes, joined (a copy: for a reader, not for the training thread)."""
        return b"".join(self.parts)


@dataclass(frozen=True)
class EncodedHeader:
    """A snapshot's header without `meta` (`SnapshotHeader.encode_without_meta`): where it belongs, and
    its JSON encoding without the closing brace, in parts."""

    slot: int
    window_start: int
    nbytes: int
    parts: tuple[bytes, ...]

    def with_meta(self, meta: dict, encode: Callable[[dict], bytes] = encode_json) -> CommitRecord:
        """The whole header, encoded byte for byte as `encode_json(header.to_json())` for a header with this
        `meta`: only `meta` is encoded here, by `encode` (`encode_json`, or a `MetaEncoder`'s as fast)."""
        parts = (*self.parts, b', "meta": ', encode(meta), b"}")
        return CommitRecord(self.slot, self.window_start, self.nbytes, parts)


class MetaEncoder:
    """Encodes snapshot `meta`s as `encode_json` does, byte for byte, with the job's part encoded once.

    Every `meta` of a rank's snapshots begins with the same job metadata (`job`: seed, place, run identity,
    about 2 KB), then the iteration's own keys. A `meta` whose leading items are `job`'s very keys and value
    objects is encoded as `job`'s encoding followed by the rest's; any other `meta`, whole. `job`, nested
    values included, is never changed after (the checkpointer holds its own copy)."""

    def __init__(self, job: dict):
        self.job = list(job.items())
        self.head = encode_json(job)[:-1]  # without its closing brace

    def encode(self, meta: dict) -> bytes:
        n = len(self.job)
        items = list(meta.items())
        if not n or len(items) <= n or any(k != jk or v is not jv for (k, v), (jk, jv) in zip(items, self.job)):
            return encode_json(meta)
        return self.head + b", " + encode_json(dict(items[n:]))[1:]


_ENTRIES_KEY = b'{"entries": '  # how every commit record begins: one object, shared by all of them


def encode_entries(entries: list[Entry]) -> bytes:
    """A layout's entries as JSON: encoded once per layout, spliced into the header of each of its snapshots."""
    return encode_json([dict(vars(e)) for e in entries])


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
    their source tensors; the total byte size.

    Entries of one role whose sources share a storage lie together, in storage order (the slices of a stacked
    tensor, and a step counter every slice names, as consecutive runs); roles and storages keep the order in
    which `items` first name them, so a layout does not depend on where tensors happen to live."""
    entries, sources, offset = [], [], 0
    for op, name, role, src, dtype in _storage_order(list(items)):
        nbytes = src.numel() * dtype.itemsize
        entries.append(Entry(op, name, role, _dtype_name(dtype), list(src.shape), offset, nbytes))
        sources.append(src)
        offset += padded(nbytes)
    return entries, sources, offset


def _storage_order(items: list[tuple[str, str, str, torch.Tensor, torch.dtype]]) -> list:
    """`items` grouped by role, then by source storage, each group in storage-offset order (stable). Where some
    sources live on an accelerator, those on the host (a GPU optimizer's step counters) come last in their
    role: a chunk holds sources of one device, so interleaved they would cut the device's bytes into a chunk
    per tensor."""
    groups = [(role, src.untyped_storage().data_ptr()) for _, _, role, src, _ in items]
    first_seen: dict[tuple[str, int], int] = {}
    for i, group in enumerate(groups):
        first_seen.setdefault(group, i)
    roles = {role: n for n, role in enumerate(dict.fromkeys(role for role, _ in groups))}
    on_host = [src.device.type == "cpu" for _, _, _, src, _ in items]
    host_last = not all(on_host)
    order = sorted(
        range(len(items)),
        key=lambda i: (
            roles[groups[i][0]],
            host_last and on_host[i],
            first_seen[groups[i]],
            items[i][3].storage_offset(),
            i,
        ),
    )
    return [items[i] for i in order]


def padded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def entry_bytes(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The entry's bytes inside `buffer` (a uint8 tensor), without copying."""
    return buffer[entry.offset : entry.offset + entry.nbytes]


def stored_dtype(entry: Entry) -> torch.dtype:
    """The dtype an entry is stored in (SnapshotError for a name that is not one)."""
    return _dtype(entry.dtype)


def entry_view(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The entry's tensor inside `buffer`, without copying."""
    return entry_bytes(buffer, entry).view(stored_dtype(entry)).view(entry.shape)


def span(entries: list[Entry], start: int, stop: int) -> tuple[int, int]:
    """The bytes of entries `start:stop` (laid out one after another) with their padding."""
    return entries[start].offset, entries[stop - 1].offset + padded(entries[stop - 1].nbytes)


def checksum(data: memoryview) -> str:
    """XXH3-64 of these bytes, as 16 hex digits.

    A real hash (every bit of every byte, order and length included): compensating flips or swapped
    words that a sum passes change it. xxHash hashes at memory speed and releases the GIL while it does."""
    return xxhash.xxh3_64_hexdigest(data)


CHECKSUMS = {FORMAT: checksum, word_checksum.FORMAT: word_checksum.checksum}  # a header's format -> its function


def checksum_gbps(nbytes: int = 64 << 20, tries: int = 3) -> float:
    """`checksum`'s throughput on one core of this CPU, in GB/s (the best of `tries` hashes of `nbytes`)."""
    data = memoryview(bytearray(nbytes))
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        checksum(data)
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9) / 1e9


def verify_entries(buffer: torch.Tensor, header: EntryTable, source: str = "snapshot") -> None:
    """Raise SnapshotError (naming `source`) unless the entries of `header` lie one after another, aligned,
    inside `buffer`, and its checksums cover them all, chunk after chunk, each matching its bytes."""
    if buffer.numel() < header.nbytes:
        raise SnapshotError(f"{source}: truncated ({buffer.numel()} bytes, header says {header.nbytes})")
    entries, end = header.entries, 0
    for entry in entries:
        if entry.offset % BLOCK or entry.offset < end:
            raise SnapshotError(f"{source}: entry {entry.name} is not aligned after the one before it")
        end = entry.offset + padded(entry.nbytes)
        if end > header.nbytes:
            raise SnapshotError(f"{source}: entry {entry.name} lies outside the snapshot")
    whole, covered = memoryview(buffer.numpy()), 0
    checksum_of = CHECKSUMS.get(header.checksum_format)
    if checksum_of is None:
        raise SnapshotError(f"{source}: unknown checksum format {header.checksum_format!r}")
    for chunk in header.checksums:
        if not (isinstance(chunk, list) and len(chunk) == 3 and chunk[0] == covered and covered < chunk[1]):
            raise SnapshotError(f"{source}: malformed checksum list at tensor {covered}")
        start, stop, value = chunk
        if stop > len(entries):
            raise SnapshotError(f"{source}: a checksum covers tensors beyond the {len(entries)} it holds")
        lo, hi = span(entries, start, stop)
        if checksum_of(whole[lo:hi]) != value:
            first, last = entries[start], entries[stop - 1]
            which = first.name if stop - start == 1 else f"{first.name} .. {last.name}"
            raise SnapshotError(
                f"{source}: checksum mismatch in {first.role} tensor(s) {which} (iteration {header.iteration})"
            )
        covered = stop
    if covered != len(entries):
        raise SnapshotError(f"{source}: its checksums cover {covered} of its {len(entries)} tensors")


def read_entries(
    buffer: torch.Tensor, header: EntryTable, source: str = "snapshot", verify: bool = True
) -> dict[tuple[str, str], torch.Tensor]:
    """{(role, tensor name): tensor copy} of a snapshot; checksums verified (SnapshotError names `source`)."""
    if verify:
        verify_entries(buffer, header, source)
    elif buffer.numel() < header.nbytes:
        raise SnapshotError(f"{source}: truncated ({buffer.numel()} bytes, header says {header.nbytes})")
    return {(entry.role, entry.name): entry_view(buffer, entry).clone() for entry in header.entries}
