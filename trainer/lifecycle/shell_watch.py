"""The rank shell's own heartbeat, which its children watch (docs/design/lifecycle/detection.md, "The shell's own
heartbeat").

A trainer says `alive` to its shell every second, and a shell ends a trainer silent for longer than the
hang bound (`fault.heartbeat_timeout_s`, or a shorter `fault.timeout_s`: `verdict.hang_bound`;
`rank_shell.RankShell`, `verdict.a_frozen_child`). The other way round, a
stopped or stuck shell would replace nobody, and torchrun, which waits on the shell, would wait for ever
(even after the job's `final` line). So the shell beats to each of its children (the trainer and the
standby) every second, one byte on a pipe of that child's own (`ShellBeats`), and each child watches its
pipe from a thread (`watch_shell`): a child that hears nothing for longer than the same bound
(`verdict.a_silent_shell`: the trainer first, the standby a little later) prints one `shell:` line and
SIGKILLs the shell. Its children die with it (`PR_SET_PDEATHSIG`); torchrun sees its worker killed and
restarts every worker (`--max-restarts`: the survivors keep their state and only this rank's stages
replay) or ends the job. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainer.event_writer import append_event
from trainer.lifecycle.shell_lines import SHELL_SILENT, ShellLine
from trainer.lifecycle.verdict import a_silent_shell

BEATS_FD = "MOEVEMENT_SHELL_BEATS_FD"  # in a shell's child: the read end of its shell's beats
HANG_BOUND = "MOEVEMENT_HANG_BOUND"  # in a shell's child: `<key>=<seconds>` (`verdict.hang_bound`)
HEARTBEAT_S = 1.0  # how often a shell and its trainer beat to each other


def say(line: ShellLine, run_dir: Path | None) -> None:
    """Print `line` and record it in the run's events.jsonl when the run folder `run_dir` is on this host (a
    process on another node than rank 0, without a shared file system, keeps its lines printed only)."""
    if run_dir is not None and run_dir.is_dir():
        try:
            append_event(run_dir, line)
        except OSError as e:
            print(f"run record: {run_dir}: cannot record the event ({e}); it is printed only", flush=True)
    print(line.line(), flush=True)


class ShellBeats:
    """The shell's side: the write end of each child's pipe, by child pid. Non-blocking: a child that does not
    read (frozen, or busy holding its interpreter) fills its pipe in hours, and then misses beats, never
    blocks the shell. Shell's thread only."""

    def __init__(self):
        self.ends: dict[int, int] = {}
        self.last = 0.0  # monotonic time of the newest beat

    @staticmethod
    def pipe() -> tuple[int, int]:
        """(read end for a child to be started, write end for `add`)."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        return read_end, write_end

    def add(self, pid: int, write_end: int) -> None:
        self.ends[pid] = write_end

    def drop(self, pid: int) -> None:
        """Child `pid` ended: close its pipe."""
        end = self.ends.pop(pid, None)
        if end is not None:
            os.close(end)

    def beat(self) -> None:
        """One byte to every child, at most every `HEARTBEAT_S`."""
        now = time.monotonic()
        if now - self.last < HEARTBEAT_S:
            return
        self.last = now
        for end in self.ends.values():
            try:
                os.write(end, b".")
            except (BlockingIOError, BrokenPipeError):
                pass  # a child not reading, or gone (the shell's loop notices that)


def watch_shell(role: Callable[[], str], run_dir: Callable[[], Path | None]) -> None:
    """In a shell's child, once its imports are done: watch the shell's beats from a daemon thread and end a
    shell silent past the hang bound (module docstring). `role()`: "trainer" or "standby" now
    (a standby becomes the trainer when activated); `run_dir()`: the run folder, if the child knows it.
    Nothing outside a shell."""
    fd, bound = os.environ.get(BEATS_FD), os.environ.get(HANG_BOUND)
    if fd is None or bound is None:
        return
    key, _, seconds = bound.rpartition("=")
    args = (int(fd), (key, float(seconds)), os.getppid(), role, run_dir)
    threading.Thread(target=_watch, args=args, name="moevement-shell-watch", daemon=True).start()


def _watch(
    fd: int, bound: tuple[str, float], shell: int, role: Callable[[], str], run_dir: Callable[[], Path | None]
) -> None:
    key, bound_s = bound
    heard = time.monotonic()
    while True:
        ready, _, _ = select.select([fd], [], [], HEARTBEAT_S / 4)
        now = time.monotonic()
        if ready:
            if not os.read(fd, 4096):
                return  # the shell closed the pipe: it is ending, and this process with it
            heard = now
        elif a_silent_shell(now - heard, bound_s, role() == "standby"):
            rank, silent = os.environ.get("RANK", "?"), now - heard
            line = ShellLine(SHELL_SILENT, rank, shell, role(), silent_s=silent, bound_s=bound_s, bound_key=key)
            say(dataclasses.replace(line, by=os.getpid()), run_dir())
            os.kill(shell, signal.SIGKILL)  # this process dies with it (PR_SET_PDEATHSIG)
            return
