"""The trainer's own event lines (docs/design.md §5), typed: `fault: ...` when an injected death strikes and
`final step=...` at the end of a run. `line()` is the console line byte for byte; `record()` is the JSON
object the run record keeps of it (`trainer/run/event_log.py`), numbers rounded as the line prints them, and
`from_record(record).line()` is the printed line again. The recovery lines are in
`moevement/recovery/report.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

CRASH = "crash"  # FaultStrike.how of `fault.crash`: the process exits; a kill names its signal


@dataclass(frozen=True)
class FaultStrike:
    """An injected death strikes this process now:

        fault: rank <r> crashes at step <n>                                          (fault.crash)
        fault: rank <r> killed|stopped (<signal>) in the <phase> phase of step <n> at unix=<t>   (fault.kill)

    (`<t>` with 3 decimals; `killed` for SIGKILL, `stopped` for SIGSTOP, a hang)."""

    KIND: ClassVar[str] = "fault"

    rank: int
    step: int
    how: str = CRASH  # CRASH, or the signal of a kill: SIGKILL, SIGSTOP
    phase: str | None = None  # a kill's phase of iteration `step`
    unix: float | None = None  # when a kill struck (unix seconds)

    def line(self) -> str:
        """The console line, byte for byte the formats above."""
        if self.how == CRASH:
            return f"fault: rank {self.rank} crashes at step {self.step}"
        verb = "killed" if self.how == "SIGKILL" else "stopped"
        return (
            f"fault: rank {self.rank} {verb} ({self.how}) in the {self.phase} phase of step {self.step} "
            f"at unix={self.unix:.3f}"
        )

    def record(self) -> dict:
        """The run record's JSON object of this line."""
        unix = None if self.unix is None else float(f"{self.unix:.3f}")
        return {
            "kind": self.KIND,
            "rank": self.rank,
            "step": self.step,
            "how": self.how,
            "phase": self.phase,
            "unix": unix,
        }

    @classmethod
    def from_record(cls, record: dict) -> FaultStrike:
        """The line of a record `record()` wrote (KeyError, TypeError or ValueError if it is not one)."""
        return cls(**{k: v for k, v in record.items() if k != "kind"})


@dataclass(frozen=True)
class FinalLine:
    """The last line of a run, `final step=<n> loss=<f> state_digest=<sha256>` (`<f>` with 6 decimals): the
    last iteration, its loss and the digest of the whole training state (docs/design.md §5)."""

    KIND: ClassVar[str] = "final"

    step: int
    loss: float
    state_digest: str

    def line(self) -> str:
        """The console line, byte for byte the format above."""
        return f"final step={self.step} loss={self.loss:.6f} state_digest={self.state_digest}"

    def record(self) -> dict:
        """The run record's JSON object of this line."""
        loss = float(f"{self.loss:.6f}")
        return {"kind": self.KIND, "step": self.step, "loss": loss, "state_digest": self.state_digest}

    @classmethod
    def from_record(cls, record: dict) -> FinalLine:
        """The line of a record `record()` wrote (KeyError, TypeError or ValueError if it is not one)."""
        return cls(**{k: v for k, v in record.items() if k != "kind"})
