"""Where a dense checkpoint may be written, and how it appears there whole or not at all.

Saving never deletes or renames anything it did not write. The target must be new, an empty directory
or a checkpoint of this project holding only its own files (`check_target`, before training and again
at the save). `begin` (rank 0) makes a fresh owner-only sibling `.<name>.tmp-XXXX`, marked by
`.moevement-partial` (written first, naming the writer's host and pid); every rank writes its files into
it (`trusted_temporary` checks it first: a directory of this user, owner-only, not a symlink); `publish`
(rank 0) writes `meta.json` last, then renames the directory into place. A replaced checkpoint is first
renamed to a fresh `.<name>.old-XXXX`, and only its own files are deleted. Marked temporaries of the same
target whose writer process is gone are removed, and in them only the files this program writes.

All ranks write into one directory: on several nodes it must be on a file system every node shares.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import tempfile
from contextlib import suppress
from pathlib import Path


class CheckpointError(RuntimeError):
    """A missing, corrupted, mismatched or unsafe checkpoint or target; the message names the path."""


FORMAT = "moevement-dense-v4"  # one model and one optimizer file per writing rank; meta.json sealed
# formats of older versions, refused on load (re-save with this version); a save may replace them
UNSEALED_FORMATS = ("moevement-dense-v3", "moevement-dense-v2")  # meta.json not sealed
OLD_FORMAT = "moevement-dense-v1"  # torch DCP with a pickled .metadata: refused unread
META = "meta.json"
PARTIAL = ".moevement-partial"  # marks a temporary directory written by this program
SHARD_FILE = re.compile(r"^(model|optim)-(\d{5})\.safetensors$")
V2_FILES = ("model.safetensors", "optim.safetensors")  # what a v2 checkpoint holds (replaceable)
LINEAGE = "lineage"  # meta.json's key naming the run lineage that wrote it (trainer.checkpoint.lineage)
LINEAGE_ID = re.compile(r"[0-9a-f]{16}")


def shard_file(kind: str, rank: int) -> str:
    """The file rank `rank` writes its `kind` ("model" or "optim") tensors to."""
    return f"{kind}-{rank:05d}.safetensors"


RANK_RECORD = re.compile(r"^\.rank-\d{5}\.done(\.tmp)?$")  # a rank's files, in a periodic save's temporary


def written_by_us(name: str) -> bool:
    """A file name this program writes into a checkpoint directory (any format) or its temporary."""
    return bool(SHARD_FILE.match(name) or RANK_RECORD.match(name)) or name in (META, f"{META}.tmp", PARTIAL, *V2_FILES)


def own_file(path: Path) -> bool:
    """A regular file (not a symlink) owned by this user."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def write_owner_only(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------- the target


def replaceable_files(path: Path, key: str) -> list[str]:
    """Entries of the existing directory `path` that replacing it deletes ([] if empty).

    Refuses anything but a checkpoint of this project that holds only its own files."""
    try:
        entries = sorted(os.listdir(path))
    except OSError as e:
        raise CheckpointError(f"{key}: cannot read {path} ({e.strerror})") from None
    if not entries:
        return []
    try:
        meta = json.loads((path / META).read_text())
        files, fmt = meta["files"], meta["format"]
    except (OSError, ValueError, RecursionError, TypeError, KeyError):
        files, fmt = {}, None
    if fmt not in (FORMAT, *UNSEALED_FORMATS, OLD_FORMAT) or not isinstance(files, dict):
        raise CheckpointError(
            f"{key}: {path} is a non-empty directory that is not a MoEvement checkpoint; "
            f"not replaced (choose a new or empty directory)"
        )
    # what may be deleted is decided by the names this program writes, never by the listing in meta.json
    foreign = [e for e in entries if not written_by_us(e) or not own_file(path / e)]
    if foreign:
        raise CheckpointError(
            f"{key}: checkpoint {path} also holds {', '.join(foreign)}, not written by "
            f"train.py; not replaced (move them or choose another directory)"
        )
    return entries


