"""Reusable host-memory buffers for snapshots and replicas, and their commit records.

On CPU a buffer is a file in a shared-memory directory (`/dev/shm` by default), mapped into the
process: it outlives a crashed training process, so a restarted job (or a test) can read it.
On GPU the same mapping is page-locked (pinned) for asynchronous device-to-host copies.

A buffer's bytes become meaningful only through its header, a JSON commit record written to a
temporary name and renamed once the bytes are complete (and removed before they are overwritten),
so a crash mid-copy never leaves a snapshot that looks complete. Files and directories are
owner-only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


class HostMemoryError(RuntimeError):
    """Snapshot host memory cannot be reserved (the shared-memory directory is full)."""


def make_private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def encode_json(payload: dict) -> bytes:
    """`payload` as JSON bytes (`json.dumps` runs the C encoder; `json.dump` to a file does not: ~5x slower)."""
    return json.dumps(payload).encode()


def write_json_atomic(path: Path, payload: dict | bytes) -> None:
    """Write `payload` (a dict, or its `encode_json` bytes) to `path` via a temporary file and a rename
    (owner-only permissions)."""
    data = payload if isinstance(payload, bytes) else encode_json(payload)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class HostBuffer:
    """A growable byte buffer backed by the file `<path>.bin`, with its header at `<path>.json`."""

    def __init__(self, path: Path, pin: bool = False):
        self.path, self.pin = path, pin
        self.data = torch.empty(0, dtype=torch.uint8)
        self._pinned_ptr: int | None = None

    @property
    def header_path(self) -> Path:
        return self.path.with_suffix(".json")

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def ensure(self, nbytes: int) -> torch.Tensor:
        """At least `nbytes` of mapped memory (kept across calls; grows, never shrinks)."""
        if nbytes > self.capacity:
            self._unpin()
            bin_path = self.path.with_suffix(".bin")
            fd = os.open(bin_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                # Reserve the pages now: a full /dev/shm must fail here, not SIGBUS a later copy.
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                free = shutil.disk_usage(bin_path.parent).free
                raise HostMemoryError(f"{bin_path}: cannot reserve {nbytes / 1e9:.2f} GB of host memory "
                                      f"({free / 1e9:.2f} GB free there: {e.strerror})") from None
            finally:
                os.close(fd)
            old = self.capacity
            self.data = torch.from_file(str(bin_path), shared=True, size=nbytes, dtype=torch.uint8)
            self.data[old:].zero_()  # fault the new pages in now, not during a later overlapped copy
            if self.pin:
                self._pinned_ptr = self.data.data_ptr()
                torch.cuda.cudart().cudaHostRegister(self._pinned_ptr, nbytes, 0)
        return self.data

    def release(self) -> None:
        """Unpin and drop the mapping (a pinned range must be unregistered before it is unmapped)."""
        self._unpin()
        self.data = torch.empty(0, dtype=torch.uint8)

    def invalidate(self) -> None:
        """Remove the commit record before the bytes are overwritten."""
        self.header_path.unlink(missing_ok=True)

    def commit(self, header: dict | bytes) -> None:
        """Record the bytes as complete with `header` (a dict or its JSON encoding)."""
        write_json_atomic(self.header_path, header)

    def _unpin(self) -> None:
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None


def read_header(path: Path) -> dict | None:
    """The committed header of the buffer at `path` (no suffix), or None if there is none."""
    try:
        return json.loads(path.with_suffix(".json").read_text())
    except FileNotFoundError:
        return None


def map_bytes(path: Path) -> torch.Tensor:
    """The bytes of the buffer file `<path>.bin`, mapped read-write (no copy)."""
    bin_path = path.with_suffix(".bin")
    return torch.from_file(str(bin_path), shared=True, size=bin_path.stat().st_size, dtype=torch.uint8)
