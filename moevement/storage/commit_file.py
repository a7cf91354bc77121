"""A buffer's commit record file, rewritten in place where a record repeats the one before it.

A snapshot's commit record is nearly all its layout's entries (about 1 MB for a few thousand of them), and
every record of a layout begins with those same bytes (`SnapshotHeader.encode_without_meta`). Writing each
record to a fresh file makes the training thread hash all of it, fill new pages and free the old ones, once
per snapshot. Instead, `retire` (before the buffer's bytes are overwritten) renames the record to a spare,
and the next `write` turns the spare back into a record: it rewrites the seal's digest and whatever follows
the parts the two records share (the very same objects, so the same bytes), truncates, and renames the spare
into place. Only the parts after those shared are hashed again (the hash state after each part is kept).

The digest covers the whole record as this process holds it, so a spare changed in between is refused by
every reader (a seal error), never read as valid. A spare this process did not write (another file, one an
earlier process left) is never written into in place, only over, whole; a name that is not an owner-only
file of this user (a link, a directory) is never written, renamed over or removed: the record then goes to
a fresh file (`write_json_atomic`), and is removed when it retires.

Threads: one writer per file (the training thread for a rank's own buffers, the replication thread for a
replica); `retire` only renames or removes the record, on any thread.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import xxhash

from moevement.storage.private_files import (
    HostMemoryError,
    check_private,
    no_space,
    open_private,
    write_json_atomic,
    write_parts,
)
from moevement.storage.sealed import DIGEST_AT, RECORD_AT, Record, seal_frame


class CommitFile:
    """The commit record at `path`, and its spare while the record is retired."""

    def __init__(self, path: Path, spare: Path):
        self.path, self.spare = path, spare
        self._parts: tuple[bytes, ...] = ()  # the record written last, as its parts
        self._hashes: list[xxhash.xxh3_64] = []  # `_hashes[i]`: the hash state after its first i parts
        # The file written last, held open (so its inode is not reused while it is known), and its size.
        self._fd: int | None = None
        self._inode = (0, 0)  # its st_dev, st_ino
        self._size = 0
        self._retired = False  # retired since the last write: nothing of ours at `path` to retire again

    def retire(self) -> None:
        """The record stops being committed (its bytes are about to be overwritten): it becomes the spare, or
        is removed where the spare's name holds something else than an owner-only file of this user. A second
        call before the next `write` does nothing (a buffer is retired by its window's end and by its next copy)."""
        if self._retired:
            return
        try:
            if self._spare_usable():
                os.rename(self.path, self.spare)
            else:
                self.path.unlink()
        except FileNotFoundError:
            pass
        self._retired = True

    def drop(self) -> None:
        """The record goes, and the spare with it if it is the file this process wrote (its host state is lost)."""
        self.retire()
        if self._held() is not None:
            self.spare.unlink()
        self.close()

    def close(self) -> None:
        """Forget the file and the record written last: the next record is written whole."""
        self._release()
        self._parts, self._hashes, self._retired = (), [], False

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def write(self, record: Record) -> None:
        """Commit `record` (`encode_json` bytes, whole or in parts), sealed, atomically (one rename). A full or
        unwritable directory is a HostMemoryError naming it and the bytes needed."""
        parts = (record,) if isinstance(record, bytes) else tuple(record)
        shared = self._shared(parts)
        framed = seal_frame(self._digest(parts, shared), parts)
        fd = self._held() if shared else None
        try:
            if fd is None:
                fd = self._open_spare()
                if fd is None:  # not a name this process may write: the record goes to a fresh file
                    write_json_atomic(self.path, parts)
                    self._retired = False
                    return
                self._size = self._fill(fd, framed, 0)
            else:
                os.pwrite(fd, framed[1], DIGEST_AT)
                start = RECORD_AT + sum(len(part) for part in parts[:shared])
                self._size = self._fill(fd, framed[3 + shared :], start, self._size)
            os.replace(self.spare, self.path)
            self._retired = False
        except OSError as e:
            self.close()
            raise no_space(self.path.parent, self.path.name, sum(map(len, framed)), e) from None

    def _open_spare(self) -> int | None:
        """A descriptor of the spare (created if missing), now the file held open; None where its name holds
        something else than an owner-only file of this user."""
        self._release()
        try:
            self._fd = open_private(self.spare, os.O_RDWR | os.O_CREAT)
        except HostMemoryError:
            return None
        held = os.fstat(self._fd)
        self._inode = (held.st_dev, held.st_ino)
        return self._fd

    @staticmethod
    def _fill(fd: int, framed: list[bytes], start: int, size: int | None = None) -> int:
        """Write `framed` into `fd` (of `size` bytes, if known) from byte `start`, cut the file there, and flush
        it; returns its size."""
        end = write_parts(fd, framed, start)
        if size is None or end < size:
            os.ftruncate(fd, end)
        os.fsync(fd)
        return end

    def _held(self) -> int | None:
        """The descriptor of the file written last if the spare's name still holds it, unchanged in size."""
        if self._fd is None:
            return None
        try:
            st = os.lstat(self.spare)
        except FileNotFoundError:
            return None
        same = (st.st_dev, st.st_ino, st.st_size) == (*self._inode, self._size)
        return self._fd if same and stat.S_ISREG(st.st_mode) else None

    def _shared(self, parts: tuple[bytes, ...]) -> int:
        """How many leading parts `parts` shares with the record written last (the very same objects)."""
        shared = 0
        for old, new in zip(self._parts, parts):
            if old is not new:
                break
            shared += 1
        return shared

    def _digest(self, parts: tuple[bytes, ...], shared: int) -> bytes:
        """The seal's digest of `parts` (XXH3-64 of their bytes, 16 hex digits), hashing only the parts after
        the `shared` leading ones; `parts` and the hash state after each of them are kept for the next record."""
        known = min(shared, len(self._hashes) - 1)  # leading parts whose hash state is kept
        hashes = self._hashes[: known + 1] if known >= 0 else [xxhash.xxh3_64()]
        for part in parts[max(known, 0) :]:
            state = hashes[-1].copy()
            state.update(part)
            hashes.append(state)
        self._parts, self._hashes = parts, hashes
        return hashes[-1].hexdigest().encode()

    def _spare_usable(self) -> bool:
        """Whether the spare's name is free or holds an owner-only regular file of this user (never a link)."""
        try:
            st = os.lstat(self.spare)
            check_private(self.spare, st)
        except FileNotFoundError:
            return True
        except HostMemoryError:
            return False
        return stat.S_ISREG(st.st_mode)
