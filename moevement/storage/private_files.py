"""Owner-only files and directories of host state, and JSON records written to them atomically
(docs/design/safety.md).

Safety: every directory level from the host directory down is created owner-only, and one that
already exists is used only if it is a real directory (not a symlink) owned by this user with no
group or other permissions; files are opened with `O_NOFOLLOW`, and a file that exists must be
owner-only and this user's. Anything else is refused with one `HostMemoryError` naming the path.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from moevement.storage.sealed import Record, seal_parts


class HostMemoryError(RuntimeError):
    """Snapshot host memory cannot be used: full, unsafe (foreign owner, open permissions, symlink) or
    unwritable; the message names the path."""


def default_host_dir() -> str:
    """The per-user shared-memory directory for host state (`/dev/shm/moevement-<uid>`; the system
    temporary directory where there is no /dev/shm)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"moevement-{os.geteuid()}")


def check_private(path: Path, st: os.stat_result | None = None) -> None:
    """Refuse `path` unless it is a real directory or regular file owned by this user, owner-only."""
    st = st or os.lstat(path)
    kind = "directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else None
    if stat.S_ISLNK(st.st_mode) or kind is None:
        raise HostMemoryError(f"{path}: is a symlink or special file; refusing to use it for host state")
    if st.st_uid != os.geteuid():
        raise HostMemoryError(
            f"{path}: {kind} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}); refusing to use it for host state"
        )
    if st.st_mode & 0o077:
        raise HostMemoryError(
            f"{path}: {kind} has group/other permissions ({stat.filemode(st.st_mode)}); "
            f"host state needs an owner-only location (chmod 700 it, or choose another)"
        )


def make_private_dir(path: Path) -> Path:
    """Create `path` owner-only (its parent must exist), or check an existing one (see `check_private`)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise HostMemoryError(f"{path}: cannot create the host-state directory ({e.strerror})") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
        raise HostMemoryError(f"{path}: not a directory; host state needs a directory")
    check_private(path, st)
    return path


def make_private_dirs(root: Path, *parts: str) -> Path:
    """`root/parts...`, every level from `root` down created owner-only or checked (`root`'s parents
    are not: a shared parent such as /dev/shm is normal)."""
    if not root.parent.is_dir():
        raise HostMemoryError(f"{root}: its parent directory does not exist")
    path = make_private_dir(root)
    for part in parts:
        path = make_private_dir(path / part)
    return path


def open_private(path: Path, flags: int) -> int:
    """A file descriptor of `path`, never following a symlink; an existing file must be owner-only."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        raise HostMemoryError(f"{path}: cannot open ({e.strerror})") from None
    return private_fd(fd, path)


def private_fd(fd: int, path: Path) -> int:
    """`fd` if what it opened (`path`) is owner-only and ours; closed, and HostMemoryError, otherwise."""
    try:
        check_private(path, os.fstat(fd))
    except HostMemoryError:
        os.close(fd)
        raise
    return fd


def encode_json(payload: dict) -> bytes:
    """`payload` as JSON bytes (`json.dumps` runs the C encoder; `json.dump` to a file does not: ~5x slower)."""
    return json.dumps(payload).encode()


def no_space(directory: Path, what: str, needed: int, error: OSError) -> HostMemoryError:
    """The one-line error for `what` (`needed` bytes) that could not be written under `directory`."""
    try:
        free = f"{shutil.disk_usage(directory).free / 1e6:.1f} MB free"
    except OSError:
        free = "free space unknown"
    return HostMemoryError(f"{directory}: cannot write {what} ({needed / 1e6:.1f} MB needed, {free}: {error.strerror})")


def write_json_atomic(path: Path, payload: dict | Record) -> None:
    """Write `payload` (a dict, or its `encode_json` bytes, whole or in parts), `seal`ed, to `path` via a fresh
    temporary file (created exclusively, owner-only) and a rename. A full or unwritable directory is a
    HostMemoryError naming it and the bytes needed; the temporary is removed."""
    parts = seal_parts(encode_json(payload) if isinstance(payload, dict) else payload)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            write_parts(fd, parts)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise no_space(path.parent, path.name, sum(map(len, parts)), e) from None
        raise


_IOV_MAX = os.sysconf("SC_IOV_MAX")


def write_parts(fd: int, parts: list[bytes], offset: int = 0) -> int:
    """Write `parts` one after another to `fd` from byte `offset` (`pwritev`; a short write goes on where it
    stopped); returns the offset after the last byte."""
    views = [memoryview(part) for part in parts if part]
    while views:
        written = os.pwritev(fd, views[:_IOV_MAX], offset)
        if not written:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        offset += written
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if views and written:
            views[0] = views[0][written:]
    return offset
