"""Reusable host-memory buffers for snapshots and replicas, their commit records, and the safety of
the directories that hold them (docs/design/safety.md).

On CPU a buffer is a file in a shared-memory directory (`/dev/shm/moevement-<uid>` by default),
mapped into the process: it outlives a crashed training process, so a restarted job (or a test) can
read it. On GPU the same mapping is page-locked (pinned) for asynchronous device-to-host copies; where
the CUDA runtime refuses, the buffer stays unpinned, its copies are synchronous, and the process says so
once on stderr (`pin_or_warn`).

A buffer's bytes become meaningful only through its header, a JSON commit record written to a
spare name and renamed once the bytes are complete (and renamed back to the spare before they are
overwritten, `moevement.storage.commit_file`), so a crash mid-copy never leaves a snapshot that looks
complete.

Safety (`moevement.storage.private_files`): every directory level from the host directory down is
created owner-only, and one that already exists is used only if it is a real directory (not a symlink)
owned by this user with no group or other permissions; files are opened with `O_NOFOLLOW`, and one that
exists must be owner-only and this user's. Anything else is refused with one `HostMemoryError` naming
the path.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from moevement.storage.commit_file import CommitFile
from moevement.storage.mappings import KEPT, Mapping, buffer_files, map_fd
from moevement.storage.private_files import HostMemoryError, check_private, encode_json, open_private, private_fd
from moevement.storage.sealed import Record, SealError, unseal


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot: with the pid, names one process even after the
    pid is reused); None if no such process runs (a zombie counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


class JobLock:
    """An exclusive lock held for a process's lifetime (`flock`: the kernel drops it when the process
    dies, however it dies), so a live job is detectable and a dead one provably dead.

    The lock file holds the holder's pid and, under torchrun, its agent (`agent=<pid>:<start>`): after a
    worker died the lock is free, but the agent lives on and may start the next generation, which needs
    the job's host state (`agent_alive`)."""

    def __init__(self, path: Path, agent: int | None = None):
        self.path = path
        self.fd = open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise HostMemoryError(
                f"{path}: held by a live process (pid {holder}) of the same job; stop it, "
                f"or choose another job.name or checkpoint.host_dir"
            ) from None
        os.ftruncate(self.fd, 0)
        start = process_start(agent) if agent else None
        os.pwrite(self.fd, f"{os.getpid()}{f' agent={agent}:{start}' if start else ''}\n".encode(), 0)

    @staticmethod
    def held(path: Path) -> bool:
        """Whether a live process holds the lock at `path` (False when there is no such file)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    @staticmethod
    def agent_alive(path: Path) -> int | None:
        """The pid of the torchrun agent recorded in the lock file at `path` if that very process still
        runs on this node; None otherwise (no file, no agent recorded, or it is gone)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            text = os.pread(fd, 128, 0).decode(errors="replace")
        finally:
            os.close(fd)
        for token in text.split()[1:]:
            pid, _, start = token.removeprefix("agent=").partition(":")
            if token.startswith("agent=") and pid.isdigit() and start.isdigit():
                return int(pid) if process_start(int(pid)) == int(start) else None
        return None

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HostBuffer:
    """A growable byte buffer backed by the file `<path>.bin`, with its header at `<path>.json`.

    A replica of a snapshot taken on the same node is another name of the sender's buffer file (`link`):
    no copy, and the bytes outlive the sender's own name (a wipe or the end of its run only drop that).
    Such a buffer never writes into the shared file: `ensure` first gives it a file of its own."""

    def __init__(self, path: Path, pin: bool = False, replica: bool = False):
        self.path, self.pin = path, pin
        self._data: torch.Tensor | None = torch.empty(0, dtype=torch.uint8)  # None: a link, mapped when read
        self._pinned_ptr: int | None = None
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file `_data` maps
        self._growing = threading.Lock()  # `ensure` may run on the prefault thread and on another
        self.record = CommitFile(self.header_path, path.with_suffix(".spare"))
        # A replica file with other names is a link (an earlier process of the job may have left it).
        self.linked = replica and _links(self.path.with_suffix(".bin")) > 1
        if self.linked:
            self._data = None
        elif (kept := KEPT.take(self.path.with_suffix(".bin"))) is not None:
            self._adopt(kept)

    @property
    def data(self) -> torch.Tensor:
        """The mapped bytes (a linked file is mapped on first read)."""
        if self._data is None:
            self._data = map_bytes(self.path)
        return self._data

    @property
    def header_path(self) -> Path:
        return self.path.with_suffix(".json")

    @property
    def capacity(self) -> int:
        """Bytes of host memory this buffer holds (none for a link: they are the sender's)."""
        return 0 if self.linked else self.data.numel()

    def reserved(self) -> int:
        """Bytes this buffer can grow to without new memory: its mapping, or a file an earlier process left."""
        try:
            return max(self.capacity, os.lstat(self.path.with_suffix(".bin")).st_size)
        except FileNotFoundError:
            return self.capacity

    def ensure(self, nbytes: int) -> torch.Tensor:
        """At least `nbytes` of mapped memory (kept across calls; grows, never shrinks).

        A file left at this path by an earlier process of the job (`SparseCheckpointer.drop_leftovers`
        keeps them) is reused with its pages: mapping those costs a tenth of allocating new ones. A linked
        replica drops its name of the sender's file first and grows a file of its own."""
        if self.linked:
            self._drop_file()
        if nbytes > self.capacity:
            with self._growing:
                if nbytes > self.capacity:
                    self._grow(nbytes)
        return self.data

    def _grow(self, nbytes: int) -> None:
        """Map at least `nbytes` of the file, its pages reserved and faulted in (see `ensure`)."""
        self._unpin()
        bin_path = self.path.with_suffix(".bin")
        fd = open_private(bin_path, os.O_RDWR | os.O_CREAT)
        try:
            st = os.fstat(fd)
            size = max(nbytes, st.st_size)
            os.ftruncate(fd, size)
            # Reserve the pages now: a full /dev/shm must fail here, not SIGBUS a later copy.
            os.posix_fallocate(fd, 0, size)
            data = map_fd(fd, size)
        except OSError as e:
            free = shutil.disk_usage(bin_path.parent).free
            raise HostMemoryError(
                f"{bin_path}: cannot reserve {nbytes / 1e9:.2f} GB of host memory "
                f"({free / 1e9:.2f} GB free there: {e.strerror})"
            ) from None
        finally:
            os.close(fd)
        pinned = data.data_ptr() if self.pin and pin_or_warn(data.data_ptr(), size, bin_path) else None
        self._data, self._pinned_ptr, self._identity = data, pinned, (st.st_dev, st.st_ino)

    def _adopt(self, kept: Mapping) -> None:
        """Take over a mapping this process kept of this buffer's file (`moevement.storage.mappings`)."""
        self._data, self._pinned_ptr, self._identity = kept.data, kept.pinned, kept.identity
        if self.pin and self._pinned_ptr is None and pin_or_warn(kept.data.data_ptr(), kept.data.numel(), self.path):
            self._pinned_ptr = kept.data.data_ptr()

    def release(self, keep: bool = False) -> None:
        """Unpin and drop the mapping (a pinned range must be unregistered before it is unmapped), and let go of
        the commit record's file (`CommitFile.close`). With `keep`, the mapping (pinned or not) stays in this
        process for the next buffer of the same file instead (`mappings.KEPT`: a later generation's)."""
        if keep and not self.linked and self._identity is not None and self.capacity:
            KEPT.keep(self.path.with_suffix(".bin"), Mapping(self._data, self._identity, self._pinned_ptr))
            self._pinned_ptr = None
        self._unpin()
        self._data, self._identity = (None if self.linked else torch.empty(0, dtype=torch.uint8)), None
        self.record.close()

    def link(self, source: Path) -> None:
        """Make `<path>.bin` another name of the buffer file `source` (a same-node sender's, on this file
        system; owner-only, never through a symlink) unless it is one already: the sender's bytes, no copy.
        The mapping is redone on the next read if the file was replaced or grew."""
        bin_path = self.path.with_suffix(".bin")
        try:
            st = os.lstat(source)
            check_private(source, st)
            mine = os.lstat(bin_path) if os.path.lexists(bin_path) else None
            if mine is not None:
                check_private(bin_path, mine)  # a planted symlink or foreign file is refused, never removed
            if mine is not None and (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino):
                if self._data is not None and self._data.numel() < st.st_size:
                    self._data = None
                self.linked = True
                return
            self._drop_file()
            os.link(source, bin_path, follow_symlinks=False)
        except OSError as e:
            raise HostMemoryError(f"{bin_path}: cannot link the replica to {source} ({e.strerror})") from None
        check_private(bin_path)
        self.linked, self._data, self._identity = True, None, None

    def scrub(self) -> None:
        """Its rank failed (a simulated loss): the bytes become unreadable to this rank. A file with other
        names (a link either way between a sender's buffer and a same-node replica) loses only this name,
        so the other rank's snapshot or replica survives; any other file is overwritten with zeros. Its commit
        record goes, with the spare of it."""
        self.record.drop()
        if self.linked or _links(self.path.with_suffix(".bin")) > 1:
            self._drop_file()
        else:
            self.data.zero_()

    def _drop_file(self) -> None:
        """Unmap and remove this buffer's name of its file (another name keeps the bytes)."""
        self._unpin()
        self._data, self.linked, self._identity = torch.empty(0, dtype=torch.uint8), False, None
        KEPT.discard(self.path.with_suffix(".bin"))
        self.path.with_suffix(".bin").unlink(missing_ok=True)

    def invalidate(self) -> None:
        """Retire the commit record before the bytes are overwritten (it waits as the next one's spare)."""
        self.record.retire()

    def commit(self, header: dict | Record) -> None:
        """Record the bytes as complete with `header` (a dict or its JSON encoding, whole or in parts)."""
        self.record.write(encode_json(header) if isinstance(header, dict) else header)

    def _unpin(self) -> None:
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None


