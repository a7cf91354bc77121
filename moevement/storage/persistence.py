"""Optional disk persistence of persisted sparse checkpoints, for whole-job restarts.

Layout: `<persist_dir>/<job>/window-<start:08d>/rank<r:05d>/s<slot>.bin` with the snapshot's
self-describing JSON header beside it (`s<slot>.json`: entries, dtypes, shapes, checksums, metadata,
the identity of the run). A rank's directory is written under a fresh temporary name (owner-only,
files created exclusively) and renamed when complete; a checkpoint is complete when every rank's
directory exists. Each rank keeps its two newest windows, so a
checkpoint other ranks are still writing never costs the previous complete one (MoC keeps
more: its stale experts live in older windows).
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import torch

from moevement.storage.background import enter_background
from moevement.storage.cpu_cost import measure
from moevement.storage.host_memory import private_subdirs, read_header, remove_tree
from moevement.storage.private_files import (
    HostMemoryError,
    check_private,
    make_private_dir,
    no_space,
    open_private,
    write_json_atomic,
)
from moevement.storage.snapshot import CommitRecord, SnapshotError, SnapshotHeader, read_entries

KEEP = 2  # newest windows kept per rank


def window_dir(root: Path, window_start: int) -> Path:
    return root / f"window-{window_start:08d}"


def write_window(root: Path, rank: int, snapshots: list[tuple[CommitRecord, torch.Tensor]]) -> Path:
    """Write one rank's snapshots of a window (headers + bytes); returns the rank directory. A full or
    unwritable disk is a HostMemoryError naming the directory and the bytes needed, and nothing of the
    window stays behind."""
    start = snapshots[0][0].window_start
    final = make_private_dir(window_dir(root, start)) / f"rank{rank:05d}"
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        _write_snapshots(tmp, snapshots)
        remove_tree(final, root)
        os.replace(tmp, final)
    except BaseException as e:
        if tmp is not None:
            remove_tree(tmp, root)
        if isinstance(e, OSError):
            needed = sum(commit.nbytes for commit, _ in snapshots)
            raise no_space(final.parent, f"the sparse checkpoint of window {start}", needed, e) from None
        raise
    return final


def _write_snapshots(directory: Path, snapshots: list[tuple[CommitRecord, torch.Tensor]]) -> None:
    for commit, payload in snapshots:
        path = directory / f"s{commit.slot}.bin"
        fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "wb") as f:
            f.write(payload[: commit.nbytes].numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        write_json_atomic(path.with_suffix(".json"), commit.parts)


def read_window(rank_dir: Path) -> list[tuple[SnapshotHeader, dict[tuple[str, str], torch.Tensor]]]:
    """Every snapshot of a persisted rank directory, in slot order, checksums verified."""
    try:
        check_private(rank_dir)
    except HostMemoryError as e:
        raise SnapshotError(str(e)) from None
    headers = sorted((p for p in rank_dir.glob("s*.json") if p.stem[1:].isdigit()), key=lambda p: int(p.stem[1:]))
    if not headers:
        raise SnapshotError(f"{rank_dir}: no snapshots")
    out = []
    for path in headers:
        try:
            header = SnapshotHeader.from_json(read_header(path.with_suffix("")))
            fd = open_private(path.with_suffix(".bin"), os.O_RDONLY)
        except HostMemoryError as e:
            raise SnapshotError(str(e)) from None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        # an empty slot (a stage with fewer operators than slots) is a 0-byte file; frombuffer refuses b""
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        out.append((header, read_entries(raw, header, source=str(path.with_suffix(".bin")))))
    return out


class DiskWriter:
    """Writes windows on a background thread; `busy(parity)` says whether a window's buffers are still read."""

    def __init__(self, root: Path, rank: int, keep: int = KEEP, priority: str = "idle"):
        self.root, self.rank, self.keep, self.priority = make_private_dir(root), rank, keep, priority
        self.threads: dict[int, threading.Thread] = {}
        self.error: BaseException | None = None

    def submit(self, parity: int, snapshots: list[tuple[CommitRecord, torch.Tensor]]) -> None:
        self.wait(parity)
        thread = threading.Thread(target=self._write, args=(snapshots,), name="moevement-persist", daemon=True)
        self.threads[parity] = thread
        thread.start()

    def busy(self, parity: int) -> bool:
        """Whether a window of this parity is still being written (its buffers read)."""
        thread = self.threads.get(parity)
        return thread is not None and thread.is_alive()

    def wait(self, parity: int) -> None:
        thread = self.threads.pop(parity, None)
        if thread is not None:
            thread.join()
        if isinstance(self.error, HostMemoryError):
            raise self.error  # one line: the directory and the bytes it needed
        if self.error is not None:
            raise RuntimeError(f"writing a sparse checkpoint under {self.root} failed") from self.error

    def close(self) -> None:
        for parity in list(self.threads):
            self.wait(parity)

    def _write(self, snapshots: list[tuple[CommitRecord, torch.Tensor]]) -> None:
        try:
            enter_background(self.priority)
            with measure("persistence"):
                self._write_and_prune(snapshots)
        except BaseException as e:
            self.error = e

    def _write_and_prune(self, snapshots: list[tuple[CommitRecord, torch.Tensor]]) -> None:
        """Write one window of this rank, then remove its windows beyond the newest `keep`."""
        write_window(self.root, self.rank, snapshots)
        mine = private_subdirs(self.root, "window-", f"rank{self.rank:05d}")
        for old in mine[: -self.keep]:
            remove_tree(old, self.root)
            try:
                old.parent.rmdir()
            except OSError:  # other ranks' directories are still there
                pass
