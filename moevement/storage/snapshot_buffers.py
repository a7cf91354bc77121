"""A rank's own snapshot buffers, the thread that copies snapshots into them and the one that grows them.

Two sets of buffers (window parity) of one buffer per slot: the set of the newest persisted window
is kept while the next window's snapshots are copied into the other. Buffers only grow, and never
while a copy into them is due: `reserve_ahead` grows a set on the prefault thread ahead of the window
that needs it, which starts once `ready` says the set holds it; `reserve` grows a set on the calling
thread at once (start-up, and windows that cannot wait).

On a CPU the copy thread copies and hashes each snapshot (`copy`, submitted with `submit`); on a GPU the
training thread issues it on a side stream through a device staging ring (`issue`,
`moevement.storage.device_copy`) and the copy thread only writes snapshots a restart adopts.

Threads: `buffer`, `reserve`, `reserve_ahead`, `ready` and `issue` run on the training thread, `invalidate`
also on the replication thread, the copies submitted with `submit` on the copy thread and the growth
`reserve_ahead` asks for on the prefault thread (one worker each, background priority: see
`moevement.storage.background`). The buffer table is guarded by `lock`; a buffer's bytes are
written only by one snapshot's copy, and only after the window that owned them is garbage; a buffer
grows under its own lock (`HostBuffer.ensure`), its old mapping valid for whoever still holds it.
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from moevement.storage.background import enter_background
from moevement.storage.copy_graph import GraphedPlan
from moevement.storage.cpu_cost import measure
from moevement.storage.device_copy import DevicePlan, IssuedCopy, slot_bytes, staged_chunk_bytes
from moevement.storage.host_memory import HostBuffer
from moevement.storage.private_files import HostMemoryError, make_private_dir
from moevement.storage.snapshot import (
    CHUNK_BYTES,
    STAGING_SLOTS,
    EncodedHeader,
    Entry,
    SnapshotHeader,
    encode_entries,
)
from moevement.storage.snapshot_copy import CopyPlan, Throttle, copy_entries

Plan = CopyPlan | DevicePlan | GraphedPlan  # how a layout is copied into one buffer


def local_buffer(rank_dir: Path, parity: int, slot: int) -> Path:
    """Path (no suffix) of a rank's own snapshot buffer for window parity `parity`, slot `slot`."""
    return rank_dir / "local" / f"w{parity}-s{slot}"


