"""The `accounting` line at the end of a run (docs/design/accounting.md), typed: the run's time and work, by cause.

    accounting wall_s=<x> iterations=<n> productive_s=<x> recompute_s=<x> recovery_s=<x> detect_s=<x>
        failures=<n> recomputed=<n> tokens_per_s=<x> lost_tokens=<n> host_mb=<f1> log_mb=<f1>

(one line; `<x>` with 3 decimals, `<f1>` with one). `line()` is the console line byte for byte; `record()`
is the JSON object the run record keeps of it (`trainer/records/event_log.py`), numbers rounded as printed, and
`from_record(record).line()` the printed line again. Built by `trainer/records/accounting.py`. Imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

ONE_DECIMAL = ("host_mb", "log_mb")
WHOLE = ("iterations", "failures", "recomputed", "lost_tokens")


@dataclass(frozen=True)
class AccountingLine:
    """A run's accounting, from the start of its first attempt's training to the end of its last iteration
    or recovery (torchrun restarts and in-place replacements carried on)."""

    KIND: ClassVar[str] = "accounting"

    wall_s: float  # that wall time
    iterations: int  # iterations completed, each counted once
    productive_s: float  # their first executions
    recompute_s: float  # the training loop's executions of iterations done before (after a rollback)
    recovery_s: float  # the recoveries, each from its fault (detection included) to training going on
    detect_s: float  # of which: from the faults to their detection, where a clock saw the fault
    failures: int  # failures recovered: injected ones, real deaths and hangs, elastic shrinks
    recomputed: int  # iterations executed again by any stage: the loop's after a rollback, and the replays
    tokens_per_s: float  # goodput: the tokens of `iterations` (each once) per second of `wall_s`
    lost_tokens: int  # MoC's tokens lost to stale experts
    host_mb: float  # checkpoint host memory at the end, MB
    log_mb: float  # upstream log memory at the end, MB

    def line(self) -> str:
        """The console line, byte for byte the format above."""
        return "accounting " + " ".join(f"{k}={_printed(k, v)}" for k, v in asdict(self).items())

    def record(self) -> dict:
        """The run record's JSON object of this line."""
        fields = {k: (int if k in WHOLE else float)(_printed(k, v)) for k, v in asdict(self).items()}
        return {"kind": self.KIND, **fields}

    @classmethod
    def from_record(cls, record: dict) -> AccountingLine:
        """The line of a record `record()` wrote (KeyError, TypeError or ValueError if it is not one)."""
        return cls(**{k: v for k, v in record.items() if k != "kind"})


def _printed(key: str, value: float) -> str:
    """`value` of field `key` as the line prints it."""
    return f"{value:.0f}" if key in WHOLE else f"{value:.1f}" if key in ONE_DECIMAL else f"{value:.3f}"