def check_target(path: Path, key: str) -> list[str]:
    """Refuse a target saving would destroy or cannot write; the old checkpoint's files to delete."""
    if path.name in ("", ".", ".."):
        raise CheckpointError(f"{key}: {str(path)!r} does not name a new directory")
    if path.is_symlink():
        raise CheckpointError(f"{key}: {path} is a symlink; refused, never followed")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{key}: {path} exists and is not a directory; not replaced")
    old_files = replaceable_files(path, key) if path.exists() else []
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    try:  # the only reliable test (root passes os.access): create and remove a temporary of our own
        os.rmdir(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=ancestor))
    except OSError as e:
        raise CheckpointError(f"{key}: cannot write a checkpoint at {path} ({e.strerror}: {ancestor})") from None
    return old_files


# ---------------------------------------------------------------- temporaries


def _stale_temporary(tmp: Path) -> bool:
    """`tmp` carries our marker, is ours, and the process that wrote it (on this host) is gone."""
    try:
        if not (own_file(tmp / PARTIAL) and tmp.lstat().st_uid == os.getuid()):
            return False
        writer = json.loads((tmp / PARTIAL).read_text())
        pid = int(writer["pid"])
        if writer["host"] != socket.gethostname() or pid <= 0:
            return False
        os.kill(pid, 0)
        return False  # the writer is alive: possibly saving right now
    except ProcessLookupError:
        return True
    except (OSError, ValueError, TypeError, KeyError):
        return False


def remove_temporary(tmp: Path) -> None:
    """Delete the files we write from a marked temporary directory (the marker last), then the directory."""
    with suppress(OSError):
        for name in os.listdir(tmp):
            if name != PARTIAL and written_by_us(name) and own_file(tmp / name):
                (tmp / name).unlink()
    if own_file(tmp / PARTIAL):
        (tmp / PARTIAL).unlink()
    with suppress(OSError):
        tmp.rmdir()  # fails, leaving it, if it holds anything else


def remove_stale_temporaries(directory: Path, of_target: re.Pattern) -> None:
    """Clean up the marked temporaries that interrupted saves to targets in `directory` whose names match
    `of_target` left behind (nothing else)."""
    for entry in os.scandir(directory):
        name, _, _ = entry.name[1:].partition(".tmp-")
        candidate = entry.name.startswith(".") and ".tmp-" in entry.name and of_target.fullmatch(name)
        if candidate and entry.is_dir(follow_symlinks=False) and _stale_temporary(Path(entry.path)):
            remove_temporary(Path(entry.path))


def begin(path: Path, key: str) -> tuple[Path, list[str]]:
    """(a fresh marked owner-only temporary beside `path`, the old checkpoint's files there). Rank 0."""
    old_files = check_target(path, key)  # again: the target may have changed during training
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        remove_stale_temporaries(path.parent, re.compile(re.escape(path.name)))
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        write_owner_only(tmp / PARTIAL, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    except OSError as e:
        if tmp is not None:
            remove_temporary(tmp)
        raise CheckpointError(f"{key}: cannot save to {path} ({e})") from None
    return tmp, old_files


def trusted_temporary(tmp: Path, key: str) -> None:
    """Refuse to write into `tmp` unless it is a directory of this user, owner-only, not a symlink, marked."""
    try:
        st = tmp.lstat()
    except OSError as e:
        raise CheckpointError(
            f"{key}: cannot reach {tmp} ({e.strerror}); every rank writes into the directory rank 0 made, "
            f"so on several nodes it must be on a shared file system"
        ) from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 or not own_file(tmp / PARTIAL):
        raise CheckpointError(f"{key}: {tmp} is not an owner-only directory of this save; not written into")


# ---------------------------------------------------------------- publishing


def publish(tmp: Path, path: Path, old_files: list[str], meta: dict) -> None:
    """Write `meta.json` into the finished `tmp`, then rename `tmp` to `path`; an old checkpoint there goes
    aside first, then its files go. Rank 0."""
    write_owner_only(tmp / f"{META}.tmp", json.dumps(meta, indent=1).encode())
    os.replace(tmp / f"{META}.tmp", tmp / META)
    if not old_files:
        os.rename(tmp, path)  # onto nothing or an empty directory; anything else makes it fail
    else:
        aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.rename(path, aside)  # replaces the empty `aside` we just made
        try:
            os.rename(tmp, path)
        except OSError:
            os.rename(aside, path)
            raise
        for name in sorted(old_files, key=lambda n: n == META):  # meta.json last: it names the owner
            with suppress(OSError):
                (aside / name).unlink()
        with suppress(OSError):
            aside.rmdir()
    (path / PARTIAL).unlink()
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