class SnapshotBuffers:
    def __init__(
        self,
        rank_dir: Path,
        device: torch.device,
        background_priority: str,
        staged: bool | None = None,
        graphed: bool = False,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        """`staged`: snapshots are issued through a staging ring on `device` (default: on a GPU; a test may
        run that path on a CPU, synchronously); `graphed`: on a GPU, as one CUDA graph per plan from its second
        issue on (`moevement.storage.copy_graph`); `chunk_bytes`: the copy and checksum granularity."""
        self.rank_dir, self.pin = rank_dir, device.type == "cuda"
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # what the sources' `.device` says
        self.device, self.staged = device, device.type == "cuda" if staged is None else staged
        self.local_dir = make_private_dir(rank_dir / "local")
        self.lock = threading.Lock()
        self.buffers: dict[tuple[int, int], HostBuffer] = {}
        self._cache: dict[Path, tuple[torch.Tensor, list[Entry], list[torch.Tensor], Plan, bytes]] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.graph_pool = torch.cuda.graph_pool_handle() if graphed and self.stream is not None else None
        self.chunk_bytes = chunk_bytes
        self.slots: tuple[torch.Tensor, ...] = ()  # the staging ring: grown to the largest chunk a plan needs
        self.copier = ThreadPoolExecutor(
            1, thread_name_prefix="moevement-copy", initializer=enter_background, initargs=(background_priority,)
        )
        self.prefaulter = ThreadPoolExecutor(
            1, thread_name_prefix="moevement-prefault", initializer=enter_background, initargs=(background_priority,)
        )
        self._growing: dict[int, Future] = {}  # by parity: its newest growth asked of the prefault thread

    def buffer(self, parity: int, slot: int) -> HostBuffer:
        with self.lock:
            key = (parity, slot)
            if key not in self.buffers:
                self.buffers[key] = HostBuffer(local_buffer(self.rank_dir, parity, slot), pin=self.pin)
            return self.buffers[key]

    def reserve(self, parity: int, sizes: list[int]) -> None:
        """Grow the set of window parity `parity` to these per-slot sizes (and fault them in) on this thread,
        or refuse if host memory is short."""
        self.wait_for_growth(parity)
        if self.ready(parity, sizes):
            return  # mapped already (every window after the first at a steady W)
        for buf, nbytes in zip(self._room_for(parity, sizes), sizes):
            buf.ensure(nbytes)

    def reserve_ahead(self, parity: int, sizes: list[int]) -> None:
        """Have the prefault thread grow the set of window parity `parity` to at least these per-slot sizes
        (after what it was asked before), or refuse now if host memory is short; `ready` says when it holds
        them."""
        if not self.ready(parity, sizes):
            self._growing[parity] = self.prefaulter.submit(self._grow, self._room_for(parity, sizes), sizes)

    def ready(self, parity: int, sizes: list[int]) -> bool:
        """Whether the set of window parity `parity` holds these per-slot sizes (a growth that failed raises
        its error here)."""
        growing = self._growing.get(parity)
        if growing is not None and growing.done():
            del self._growing[parity]
            growing.result()
        return all(n <= self.buffer(parity, slot).capacity for slot, n in enumerate(sizes))

    def wait_for_growth(self, parity: int) -> None:
        """Block until the growth asked for the set of window parity `parity`, if any, is done."""
        growing = self._growing.pop(parity, None)
        if growing is not None:
            growing.result()

    def _room_for(self, parity: int, sizes: list[int]) -> list[HostBuffer]:
        """The set's buffers for these per-slot sizes; HostMemoryError if the host directory cannot hold
        what they still need (pages another process left count as theirs)."""
        held = [self.buffer(parity, slot) for slot in range(len(sizes))]
        grow = sum(max(0, n - buf.reserved()) for buf, n in zip(held, sizes))
        free = shutil.disk_usage(self.local_dir).free
        if grow > free:
            raise HostMemoryError(
                f"a window of W={len(sizes)} snapshots needs {grow / 1e9:.2f} GB more host memory in "
                f"{self.local_dir} ({free / 1e9:.2f} GB free): set checkpoint.window lower, raise "
                f"checkpoint.bandwidth_gbps, or train with training.mixed_precision bf16 (smaller compute weights)"
            )
        return held

    @staticmethod
    def _grow(held: list[HostBuffer], sizes: list[int]) -> None:
        """Prefault thread: grow each buffer to its size, its pages faulted in."""
        with measure("prefault"):
            for buf, nbytes in zip(held, sizes):
                buf.ensure(nbytes)

    def invalidate(self, parity: int) -> None:
        """The snapshots of this parity are garbage (their commit records go)."""
        with self.lock:
            stale = [buf for (p, _), buf in self.buffers.items() if p == parity]
        for buf in stale:
            buf.invalidate()

    def copy(
        self, buffer: HostBuffer, header: SnapshotHeader, sources: list[torch.Tensor], throttle: Throttle
    ) -> EncodedHeader:
        """Copy thread (CPU): copy a snapshot's tensors into `buffer`, uncommitted, and encode its header,
        checksums in, but for `meta` (`header.entries` are its layout's, unchanged)."""
        buffer.invalidate()
        data = buffer.ensure(max(header.nbytes, 1))
        plan, encoded = self._resolved(buffer, data, header.entries, sources)
        header.checksums = copy_entries(data, header.entries, sources, throttle, plan=plan)
        with measure("header"):
            return header.encode_without_meta(encoded)

    def issue(self, buffer: HostBuffer, header: SnapshotHeader, sources: list[torch.Tensor]) -> IssuedCopy:
        """Training thread (`staged`): issue the copy of a snapshot's tensors into `buffer`, uncommitted, after
        the work already issued on the training stream; the header is encoded once it is done."""
        buffer.invalidate()
        data = buffer.ensure(max(header.nbytes, 1))
        plan, encoded = self._resolved(buffer, data, header.entries, sources)
        return IssuedCopy(plan, header, encoded, sources, self.stream)

    def _resolved(
        self, buffer: HostBuffer, data: torch.Tensor, entries: list[Entry], sources: list[torch.Tensor]
    ) -> tuple[Plan, bytes]:
        """The copy plan of `entries` (from `sources`) in `data` and their encoding, reused while the buffer
        holds the same mapping and the same layout (one layout per slot serves every window a plan repeats)."""
        cached = self._cache.get(buffer.path)
        if cached is not None and cached[0] is data and cached[1] is entries and cached[2] is sources:
            return cached[3], cached[4]
        if self.staged:
            chunk = staged_chunk_bytes(entries, sources, self.chunk_bytes, self.device)
            plan = DevicePlan.of(data, entries, sources, chunk, self._ring(entries, sources, chunk))
            if self.graph_pool is not None:
                plan = GraphedPlan(plan, self.graph_pool)
        else:
            plan = CopyPlan.of(data, entries, sources, self.chunk_bytes)
        encoded = encode_entries(entries)
        self._cache[buffer.path] = (data, entries, sources, plan, encoded)
        return plan, encoded

    def _ring(self, entries: list[Entry], sources: list[torch.Tensor], chunk: int) -> tuple[torch.Tensor, ...]:
        """The staging ring's slots, grown (and the plans on the old ring forgotten) if this layout's largest
        chunk (of at most `chunk` bytes) needs longer ones. The ring lives on the sources' device."""
        need = slot_bytes(entries, sources, chunk, self.device)
        if not self.slots or self.slots[0].numel() < need:
            self._cache.clear()
            self.slots = ()  # the old ring goes before the new one is allocated
            ring = torch.zeros(STAGING_SLOTS * max(need, 1), dtype=torch.uint8, device=self.device)
            self.slots = ring.chunk(STAGING_SLOTS)
        return self.slots

    def submit(self, fn, *args) -> Future:
        return self.copier.submit(fn, *args)

    def all(self) -> list[HostBuffer]:
        with self.lock:
            return list(self.buffers.values())

    def nbytes(self) -> int:
        return sum(b.capacity for b in self.all())

    def close(self) -> None:
        self.copier.shutdown()
        self.prefaulter.shutdown(cancel_futures=True)
        self._growing.clear()
        self._cache.clear()
        self.slots = ()