_pin_refused = False  # this process has said that a buffer stayed unpinned


def pin_or_warn(ptr: int, size: int, path: Path) -> bool:
    """Page-lock the mapping [ptr, ptr + size) of `path` for asynchronous device-to-host copies. When the
    CUDA runtime refuses, the mapping stays usable but unpinned: copies into it are synchronous. That is
    said once per process on stderr, with what to check, and the runtime's error is cleared (it would
    otherwise be raised by the next kernel launch of this thread). Returns whether it is pinned."""
    global _pin_refused
    code = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
    if code == 0:
        return True
    if not clear_cuda_error():
        raise HostMemoryError("cudaHostRegister failed and the CUDA runtime library in use cannot be found")
    if not _pin_refused:
        _pin_refused = True
        print(
            f"warning: {path}: cannot pin {size / 1e9:.2f} GB of snapshot memory ({torch.cuda.CudaError(code)}): "
            "this process copies its snapshots synchronously (stall_ms grows by the whole copy). Check that the "
            "host has that much memory to lock (`ulimit -l`; containers: --ulimit memlock=-1), that the host "
            "directory has room (containers: --shm-size) and that this platform supports cudaHostRegister "
            "(some virtualised GPUs do not).",
            file=sys.stderr,
            flush=True,
        )
    return False


