"""A run's events as records beside its console lines: `<run folder>/events.jsonl` (docs/design.md §5).

Each `recovery step=...`, `recovery work ...`, `fault: ...`, `accounting ...` and `final ...` line that rank 0
prints, and each `shell:` line of a rank shell on rank 0's host, is also one JSON object on one line of this
file, written from the same typed object that prints the line (`RecoveryReport`, `RecoveryWork`,
`FaultStrike`, `AccountingLine`, `FinalLine`, `ShellLine`: `record()`, with its `"kind"`). The writers are
rank 0's `MetricsLogger` and the rank shells (and their children), which learn the folder from their trainer
(`append_event`: one `write` of a whole line in append mode, so writers never interleave inside a line); a
torchrun restart or an in-place replacement continues the run folder (`open_run_record`), so a later
generation's records follow the earlier ones'.

Tests and benchmarks read a run's events here (`run_events`) instead of parsing its stdout: the one parse
left is of the `run: <dir>` lines that name the folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import ClassVar, Protocol

from moevement.recovery.report import RecoveryReport, RecoveryWork
from trainer.lifecycle.shell_lines import ShellLine
from trainer.run.accounting_line import AccountingLine
from trainer.run.event_lines import FaultStrike, FinalLine

EVENTS = "events.jsonl"
RunEvent = RecoveryReport | RecoveryWork | FaultStrike | FinalLine | ShellLine | AccountingLine
KINDS: dict[str, type[RunEvent]] = {
    cls.KIND: cls for cls in (RecoveryReport, RecoveryWork, FaultStrike, FinalLine, ShellLine, AccountingLine)
}
# rank 0's `run: <dir>` line (train.py), ` (continued by a later generation of the run)` after a restart
RUN_LINE = re.compile(r"^run: (.+?)(?: \(continued by a later generation of the run\))?$", re.M)


class Event(Protocol):
    """A console line that the run record also keeps: its kind, its line, its record."""

    KIND: ClassVar[str]

    def line(self) -> str: ...

    def record(self) -> dict: ...


def append_event(run_dir: Path, event: Event) -> None:
    """Append `event`'s record to `run_dir`'s events.jsonl: opened for appending without following a symlink
    (OSError if it is one), one `write` of the whole line, closed again (a few records per run: no descriptor
    outlives the generation that wrote). A process killed around it leaves the line whole or absent."""
    data = (json.dumps(event.record(), separators=(",", ":")) + "\n").encode()
    path = run_dir / EVENTS
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        written = os.write(fd, data)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(f"{path}: {written} of the record's {len(data)} bytes written")


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
