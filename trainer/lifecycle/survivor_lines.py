"""A surviving rank's lines after a peer's death (docs/design/output-lines.md), typed: what it kept and where it goes.

`line()` is the console line byte for byte; `record()` is the JSON object the run record keeps of it
(`trainer/records/event_log.py`), `from_record(record).line()` the printed line again. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.typed_line import TypedLine

REJOINS = "rejoins"  # keeps its state in memory and joins the next in-place generation
START_FAILED = "start_failed"  # a peer died while a generation started: joins the next one
DETECTED = "detected"  # kept its state in host memory and exits for torchrun's restart of every worker
PREEMPTED = "preempted"  # torchrun's (or a scheduler's) SIGTERM: kept its host state and exits


@dataclass(frozen=True)
class SurvivorLine(TypedLine):
    """One line of a rank that outlives a peer's death, or is stopped by SIGTERM:

        survivor: rank <r> pid <p> (running since unix=<t>) at step <n>: <how>; kept <kept>; joins generation
            <g> (detected at unix=<t>)                                                             (REJOINS)
        survivor: rank <r> pid <p>: a peer died while generation <g-1> started; joins generation <g>
                                                                                              (START_FAILED)
        failure detected: rank <r> at step <n> by <how>; kept <kept> (detected at unix=<t>)       (DETECTED)
        preempted: rank <r> received SIGTERM at step <n>; host state kept (<kept>): <resumes>[ (detected at
            unix=<t>)]                                                                           (PREEMPTED)

    (`<t>` with 3 decimals; a preemption before training says no detection time)."""

    KIND: ClassVar[str] = "survivor"
    ROUNDED: ClassVar[dict[str, int]] = {"since_unix": 3, "detected_unix": 3}

    what: str
    rank: int
    step: int | None = None  # the iteration the rank was at (none for START_FAILED)
    pid: int | None = None  # REJOINS, START_FAILED
    since_unix: float | None = None  # REJOINS: when the process started
    how: str | None = None  # how the death was detected (REJOINS, DETECTED)
    kept: str | None = None  # what the rank kept: "live state of iteration <n> ...", "no live state", ...
    generation: int | None = None  # REJOINS, START_FAILED: the generation it joins
    detected_unix: float | None = None  # when the rank learnt of the death (or of SIGTERM)
    resumes: str | None = None  # PREEMPTED: what a restart or relaunch resumes from

    def line(self) -> str:
        """The console line, byte for byte the formats above."""
        when = "" if self.detected_unix is None else f" (detected at unix={self.detected_unix:.3f})"
        if self.what == REJOINS:
            return (
                f"survivor: rank {self.rank} pid {self.pid} (running since unix={self.since_unix:.3f}) at step "
                f"{self.step}: {self.how}; kept {self.kept}; joins generation {self.generation}{when}"
            )
        if self.what == START_FAILED:
            return (
                f"survivor: rank {self.rank} pid {self.pid}: a peer died while generation {self.generation - 1} "
                f"started; joins generation {self.generation}"
            )
        if self.what == DETECTED:
            return f"failure detected: rank {self.rank} at step {self.step} by {self.how}; kept {self.kept}{when}"
        if self.what == PREEMPTED:
            return (
                f"preempted: rank {self.rank} received SIGTERM at step {self.step}; host state kept ({self.kept}): "
                f"{self.resumes}{when}"
            )
        raise ValueError(f"unknown survivor line {self.what!r}")
