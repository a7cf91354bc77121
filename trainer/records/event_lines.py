"""The trainer's own event lines (docs/design/output-lines.md), typed: `step=...` after each iteration, `validation
step=...`, `elastic: ...` when an elastic job fits its layout, `fault: ...` when an injected death strikes and
`final step=...` at the end of a run. `line()` is the console line byte for byte; `record()` is the JSON
object the run record keeps of it (`trainer/records/event_log.py`), numbers rounded as the line prints them, and
`from_record(record).line()` is the printed line again. The recovery lines are in
`moevement/recovery/report.py`, a rank shell's in `trainer/lifecycle/shell_lines.py`, a survivor's in
`trainer/lifecycle/survivor_lines.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.typed_line import TypedLine

CRASH = "crash"  # FaultStrike.how of `fault.crash`: the process exits; a kill names its signal


@dataclass(frozen=True)
class FaultStrike(TypedLine):
    """An injected death strikes this process now:

        fault: rank <r> crashes at step <n>                                          (fault.crash)
        fault: rank <r> killed|stopped (<signal>) in the <phase> phase of step <n> at unix=<t>   (fault.kill)

    (`<t>` with 3 decimals; `killed` for SIGKILL, `stopped` for SIGSTOP, a hang)."""

    KIND: ClassVar[str] = "fault"
    ROUNDED: ClassVar[dict[str, int]] = {"unix": 3}

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


@dataclass(frozen=True)
class FinalLine(TypedLine):
    """The last line of a run, `final step=<n> loss=<f> state_digest=<sha256>` (`<f>` with 6 decimals): the
    last iteration, its loss and the digest of the whole training state (docs/design/output-lines.md)."""

    KIND: ClassVar[str] = "final"
    ROUNDED: ClassVar[dict[str, int]] = {"loss": 6}

    step: int
    loss: float
    state_digest: str

    def line(self) -> str:
        """The console line, byte for byte the format above."""
        return f"final step={self.step} loss={self.loss:.6f} state_digest={self.state_digest}"


def format_value(value: float) -> str:
    """A step line's number: an int as it is; a float with 6 decimals, or `%.3e` where that prints a value
    below 0.001 (so a printed value, read back, prints the same)."""
    if isinstance(value, int):
        return str(value)
    small = f"{value:.3e}"
    return small if value != 0 and abs(float(small)) < 1e-3 else f"{value:.6f}"


def printed_value(value: float) -> float:
    """`value` as `format_value` prints it (an int stays one)."""
    return value if isinstance(value, int) else float(format_value(value))


LATE = " (logged late: the rank that logs it died first)"


@dataclass(frozen=True)
class StepLine:
    """Iteration `step` is done: `step=<n> <name>=<value> ...` (`format_value`), its fields in order:

        step=<n> loss= aux_loss= lr= grad_norm= [<snapshot figures>] tok_per_s= tflops= [mfu=] wall_s=

    A `late` line is one rank 0 logs after a recovery for an iteration the rank that logs died before
    logging (trainer/records/metrics.py): it holds the scalars the strategy's log kept of it, and ends with
    `LATE` (the rates and snapshot figures died with the process that measured them)."""

    KIND: ClassVar[str] = "step"

    step: int
    fields: tuple[tuple[str, float], ...]
    late: bool = False

    def value(self, name: str) -> float:
        """The field `name` (KeyError if the line has none)."""
        return dict(self.fields)[name]

    def line(self) -> str:
        """The console line, byte for byte the format above."""
        text = " ".join([f"step={self.step}", *(f"{k}={format_value(v)}" for k, v in self.fields)])
        return text + (LATE if self.late else "")

    def record(self) -> dict:
        """The run record's JSON object of this line: its fields by name, in order, then `late`."""
        fields = {k: printed_value(v) for k, v in self.fields}
        return {"kind": self.KIND, "step": self.step, **fields, "late": self.late}

    @classmethod
    def from_record(cls, record: dict) -> StepLine:
        """The line of a record `record()` wrote (KeyError, TypeError or ValueError if it is not one)."""
        fields = tuple((k, v) for k, v in record.items() if k not in ("kind", "step", "late"))
        if not isinstance(record["step"], int) or not all(isinstance(v, int | float) for _, v in fields):
            raise ValueError("a step record holds numbers")
        return cls(record["step"], fields, bool(record["late"]))


@dataclass(frozen=True)
class ValidationLine(TypedLine):
    """`validation step=<n> val_loss=<f>` (6 decimals): the validation loss after iteration `step`."""

    KIND: ClassVar[str] = "validation"
    ROUNDED: ClassVar[dict[str, int]] = {"val_loss": 6}

    step: int
    val_loss: float

    def line(self) -> str:
        """The console line, byte for byte the format above."""
        return f"validation step={self.step} val_loss={self.val_loss:.6f}"


@dataclass(frozen=True)
class ElasticLayout(TypedLine):
    """An elastic job's layout on the processes of this torchrun round (it shrank or grew when `world` differs
    from the round before):

        elastic: <world> processes: pp=<p> dp=<d> ep=<e> micro_batches=<m> (configured dp=<d0> micro_batches=<m0>)
    """

    KIND: ClassVar[str] = "elastic"

    world: int
    pp: int
    dp: int
    ep: int
    micro_batches: int
    configured_dp: int
    configured_micro_batches: int

    def line(self) -> str:
        """The console line, byte for byte the format above."""
        return (
            f"elastic: {self.world} processes: pp={self.pp} dp={self.dp} ep={self.ep} "
            f"micro_batches={self.micro_batches} (configured dp={self.configured_dp} "
            f"micro_batches={self.configured_micro_batches})"
        )
