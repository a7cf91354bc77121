"""Snapshot `SS_t`: layout in a flat byte buffer, throttled copy, per-tensor checksums, reading back.

`SS_t` (DESIGN.md §2) is taken of `state_t` during iteration t and holds, for slot `i = t - t0`,
the FP32 master weights, buffers and optimizer state (with step counters) of the slot's operators
("master" entries) and the compute weights of the operators of later slots ("compute" entries,
cast to the compute dtype while copying), plus the iteration's metadata. The header is
self-describing JSON: every entry's operator, name, dtype, shape, byte range and checksum.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from moevement.operators import Operator

ALIGN = 64
CHUNK_BYTES = 4 << 20  # copy granularity; the bandwidth cap is enforced between chunks
MASK = (1 << 64) - 1


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
        return asdict(self)

    @classmethod
    def from_json(cls, payload: dict) -> "SnapshotHeader":
        try:
            entries = [Entry(**e) for e in payload["entries"]]
            return cls(**{**payload, "entries": entries})
        except (KeyError, TypeError) as e:
            raise SnapshotError(f"malformed snapshot header: {e}") from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SnapshotError(f"unknown dtype {name!r} in snapshot header")
    return dtype


def layout(active: list[Operator], frozen: list[Operator], optimizer: torch.optim.Optimizer,
           compute_dtype: torch.dtype) -> tuple[list[Entry], list[torch.Tensor], int]:
    """Entries (without checksums), their source tensors, and the total byte size."""
    entries, sources, offset = [], [], 0

    def add(op: Operator, name: str, role: str, src: torch.Tensor, dtype: torch.dtype) -> None:
        nonlocal offset
        nbytes = src.numel() * dtype.itemsize
        entries.append(Entry(op.name, name, role, _dtype_name(dtype), list(src.shape), offset, nbytes))
        sources.append(src)
        offset += -(-nbytes // ALIGN) * ALIGN

    for op in active:
        for name, tensor in op.master_tensors(optimizer):
            add(op, name, "master", tensor, tensor.dtype)
    for op in frozen:
        for name, tensor in op.compute_tensors():
            add(op, name, "compute", tensor, compute_dtype if tensor.is_floating_point() else tensor.dtype)
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


def entry_bytes(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The entry's bytes inside `buffer` (a uint8 tensor), without copying."""
    return buffer[entry.offset:entry.offset + entry.nbytes]


def entry_view(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The entry's tensor inside `buffer`, without copying."""
    return entry_bytes(buffer, entry).view(_dtype(entry.dtype)).view(entry.shape)


def copy_entries(buffer: torch.Tensor, entries: list[Entry], sources: list[torch.Tensor], throttle: Throttle,
                 stream: "torch.cuda.Stream | None" = None) -> None:
    """Copy (and cast) each source into its entry in chunks, then checksum the copied bytes."""
    for entry, src in zip(entries, sources, strict=True):
        dst = entry_view(buffer, entry).reshape(-1)
        flat = src.reshape(-1)
        step = max(1, CHUNK_BYTES // dst.element_size())
        for lo in range(0, flat.numel(), step):
            dst[lo:lo + step].copy_(flat[lo:lo + step], non_blocking=stream is not None)
            if stream is not None:
                stream.synchronize()
            throttle.consume(min(step, flat.numel() - lo) * dst.element_size())
        entry.checksum = checksum(entry_bytes(buffer, entry))


def checksum(raw: torch.Tensor) -> str:
    """Fletcher-style 64-bit checksum of a uint8 tensor, vectorised (one pass at memory speed).

    Wrapping sums of the 8-byte words, and of 4 KiB block sums weighted by block position, so a
    flipped, lost or moved block changes it; the length is part of it. crc32 costs ~8x more CPU,
    which on CPU training would come straight out of the compute the snapshot overlaps with.
    """
    n = raw.numel()
    words = raw[:n - n % 8].view(torch.int64)
    whole = words.numel() - words.numel() % 512
    blocks = words[:whole].view(-1, 512).sum(dim=1)
    tail = int.from_bytes(raw[n - n % 8:].numpy().tobytes(), "little")
    first = (int(blocks.sum()) + int(words[whole:].sum()) + tail) & MASK
    weights = torch.arange(1, blocks.numel() + 1, dtype=torch.int64)
    second = (int((blocks * weights).sum()) + (blocks.numel() + 1) * (first + n)) & MASK
    return f"{first:016x}{second:016x}"


def read_entries(buffer: torch.Tensor, header: SnapshotHeader, source: str = "snapshot",
                 verify: bool = True) -> dict[tuple[str, str], torch.Tensor]:
    """{(role, tensor name): tensor copy} of a snapshot; checksums verified (SnapshotError names `source`)."""
    if buffer.numel() < header.nbytes:
        raise SnapshotError(f"{source}: truncated ({buffer.numel()} bytes, header says {header.nbytes})")
    out = {}
    for entry in header.entries:
        if entry.offset + entry.nbytes > header.nbytes:
            raise SnapshotError(f"{source}: entry {entry.name} lies outside the snapshot")
        if verify and checksum(entry_bytes(buffer, entry)) != entry.checksum:
            raise SnapshotError(f"{source}: checksum mismatch in {entry.role} tensor {entry.name} "
                                f"(iteration {header.iteration})")
        out[(entry.role, entry.name)] = entry_view(buffer, entry).clone()
    return out
