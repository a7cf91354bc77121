"""How a trainer process writes its events into the run folder's `events.jsonl` (docs/design/event-records.md):
one whole line per record, in append mode, so writers never interleave inside a line. The lifecycle writes
its lines here as the run does; reading a run's events back is `trainer/records/event_log.py`.
Imports no torch (a rank shell records its lines too)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import ClassVar, Protocol

EVENTS = "events.jsonl"


class Event(Protocol):
    """A console line that the run record also keeps: its kind, its line, its record."""

    KIND: ClassVar[str]

    def line(self) -> str: ...

    def record(self) -> dict: ...


def append_event(run_dir: Path, event: Event) -> None:
    """Append `event`'s record to `run_dir`'s events.jsonl: opened for appending without following a symlink
    (OSError if it is one), one `write` of the whole line, closed again (one record per iteration and a few
    more: no descriptor outlives the generation that wrote, and no writer holds one another must share). A
    process killed around it leaves the line whole or absent."""
    data = (json.dumps(event.record(), separators=(",", ":")) + "\n").encode()
    path = run_dir / EVENTS
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        written = os.write(fd, data)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(f"{path}: {written} of the record's {len(data)} bytes written")


_folder: Path | None = None  # where this process records its events (`record_events_in`)


def record_events_in(folder: Path | None) -> None:
    """From now on this trainer process records its events in run folder `folder` (None, or a folder this
    host does not see: printed only). train.py calls it once the folder is known: rank 0 when it opens it,
    every other rank once rank 0 has named it on torchrun's store."""
    global _folder
    _folder = folder if folder is not None and folder.is_dir() else None


def record(event: Event) -> None:
    """Append `event`'s record where this process records (nothing where it does not); a run folder that
    cannot take it costs the record, not the run (one line)."""
    if _folder is None:
        return
    try:
        append_event(_folder, event)
    except OSError as e:
        print(f"run record: {_folder}: cannot record the event ({e}); it is printed only", flush=True)


def say(event: Event) -> None:
    """Record `event`, then print its line: a printed line has its record."""
    record(event)
    print(event.line(), flush=True)