def clear_cuda_error() -> bool:
    """Reset the CUDA runtime's last error of this thread (`cudaGetLastError`; torch exposes no binding); False
    where the runtime library in use cannot be found."""
    path = loaded_library("libcudart")
    if path is None:
        return False
    ctypes.CDLL(path).cudaGetLastError()  # dlopen of a loaded library: the same runtime instance
    return True


def loaded_library(stem: str) -> str | None:
    """The path of the shared library `<stem>.so...` this process has mapped, or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if Path(path).name.startswith(f"{stem}.so"):
                return path
    return None


def read_header(path: Path) -> dict | None:
    """The committed header of the buffer at `path` (no suffix), or None if there is none.

    A header whose hash does not match or that is not a JSON object (changed, truncated, corrupted) raises
    HostMemoryError naming the file."""
    json_path = path.with_suffix(".json")
    try:
        fd = os.open(json_path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise HostMemoryError(f"{json_path}: cannot read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        try:
            return unseal(f.read(), json_path)
        except SealError as e:
            raise HostMemoryError(str(e)) from None


def _links(path: Path) -> int:
    """How many names the file at `path` has (0: none there)."""
    try:
        return os.lstat(path).st_nlink
    except FileNotFoundError:
        return 0


def map_bytes(path: Path) -> torch.Tensor:
    """The bytes of the buffer file `<path>.bin`, mapped read-write (no copy; never through a symlink)."""
    fd = open_private(path.with_suffix(".bin"), os.O_RDWR)
    try:
        return map_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def prefault_rank_dir(rank_dir: Path, pin: bool = False) -> int:
    """Map every buffer file of the rank directory `rank_dir` (its own snapshots, `local/`, and the replicas it
    received over the network, `replicas/from*/`) with its pages faulted in, and keep the mappings in this
    process (`mappings.KEPT`) for the buffers its checkpointer builds (`pin`: page-locked too, for a GPU's
    copies). Returns the bytes mapped by this call: mappings already kept and still valid are not redone, so
    calling it again is cheap (a warm standby may call it every few seconds while it waits, and once more when
    it is activated, before it builds its checkpointer).

    A file with more than one name (a same-node replica that is a link to its sender's buffer, and that buffer)
    is left alone, and so is anything not owner-only and this user's: host state of another user is never
    mapped. A missing directory maps nothing."""
    mapped = 0
    for path in buffer_files(rank_dir):
        if KEPT.valid(path):
            continue
        try:
            fd = open_private(path, os.O_RDWR)
        except HostMemoryError:
            continue  # vanished, or not ours: never mapped
        try:
            st = os.fstat(fd)
            if st.st_nlink > 1 or st.st_size == 0:
                continue
            data = map_fd(fd, st.st_size)
        finally:
            os.close(fd)
        pinned = data.data_ptr() if pin and pin_or_warn(data.data_ptr(), st.st_size, path) else None
        KEPT.keep(path, Mapping(data, (st.st_dev, st.st_ino), pinned))
        mapped += st.st_size
    return mapped


def _open_dir_at(dir_fd: int, name: str, where: Path) -> int:
    """The directory `name` in the open directory `dir_fd`, never through a symlink, checked owner-only."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise HostMemoryError(
            f"{where}: cannot open as a host-state directory ({e.strerror}; a symlink is never followed)"
        ) from None
    return private_fd(fd, where)


