"""A rank shell's `shell:` lines (docs/design/output-lines.md), typed: what happened to its trainer or its standby, and
the line a shell's child prints when it ends a shell that stopped beating.

`line()` is the console line byte for byte; `record()` is the JSON object the run record keeps of it
(`trainer/records/event_log.py`), `from_record(record).line()` the printed line again. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.typed_line import TypedLine

REPLACED = "replaced"  # the trainer died; the standby replaces it in the next generation
HANDED_BACK = "handed_back"  # the trainer died with no standby or no replacement left: torchrun restarts
AFTER_THE_END = "after_the_end"  # the trainer died after the job finished: nothing to recover
STANDBY_RESPAWNED = "standby_respawned"  # the idle standby died and a new one was started
STANDBY_LOST = "standby_lost"  # the idle standby died and none is left to start
FROZEN = "frozen"  # the trainer said nothing for longer than the hang bound: killed (then replaced)
SHELL_SILENT = "shell_silent"  # the shell beat to its child for longer than that bound: the child killed it


@dataclass(frozen=True)
class ShellLine(TypedLine):
    """One `shell: rank <r>: ...` line:

        trainer pid <p> died (<how>) at unix=<t>; standby pid <s> replaces it in generation <g>
            (replacement <n> of <limit>)                                                       (REPLACED)
        trainer pid <p> died (<how>); <why>: torchrun restarts                                 (HANDED_BACK)
        trainer pid <p> died (<how>) after the job finished at step <n>; nothing to recover    (AFTER_THE_END)
        standby pid <p> died (<how>); standby pid <s> takes its place (<n> of <limit>)         (STANDBY_RESPAWNED)
        standby pid <p> died (<how>); none left to start                                       (STANDBY_LOST)
        trainer pid <p> said nothing for <s> s (more than <key>=<T> s): frozen; killed           (FROZEN)
        rank shell pid <p> said nothing for <s> s (more than <key>=<T> s): stopped or stuck; killed by its
            <trainer|standby> pid <c> (its children die with it: torchrun restarts or ends the job)
                                                                                               (SHELL_SILENT)

    (`<t>` with 3 decimals; `<how>`: `signal SIGKILL` or `exit status <n>`; `<key>=<T>`: the hang bound,
    `fault.heartbeat_timeout_s` or a shorter `fault.timeout_s`: `verdict.hang_bound`)."""

    KIND: ClassVar[str] = "shell"
    ROUNDED: ClassVar[dict[str, int]] = {"unix": 3, "silent_s": 1}

    what: str
    rank: str  # the slot's RANK ("?" if torchrun named none)
    pid: int  # the child that died
    how: str  # how the child died; SHELL_SILENT: the role of the child that killed the shell
    standby: int | None = None  # the standby that replaces it or takes the dead standby's place
    count: int | None = None  # replacements (or respawned standbys) so far, this one included
    limit: int | None = None  # fault.max_replacements
    generation: int | None = None  # REPLACED: the generation the replacement joins
    unix: float | None = None  # REPLACED: when the shell saw the death
    step: int | None = None  # AFTER_THE_END: the step the job finished at
    why: str | None = None  # HANDED_BACK: "no standby" or "replacements spent"
    silent_s: float | None = None  # FROZEN, SHELL_SILENT: how long the trainer (the shell) said nothing
    bound_s: float | None = None  # FROZEN, SHELL_SILENT: the hang bound, seconds
    bound_key: str | None = None  # ... and the key that set it
    by: int | None = None  # SHELL_SILENT: the child that killed the shell

    def line(self) -> str:
        """The console line, byte for byte the formats above."""
        head = f"shell: rank {self.rank}: "
        died = f"pid {self.pid} died ({self.how})"
        if self.what == REPLACED:
            return (
                f"{head}trainer {died} at unix={self.unix:.3f}; standby pid {self.standby} replaces it in "
                f"generation {self.generation} (replacement {self.count} of {self.limit})"
            )
        if self.what == HANDED_BACK:
            return f"{head}trainer {died}; {self.why}: torchrun restarts"
        if self.what == AFTER_THE_END:
            return f"{head}trainer {died} after the job finished at step {self.step}; nothing to recover"
        if self.what == STANDBY_RESPAWNED:
            return f"{head}standby {died}; standby pid {self.standby} takes its place ({self.count} of {self.limit})"
        if self.what == STANDBY_LOST:
            return f"{head}standby {died}; none left to start"
        if self.what == FROZEN:
            return f"{head}trainer pid {self.pid} {self._silent()}: frozen; killed"
        if self.what == SHELL_SILENT:
            return (
                f"{head}rank shell pid {self.pid} {self._silent()}: stopped or stuck; killed by its {self.how} pid "
                f"{self.by} (its children die with it: torchrun restarts or ends the job)"
            )
        raise ValueError(f"unknown shell line {self.what!r}")

    def _silent(self) -> str:
        return f"said nothing for {self.silent_s:.1f} s (more than {self.bound_key}={self.bound_s:g} s)"
