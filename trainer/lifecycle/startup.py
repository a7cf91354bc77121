"""When this worker process started and reached each stage of its set-up (unix seconds).

After a real death every worker is started again, so this is the restart cost that every rank and every
checkpoint strategy pays; a rejoin prints it stage by stage (`restart timeline`). Stages, in order:
`exec` (the kernel started the process), `python` (the interpreter reached train.py), `imports` (torch
and the trainer imported), `process_group`, `mesh` (the device mesh's groups), `model` (data, model,
optimizer; a warm standby's prebuilt ones taken on), `strategy` (host state read, snapshot buffers,
checkpoint strategy built).
"""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """Unix time the kernel started this process (Linux `/proc`; now, where it cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Startup:
    """Marks of this process's set-up; `exec` is read from the kernel, the others are taken as reached."""

    def __init__(self):
        now = time.time()
        self.marks = {"exec": min(process_start_time(), now), "python": now}

    def mark(self, stage: str) -> None:
        self.marks[stage] = time.time()


STARTUP = Startup()  # train.py imports this module first, before torch
