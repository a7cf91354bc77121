"""The `recovery step=...` and `recovery work ...` console lines (docs/design/output-lines.md), one format for every
strategy, and the records rank 0 keeps of them in the run's `events.jsonl` (`trainer/records/event_log.py`).

The line's bytes are a contract:

    recovery step=<T> ranks=<ranks> scope=<stages> rollback_to=<t0> replayed=<n> seconds=<x>
        ([<stage seconds> ]fetch=<x> convert=<x> catchup=<x>)[ detect=<x>][ fault_step=<n>][ <field>...]

(one line; `<x>` with 3 decimals). `seconds` counts from the failure's detection; `detect`, the seconds from the fault
to that detection, where a clock saw the fault: 0 for an injected failure (`fault.at`: every rank knows it at once), a
dead or frozen trainer's rank shell's clock for a worker replaced in place (the death it saw, or the frozen trainer's
last heartbeat); after torchrun's restart of every worker no process saw it, and the line leaves `detect` out.
`fault_step` is the iteration the fault struck in, where it is known: T for an injected failure, the iteration a dead or
frozen trainer had begun by its rank shell's record (`step` is always the iteration training goes on with: after a death
in T's optimizer step, which every survivor finished, `step` is T+1 and `fault_step` T). MoEvement's localized recovery,
its whole-job restart and rejoin, and the interval baselines all print it through `RecoveryReport.line`. A record
(`record()`) holds the same fields as typed JSON values, numbers rounded as the line prints them, so
`from_record(record).line()` is the printed line again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ShellFault:
    """The fault a replacement in place stands in for, as the dead trainer's rank shell saw it: when it struck
    (unix seconds by the shell's clock: the death it saw, or a frozen trainer's last heartbeat) and the
    iteration the trainer had begun (`step`; None: it died before beginning one)."""

    unix: float
    step: int | None = None


def _printed(value: float, decimals: int) -> float:
    """`value` as the line prints it with `decimals` decimals (the record's number)."""
    return float(f"{value:.{decimals}f}")


@dataclass(frozen=True)
class RecoveryReport:
    """What one recovery did, as rank 0 prints it. Plain values: building one needs no collective (the
    caller has already taken every rank's slowest `fetch`, `convert` and `catchup`).

    The fields after the parenthesis are None when the line leaves them out. An interval baseline's report
    (`strategy` set) writes no failed rank as `ranks=none` and its scope, every stage, as `0-<S-1>` even for
    one stage; then `strategy`, `snapshots_from`, MoC's `lost_tokens plt k_pec`, and `restart`. MoEvement's
    writes `restart` first, then `snapshots_from` (a whole-job restart) or `detected_by` (a rejoin). Either
    starts with `detect` where it is known."""

    KIND: ClassVar[str] = "recovery"

    step: int  # the iteration training goes on with
    ranks: tuple[int, ...]  # the ranks that lost their state, ascending
    scope: tuple[int, ...]  # the stages that rolled back, ascending
    rollback_to: int  # the iteration the rolled-back stages restarted from
    replayed: int  # iterations replayed (or, for the baselines, to be run again)
    seconds: float  # the whole recovery, as the strategy measures it
    fetch: float
    convert: float
    catchup: float = 0.0
    restart_seconds: tuple[tuple[str, float], ...] = ()  # a restart's seconds by stage, before `fetch`
    restart: str | None = None  # how the job restarted: global, local, replaced, global-replay
    strategy: str | None = None  # an interval baseline's name
    snapshots_from: tuple[str, ...] | None = None  # "rank<r>: <copy>" per rank named
    detected_by: tuple[str, ...] | None = None  # "rank<r>: <how>" per survivor, earliest first
    lost_tokens: float | None = None  # MoC's tokens lost by this recovery, with its `plt` and `k_pec`
    plt: float | None = None
    k_pec: int | None = None
    detect: float | None = None  # seconds from the fault to its detection (None: no clock saw the fault)
    fault_step: int | None = None  # the iteration the fault struck in (None: unknown)

    def line(self) -> str:
        """The console line, byte for byte the format above."""
        parts = [f"{name}={s:.3f}" for name, s in self.restart_seconds]
        parts += [f"fetch={self.fetch:.3f}", f"convert={self.convert:.3f}", f"catchup={self.catchup:.3f}"]
        return (
            f"recovery step={self.step} ranks={self._ranks()} scope={self._scope()} rollback_to={self.rollback_to} "
            f"replayed={self.replayed} seconds={self.seconds:.3f} ({' '.join(parts)})"
            + "".join(f" {field}" for field in self._fields())
        )

    def _ranks(self) -> str:
        return rank_list(self.ranks) or ("none" if self.strategy is not None else "")

    def _scope(self) -> str:
        if self.strategy is not None:  # every stage, written as a range even when there is one
            return f"0-{self.scope[-1]}"
        return stage_ranges(self.scope)

    def _fields(self) -> list[str]:
        """What follows the parenthesis, in the order of the class docstring."""
        detect = [f"detect={self.detect:.3f}"] if self.detect is not None else []
        if self.fault_step is not None:
            detect.append(f"fault_step={self.fault_step}")
        restart = [f"restart={self.restart}"] if self.restart is not None else []
        if self.strategy is not None:
            out = [f"strategy={self.strategy}", quoted("snapshots_from", self.snapshots_from or ())]
            if self.lost_tokens is not None:
                out.append(f"lost_tokens={self.lost_tokens:.0f} plt={self.plt:.4f} k_pec={self.k_pec}")
            return detect + out + restart
        named = [("snapshots_from", self.snapshots_from), ("detected_by", self.detected_by)]
        return detect + restart + [quoted(name, parts) for name, parts in named if parts is not None]

    def parts(self) -> dict[str, float]:
        """The seconds in the parenthesis by name, rounded as printed: the restart's stages, fetch, convert,
        catchup."""
        named = [*self.restart_seconds, ("fetch", self.fetch), ("convert", self.convert), ("catchup", self.catchup)]
        return {name: _printed(s, 3) for name, s in named}

    def record(self) -> dict:
        """The run record's JSON object of this line."""
        return {
            "kind": self.KIND,
            "step": self.step,
            "ranks": list(self.ranks),
            "scope": list(self.scope),
            "rollback_to": self.rollback_to,
            "replayed": self.replayed,
            "seconds": _printed(self.seconds, 3),
            "fetch": _printed(self.fetch, 3),
            "convert": _printed(self.convert, 3),
            "catchup": _printed(self.catchup, 3),
            "restart_seconds": {name: _printed(s, 3) for name, s in self.restart_seconds},
            "restart": self.restart,
            "strategy": self.strategy,
            "snapshots_from": None if self.snapshots_from is None else list(self.snapshots_from),
            "detected_by": None if self.detected_by is None else list(self.detected_by),
            "lost_tokens": None if self.lost_tokens is None else int(_printed(self.lost_tokens, 0)),
            "plt": None if self.plt is None else _printed(self.plt, 4),
            "k_pec": self.k_pec,
            "detect": None if self.detect is None else _printed(self.detect, 3),
            "fault_step": self.fault_step,
        }

    @classmethod
    def from_record(cls, record: dict) -> RecoveryReport:
        """The report of a record `record()` wrote (KeyError, TypeError or ValueError if it is not one)."""
        fields = {k: v for k, v in record.items() if k != "kind"}
        for name in ("ranks", "scope", "snapshots_from", "detected_by"):
            fields[name] = None if fields[name] is None else tuple(fields[name])
        fields["restart_seconds"] = tuple(fields["restart_seconds"].items())
        return cls(**fields)


@dataclass(frozen=True)
class RecoveryWork:
    """One rank's `recovery work` line (rank 0 prints one per rank after each MoEvement recovery line):

        recovery work rank=<r> role=failed|rolled-back|healthy forwards=<n> backwards=<n>[ threads=<n>]
            [ snapshots_from=<source>][ build_s=<s>][ prebuilt=<parts>][ replay_s=<phase>:<s>,...]

    (one line; `<s>` with 2 decimals). A healthy rank ran nothing: 0 forwards and 0 backwards. After a
    restart (a rejoin) each rank says how long it built its data, model and optimizer (`build_s`: from its
    generation's device mesh to its model; the stages of the rebuild around it wait on collectives, so they
    end alike on every rank), and a replacement that a warm standby had built before its activation what
    it built (`prebuilt`: data, or data+model; trainer/run/prebuilt.py)."""

    KIND: ClassVar[str] = "recovery_work"

    rank: int
    role: str  # failed, rolled-back or healthy
    forwards: int  # stage forwards this rank ran for the recovery
    backwards: int
    threads: int = 0  # intra-op threads it replayed with (0: it did not replay; the line leaves it out)
    snapshots_from: str | None = None  # where a failed rank's snapshots came from ("rank<q>", ...)
    replay_s: tuple[tuple[str, float], ...] = ()  # a replaying rank's seconds per replay phase, in order
    build_s: float | None = None  # after a restart: seconds this rank built its data, model and optimizer
    prebuilt: str | None = None  # what a warm standby built of this rank before its activation

    def line(self) -> str:
        """The console line, byte for byte the format above."""
        text = f"recovery work rank={self.rank} role={self.role} forwards={self.forwards} backwards={self.backwards}"
        text += f" threads={self.threads}" if self.threads else ""
        text += f" snapshots_from={self.snapshots_from}" if self.snapshots_from is not None else ""
        text += f" build_s={self.build_s:.2f}" if self.build_s is not None else ""
        text += f" prebuilt={self.prebuilt}" if self.prebuilt is not None else ""
        phases = ",".join(f"{phase}:{s:.2f}" for phase, s in self.replay_s)
        return text + (f" replay_s={phases}" if phases else "")

    def record(self) -> dict:
        """The run record's JSON object of this line."""
        return {
            "kind": self.KIND,
            "rank": self.rank,
            "role": self.role,
            "forwards": self.forwards,
            "backwards": self.backwards,
            "threads": self.threads,
            "snapshots_from": self.snapshots_from,
            "replay_s": {phase: _printed(s, 2) for phase, s in self.replay_s},
            "build_s": None if self.build_s is None else _printed(self.build_s, 2),
            "prebuilt": self.prebuilt,
        }

    @classmethod
    def from_record(cls, record: dict) -> RecoveryWork:
        """The line of a record `record()` wrote (KeyError, TypeError or ValueError if it is not one)."""
        fields = {k: v for k, v in record.items() if k != "kind"}
        return cls(**{**fields, "replay_s": tuple(fields["replay_s"].items())})


@dataclass(frozen=True)
class RecoveryFigures:
    """What a recovery did, the figures of its `recovery step=...` line (rank 0 prints it; every rank keeps
    them): a `recover`, or a restarted generation's rejoin or restart."""

    step: int  # the iteration training went on with (the failures struck before it)
    ranks: tuple[int, ...]  # the failed ranks, ascending
    scope_ranks: int  # the ranks that rolled back: the failed stages' groups (every rank under a global rollback)
    rollback_to: int  # the iteration the rolled-back ranks replayed (or, for a baseline, train again) from
    seconds: float  # the recovery's wall time, as its line says
    detect: float = 0.0  # seconds from the fault to its detection, as its line says (0: not known)
    replays: int = 0  # iterations the recovery itself ran again (a baseline's are the training loop's)

    @property
    def replayed(self) -> int:
        """Iterations the rolled-back ranks run again: rollback_to .. step-1."""
        return self.step - self.rollback_to

    @classmethod
    def of(cls, report: RecoveryReport, failed: Iterable[int], scope_ranks: int) -> RecoveryFigures:
        """The figures of the line `report` prints, for the ranks `failed` and `scope_ranks` rolled back.
        MoEvement's stages replay inside the recovery (`replayed`); an interval baseline's rollback leaves
        its iterations to the training loop, which counts them as it runs them again."""
        replays = report.replayed if report.strategy is None else 0
        failed = tuple(sorted(failed))
        return cls(report.step, failed, scope_ranks, report.rollback_to, report.seconds, report.detect or 0.0, replays)


def detect_seconds(detected: float | None, faults: Iterable[ShellFault | None]) -> float | None:
    """Seconds from the earliest fault a rank shell saw (`faults`: one per rank, None where none did) to its
    first detection (`detected`, unix); None when either is unknown. A clock a little ahead gives 0, not less."""
    known = [f.unix for f in faults if f is not None]
    if detected is None or not known:
        return None
    return max(0.0, detected - min(known))


def fault_step(faults: Iterable[ShellFault | None]) -> int | None:
    """The earliest iteration a fault a rank shell saw struck in (`faults`: one per rank); None if none is
    known (no shell saw one, or its trainer died before beginning an iteration)."""
    return min((f.step for f in faults if f is not None and f.step is not None), default=None)


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
