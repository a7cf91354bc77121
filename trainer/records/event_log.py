"""A run's events as records: `<run folder>/events.jsonl`, the truth the console lines are a view of
(docs/design/event-records.md).

Every line a user or a tool reads is one JSON object on one line of this file, written from the same typed
object that prints the line (`record()`, with its `"kind"`; `from_record(record).line()` is the printed line
again): `step` (every iteration, printed every `metrics.log_every`), `validation`, `elastic`, `fault`,
`survivor`, `recovery`, `recovery_work`, the `checkpoint_*` kinds (`trainer.checkpoint.events`),
`accounting`, `final`, and a rank shell's `shell`. Any trainer process that knows the run folder and sees it
records its own events (`record_events_in`, `say`: `trainer/event_writer.py`): rank 0, which opens the
folder, and every other rank once rank 0 has named it on torchrun's store, where the folder is on its host's
file system (rank 0's host, or a shared one; elsewhere its lines are printed only). Rank shells (and their
children) learn it from their trainer. Every writer appends a whole line with one `write` in append mode
(`append_event`), so writers never interleave inside a line; a torchrun restart or an in-place replacement
continues the run folder (`open_run_record`), so a later generation's records follow the earlier ones'.

Tests, benchmarks and eval/ read a run's events here (`run_events`) instead of parsing its stdout: the one
parse left is of the `run: <dir>` lines that name the folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from moevement.recovery.report import RecoveryReport, RecoveryWork
from trainer.checkpoint.events import CHECKPOINT_EVENTS, CheckpointEvent
from trainer.event_writer import EVENTS
from trainer.lifecycle.shell_lines import ShellLine
from trainer.lifecycle.survivor_lines import SurvivorLine
from trainer.records.accounting_line import AccountingLine
from trainer.records.event_lines import ElasticLayout, FaultStrike, FinalLine, StepLine, ValidationLine

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