def _open_anchor(anchor: Path) -> int:
    """`anchor`, a host-state directory this program created or checked, opened and checked again (its own
    name is never a symlink; the path above it is the user's configuration)."""
    parent = os.open(anchor.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _open_dir_at(parent, anchor.name, anchor)
    finally:
        os.close(parent)


def remove_tree(path: Path, anchor: Path) -> None:
    """Remove the host-state directory `path` inside `anchor`, walking down from `anchor` one directory
    descriptor at a time: no component is followed if it is a symlink (a planted `window-*` link makes the
    removal fail with HostMemoryError, nothing behind it is touched), every level is checked owner-only, and
    the tree is removed relative to its parent's descriptor (symlinks inside are unlinked, never followed).
    A `path` that does not exist is fine."""
    KEPT.drop_under(path)  # mappings this process kept of files there: their pages go with the files
    parts = path.relative_to(anchor).parts
    if not parts or ".." in parts:
        raise ValueError(f"{path} is not inside {anchor}")
    try:
        fd = _open_anchor(anchor)
    except HostMemoryError:
        if not os.path.lexists(anchor):
            return
        raise
    try:
        where = anchor
        for part in parts[:-1]:
            where = where / part
            try:
                child = _open_dir_at(fd, part, where)
            except HostMemoryError:
                if not os.path.lexists(where):
                    return
                raise
            os.close(fd)
            fd = child
        try:
            check_private(path, os.stat(parts[-1], dir_fd=fd, follow_symlinks=False))
        except FileNotFoundError:
            return
        shutil.rmtree(parts[-1], dir_fd=fd, ignore_errors=True)
    finally:
        os.close(fd)


def private_subdirs(root: Path, prefix: str, leaf: str) -> list[Path]:
    """`root/<prefix>*/<leaf>` for every entry of `root` starting with `prefix` that is a real directory (a
    symlink is never listed, so never followed) holding `leaf`; sorted by name."""
    try:
        entries = sorted(
            e.name for e in os.scandir(root) if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)
        )
    except FileNotFoundError:
        return []
    return [root / name / leaf for name in entries if os.path.lexists(root / name / leaf)]
