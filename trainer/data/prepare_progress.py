"""The record of an unfinished preparation (``prepare_progress.jsonl``) and how its files are published.

The record is one JSON object per line: the preparation's settings first (what its output depends on),
then one line per finished shard (``{"split": s, "shard": {...}}``, appended after the shard's file is
renamed into place) and per finished split (``{"split": s, "done": {...}}``). Appending keeps the cost of
a record proportional to the shards written, and a line torn by a kill is dropped when the record is
read back. In memory the record is the index being built: the settings plus ``splits``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.atomic_write import write_atomically
from trainer.data.corpus import DataError
from trainer.data.token_shards import PROGRESS_NAME

_APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC


def _line(value: dict) -> bytes:
    return (json.dumps(value, separators=(",", ":")) + "\n").encode()


def _entry(record: dict, split: str) -> dict:
    return record["splits"].setdefault(split, {"shards": [], "done": False})


def write_progress(out: Path, record: dict) -> None:
    """The whole record, replacing the file (at the start of a run: a torn last line goes)."""
    settings = {k: v for k, v in record.items() if k != "splits"}
    lines = [_line(settings)]
    for split, entry in record["splits"].items():
        lines += [_line({"split": split, "shard": shard}) for shard in entry["shards"]]
        if entry["done"]:
            lines.append(_line({"split": split, "done": {k: v for k, v in entry.items() if k != "shards"}}))
    write_atomically(out / PROGRESS_NAME, b"".join(lines))


def append_progress(out: Path, record: dict, split: str, *, shard: dict | None = None, done: dict | None = None):
    """Record a finished shard or split, in ``record`` and durably in the file."""
    entry = _entry(record, split)
    if shard is not None:
        entry["shards"].append(shard)
    if done is not None:
        entry.update(done)
    line = _line({"split": split, "shard": shard} if shard is not None else {"split": split, "done": done})
    with os.fdopen(os.open(out / PROGRESS_NAME, _APPEND, 0o644), "ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_progress(out: Path) -> dict:
    """The record in ``out``, up to a torn last line; DataError naming the file when it is not one."""
    path = out / PROGRESS_NAME
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            lines = f.read().split(b"\n")
        record = {**json.loads(lines[0]), "splits": {}}
    except (OSError, ValueError) as e:
        raise DataError(f"--out: {str(path)!r} is not a preparation record ({type(e).__name__})") from None
    for raw in lines[1:]:
        try:
            item = json.loads(raw)
            entry = _entry(record, item["split"])
            if "shard" in item:
                entry["shards"].append(item["shard"])
            else:
                entry.update(item["done"])
        except (ValueError, KeyError, TypeError):
            break  # a line cut short by a kill, and nothing after it
    return record
