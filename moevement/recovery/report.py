"""The `recovery step=...` console line (docs/design.md §5), one format for every strategy.

Tests and benchmarks parse the line with regular expressions, so its bytes are a contract:

    recovery step=<T> ranks=<ranks> scope=<stages> rollback_to=<t0> replayed=<n> seconds=<x>
        ([<stage seconds> ]fetch=<x> convert=<x> catchup=<x>)[ <field>...]

(one line; `<x>` with 3 decimals). MoEvement's localized recovery, its whole-job restart and rejoin, and
the interval baselines all print it through `RecoveryReport.line`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RecoveryReport:
    """What one recovery did, as rank 0 prints it. Plain values: building one needs no collective (the
    caller has already taken every rank's slowest `fetch`, `convert` and `catchup`)."""

    step: int  # the iteration training goes on with
    ranks: str  # the ranks that lost their state, as `rank_list` writes them (the baselines: "none" for none)
    scope: str  # the stages that rolled back, as `stage_ranges` writes them (the baselines: "0-<S-1>", always)
    rollback_to: int  # the iteration the rolled-back stages restarted from
    replayed: int  # iterations replayed (or, for the baselines, to be run again)
    seconds: float  # the whole recovery, as the strategy measures it
    fetch: float
    convert: float
    catchup: float = 0.0
    restart_seconds: str = ""  # a restart's seconds by stage, before `fetch` ("keep=<x> restart=<x> setup=<x>")
    fields: tuple[str, ...] = ()  # what follows the parenthesis, in order, each after a space: `key=value`...

    def line(self) -> str:
        """The console line, byte for byte the format above."""
        parts = [self.restart_seconds] if self.restart_seconds else []
        parts += [f"fetch={self.fetch:.3f}", f"convert={self.convert:.3f}", f"catchup={self.catchup:.3f}"]
        return (
            f"recovery step={self.step} ranks={self.ranks} scope={self.scope} rollback_to={self.rollback_to} "
            f"replayed={self.replayed} seconds={self.seconds:.3f} ({' '.join(parts)})"
            + "".join(f" {field}" for field in self.fields)
        )


@dataclass(frozen=True)
class RecoveryFigures:
    """What a recovery did, the figures of its `recovery step=...` line (rank 0 prints it; every rank keeps
    them): a `recover`, or a restarted generation's rejoin or restart."""

    step: int  # the iteration training went on with (the failures struck before it)
    ranks: tuple[int, ...]  # the failed ranks, ascending
    scope_ranks: int  # the ranks that rolled back: the failed stages' groups (every rank under a global rollback)
    rollback_to: int  # the iteration the rolled-back ranks replayed (or, for a baseline, train again) from
    seconds: float  # the recovery's wall time, as its line says

    @property
    def replayed(self) -> int:
        """Iterations the rolled-back ranks run again: rollback_to .. step-1."""
        return self.step - self.rollback_to

    @classmethod
    def of(cls, report: RecoveryReport, failed: Iterable[int], scope_ranks: int) -> RecoveryFigures:
        """The figures of the line `report` prints, for the ranks `failed` and `scope_ranks` rolled back."""
        return cls(report.step, tuple(sorted(failed)), scope_ranks, report.rollback_to, report.seconds)


def rank_list(ranks: Iterable[int]) -> str:
    """{3, 1} -> "1+3" (empty: "")."""
    return "+".join(map(str, sorted(ranks)))


def stage_ranges(stages: Iterable[int]) -> str:
    """{1, 2, 3, 5} -> "1-3,5" (empty: "")."""
    stages = sorted(stages)
    out, i = [], 0
    while i < len(stages):
        j = i
        while j + 1 < len(stages) and stages[j + 1] == stages[j] + 1:
            j += 1
        out.append(str(stages[i]) if i == j else f"{stages[i]}-{stages[j]}")
        i = j + 1
    return ",".join(out)


def quoted(name: str, parts: Iterable[str]) -> str:
    """A field whose value holds spaces: `name="a; b"`."""
    return f'{name}="{"; ".join(parts)}"'
