"""Where a simulator run writes its tables and figures: `--out DIR`, or `outputs/simulator/<UTC timestamp>/`.

A mode that prints tables also writes them, and its figures, into one such directory (never into
tracked files such as docs/figures/), then prints one `wrote: PATH` line per file. Directories it
creates are owner-only (0o700) and its files 0o600. Each file is written under a temporary name in the
same directory and renamed over its target, so a reader never sees half a table and a symlink at the
target is replaced, not followed. `--out` must be a directory or not exist yet; a symlink is refused.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

DEFAULT_ROOT = Path("outputs/simulator")


class OutputError(Exception):
    """The output directory cannot be used or written; one line naming it."""


def output_dir(out: str | None) -> Path:
    """`out`, created (owner-only) where missing, or a new `outputs/simulator/<UTC timestamp>` when None.

    OutputError if `out` is a symlink or exists and is not a directory, or a directory cannot be made."""
    if out is None:
        return _new_timestamped(DEFAULT_ROOT)
    path = Path(out)
    if path.is_symlink():
        raise OutputError(f"--out {out!r} is a symlink (refused)")
    if path.exists() and not path.is_dir():
        raise OutputError(f"--out {out!r} exists and is not a directory")
    try:
        _make_owner_only(path)
    except OSError as err:
        raise OutputError(f"--out {out!r}: {err.strerror or err}") from None
    return path


def _make_owner_only(path: Path) -> None:
    """Create `path` and its missing parents, each 0o700 (`mkdir(parents=True)` gives parents the default mode)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=0o700)


def _new_timestamped(root: Path) -> Path:
    """`root/<UTC timestamp>`, suffixed `-1`, `-2`, ... when another run took that second."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())
    try:
        _make_owner_only(root)
        for n in range(1000):
            folder = root / (stamp if n == 0 else f"{stamp}-{n}")
            try:
                folder.mkdir(mode=0o700)
                return folder
            except FileExistsError:
                continue
    except OSError as err:
        raise OutputError(f"output directory {str(root)!r}: {err.strerror or err}") from None
    raise OutputError(f"output directory {str(root)!r}: no free folder for {stamp}")


def write_text(folder: Path, name: str, text: str) -> Path:
    """`folder/name` holding `text` (and a final newline), replaced atomically; OutputError if it cannot be."""

    def write(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    return _replace(folder, name, write)


def write_figure(folder: Path, name: str, draw: Callable[[str], None]) -> Path:
    """`folder/name` as `draw(path)` saves it (the temporary name keeps `name`'s suffix, which picks the format)."""

    def write(tmp: Path) -> None:
        draw(str(tmp))
        os.chmod(tmp, 0o600)

    return _replace(folder, name, write)


def _replace(folder: Path, name: str, write: Callable[[Path], None]) -> Path:
    target = folder / name
    tmp = folder / f".{target.stem}.tmp{target.suffix}"
    try:
        tmp.unlink(missing_ok=True)
        write(tmp)
        os.replace(tmp, target)
    except OSError as err:
        with suppress(OSError):
            tmp.unlink()
        raise OutputError(f"{target}: {err.strerror or err}") from None
    return target
