"""Buffer files mapped ahead of need, kept by the process across the checkpointers it builds
(docs/design/sparse-checkpointing.md).

Mapping a buffer file costs page-table work for every page (`MAP_POPULATE`), and allocating a file's pages costs
far more (the kernel zeroes them; on a virtual machine the host may fault them in too): seconds for the
gigabytes of a `bench_moe` rank. None of that belongs on the training thread. So a process keeps the mappings
it made:

- a checkpointer that is closed for the next generation (`SparseCheckpointer.abandon`: a peer died, the
  survivors rejoin in place) leaves its buffers' mappings here (`keep`), and the next generation's buffers of
  the same files take them back (`take`) instead of mapping them again;
- a rank's start-up, or a warm standby before it is activated as the rank's replacement, maps every buffer file
  the rank's host directory holds (`host_memory.prefault_rank_dir`: an earlier process of the rank, or the
  dead trainer the standby replaces, left them), so its first window faults nothing in.

A mapping is valid for the file it was made of: `take` checks the file's identity (device, inode) and size and
drops a stale mapping (the file was replaced or removed), so a mapping never outlives its usefulness by more
than the next look at its path. `drop_under` releases every mapping under a directory that is removed.

Thread-safe (one lock); a mapping is handed to one buffer at a time.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from moevement.storage.private_files import check_private


@dataclass
class Mapping:
    """`data`, the whole file `identity` (st_dev, st_ino) mapped, page-locked at `pinned` (None: not pinned)."""

    data: torch.Tensor
    identity: tuple[int, int]
    pinned: int | None = None

    def release(self) -> None:
        if self.pinned is not None:
            torch.cuda.cudart().cudaHostUnregister(self.pinned)
            self.pinned = None


def identity(path: Path) -> tuple[tuple[int, int], int] | None:
    """((device, inode), size) of the regular file at `path`, never through a symlink; None if there is none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino), st.st_size


class MappedFiles:
    """The mappings this process keeps for buffer files no buffer holds right now, by the file's path."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[Path, Mapping] = {}

    def keep(self, path: Path, mapping: Mapping) -> None:
        """Keep `mapping` of the file at `path` for a later buffer of it (one already kept is released)."""
        with self._lock:
            old = self._kept.pop(path, None)
            self._kept[path] = mapping
        if old is not None and old is not mapping:
            old.release()

    def take(self, path: Path) -> Mapping | None:
        """The kept mapping of the file at `path` if it still maps that file whole (same identity, same size),
        no longer kept; None otherwise (a stale one is released)."""
        with self._lock:
            mapping = self._kept.pop(path, None)
        if mapping is None:
            return None
        if identity(path) != (mapping.identity, mapping.data.numel()):
            mapping.release()
            return None
        return mapping

    def valid(self, path: Path) -> bool:
        """Whether a mapping of the file at `path` is kept and still maps it whole (a stale one is released)."""
        mapping = self.take(path)
        if mapping is not None:
            self.keep(path, mapping)
        return mapping is not None

    def discard(self, path: Path) -> None:
        """Release the kept mapping of `path`, if any (the file is being removed or replaced)."""
        with self._lock:
            mapping = self._kept.pop(path, None)
        if mapping is not None:
            mapping.release()

    def drop_under(self, directory: Path) -> None:
        """Release the mappings of every file under `directory` (it is being removed)."""
        with self._lock:
            gone = [p for p in self._kept if p.is_relative_to(directory)]
            mappings = [self._kept.pop(p) for p in gone]
        for mapping in mappings:
            mapping.release()

    def drop_stale_under(self, directory: Path) -> None:
        """Release the mappings of files under `directory` that were replaced, resized or removed since."""
        with self._lock:
            under = [p for p in self._kept if p.is_relative_to(directory)]
        for path in under:
            self.valid(path)

    def nbytes(self, under: Path) -> int:
        """The bytes of the mappings kept of files under `under`."""
        with self._lock:
            return sum(m.data.numel() for p, m in self._kept.items() if p.is_relative_to(under))


KEPT = MappedFiles()  # this process's


def map_fd(fd: int, size: int) -> torch.Tensor:
    """`size` bytes of the file `fd`, mapped shared, every page faulted in by the kernel at once
    (MAP_POPULATE: for pages that exist, about 7x cheaper than touching them one fault at a time)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(fd, size, flags=flags), dtype=torch.uint8)  # the tensor keeps the mapping


def buffer_files(rank_dir: Path) -> list[Path]:
    """The buffer files (`*.bin`) of a rank directory: its snapshots (`local/`), the replicas it holds
    (`replicas/from*/`) and the bandwidth probe's (in the directory itself); sorted. Every directory is checked
    before it is listed (`check_private`: owner-only, this user's, never a symlink: HostMemoryError naming it);
    one that does not exist holds nothing."""
    found = []
    for directory in [rank_dir, rank_dir / "local", *_subdirs(rank_dir / "replicas")]:
        found += [p for p in _entries(directory) if p.name.endswith(".bin") and _regular(p)]
    return sorted(found)


def _subdirs(directory: Path) -> list[Path]:
    return [p for p in _entries(directory) if stat.S_ISDIR(os.lstat(p).st_mode)]


def _entries(directory: Path) -> list[Path]:
    """The entries of a checked host-state directory (none if it does not exist)."""
    try:
        check_private(directory)
    except FileNotFoundError:
        return []
    return [Path(e.path) for e in os.scandir(directory)]


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False
