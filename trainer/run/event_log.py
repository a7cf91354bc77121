"""A run's events as records: `<run folder>/events.jsonl`, the truth the console lines are a view of
(docs/design/event-records.md).

Every line a user or a tool reads is one JSON object on one line of this file, written from the same typed
object that prints the line (`record()`, with its `"kind"`; `from_record(record).line()` is the printed line
again): `step` (every iteration, printed every `metrics.log_every`), `validation`, `elastic`, `fault`,
`survivor`, `recovery`, `recovery_work`, the `checkpoint_*` kinds (`trainer.checkpoint.events`),
`accounting`, `final`, and a rank shell's `shell`. Any trainer process that knows the run folder and sees it
records its own events (`record_events_in`, `say`): rank 0, which opens the folder, and every other rank once
rank 0 has named it on torchrun's store, where the folder is on its host's file system (rank 0's host, or a
shared one; elsewhere its lines are printed only). Rank shells (and their children) learn it from their
trainer. Every writer appends a whole line with one `write` in append mode (`append_event`), so writers never
interleave inside a line; a torchrun restart or an in-place replacement continues the run folder
(`open_run_record`), so a later generation's records follow the earlier ones'.

Tests, benchmarks and eval/ read a run's events here (`run_events`) instead of parsing its stdout: the one
parse left is of the `run: <dir>` lines that name the folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import ClassVar, Protocol

from moevement.recovery.report import RecoveryReport, RecoveryWork
from trainer.checkpoint.events import CHECKPOINT_EVENTS, CheckpointEvent
from trainer.lifecycle.shell_lines import ShellLine
from trainer.lifecycle.survivor_lines import SurvivorLine
from trainer.run.accounting_line import AccountingLine
from trainer.run.event_lines import ElasticLayout, FaultStrike, FinalLine, StepLine, ValidationLine

EVENTS = "events.jsonl"
RunEvent = (
    StepLine
    | ValidationLine
    | ElasticLayout
    | FaultStrike
    | SurvivorLine
    | RecoveryReport
    | RecoveryWork
    | CheckpointEvent
    | AccountingLine
    | FinalLine
    | ShellLine
)
KINDS: dict[str, type[RunEvent]] = {
    cls.KIND: cls
    for cls in (
        StepLine,
        ValidationLine,
        ElasticLayout,
        FaultStrike,
        SurvivorLine,
        RecoveryReport,
        RecoveryWork,
        *CHECKPOINT_EVENTS,
        AccountingLine,
        FinalLine,
        ShellLine,
    )
}
_TAIL_BYTES = 1 << 16  # how much of the file's end `last_step` reads at a time
# rank 0's `run: <dir>` line (train.py), ` (continued by a later generation of the run)` after a restart
RUN_LINE = re.compile(r"^run: (.+?)(?: \(continued by a later generation of the run\))?$", re.M)


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


def recording_in() -> Path | None:
    """The run folder this process records its events in, if any."""
    return _folder


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


def last_step(folder: Path) -> int:
    """The newest iteration a `step` record of `folder` holds (0: none), read from the file's end: step
    records are written in ascending order (each iteration once), so the last one is the newest."""
    path = folder / EVENTS
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        end, tail = os.fstat(fd).st_size, b""
        while end > 0:
            start = max(0, end - _TAIL_BYTES)
            tail = os.pread(fd, end - start, start) + tail
            lines = tail.split(b"\n")
            complete = lines if start == 0 else lines[1:]  # the first may be cut
            for text in reversed(complete):
                if text.startswith(b'{"kind":"step",'):
                    return int(json.loads(text)["step"])
            tail, end = lines[0] if start > 0 else b"", start
        return 0
    finally:
        os.close(fd)


def read_events(folder: Path) -> list[RunEvent]:
    """The events recorded in run folder `folder`, in the order they were written (none: no file).
    ValueError naming the file and line for a line that is not a record `append_event` wrote."""
    path = folder / EVENTS
    if not path.is_file():
        return []
    events = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(text)
            events.append(KINDS[record["kind"]].from_record(record))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}:{number}: not an event record ({type(e).__name__}: {e})") from None
    return events


def run_folders(stdout: str, cwd: Path) -> list[Path]:
    """The run folders named by the `run: <dir>` lines of a run's `stdout`, in order, each once (relative ones
    against `cwd`, the directory train.py ran in)."""
    folders = [cwd / path for path in RUN_LINE.findall(stdout)]
    return list(dict.fromkeys(folders))


def run_events(stdout: str, cwd: Path | None = None) -> list[RunEvent]:
    """The events of the run(s) whose stdout is `stdout` (train.py ran in `cwd`, by default this process's
    working directory), in order; none when it names no run folder."""
    return [event for folder in run_folders(stdout, cwd or Path.cwd()) for event in read_events(folder)]
