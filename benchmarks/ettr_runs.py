"""What `benchmarks.ettr` reads of one training run, and its figures against the fault-free references.

`parse_run` is the one place that reads a run: its recorded events (`trainer.records.event_log.run_events`, the
run folder its `run: <dir>` line names), never its stdout: its `step` records (each iteration once, its first
execution), its `accounting` record, which becomes a `RunTotals`, its recoveries (`RecoveryReport`) and its
final line (`FinalLine`).

Start-up is charged alike to every run, the references included: a strategy's useful time is what its two
bracketing `none` references took, wall clock from the start of training, for the same iterations
(`Reference.useful_s`), so a strategy loses only the start-up it spends beyond theirs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields

from moevement.recovery.report import RecoveryReport
from trainer.records.accounting_line import AccountingLine
from trainer.records.event_lines import FinalLine, StepLine
from trainer.records.event_log import RunEvent

WARMUP = 3  # first iterations (allocation, profiling) left out of per-iteration means
REPLAY_PARTS = ("fetch", "convert", "catchup")  # the rest of a recovery line's seconds: detection and restart


@dataclass(frozen=True)
class RunTotals:
    """A run's accounting: its training wall seconds (first iteration to the last iteration or recovery),
    iterations trained (first executions), their seconds, the seconds of recomputed iterations and of
    recoveries, failures, recomputed iterations and the tokens MoC's stale restores lost."""

    wall_s: float
    iterations: int
    productive_s: float
    recompute_s: float
    recovery_s: float
    failures: int
    recomputed: int
    lost_tokens: float
    host_mb: float = 0.0  # checkpoint host memory at the end (not kept by every record: 0)
    log_mb: float = 0.0

    @classmethod
    def of(cls, values: dict[str, float]) -> RunTotals:
        """From an accounting line's or record's fields (others ignored; ValueError naming one missing)."""
        kept = {}
        for f in fields(cls):
            if f.name in values:
                kept[f.name] = int(values[f.name]) if f.type == "int" else float(values[f.name])
            elif f.name not in ("host_mb", "log_mb"):
                raise ValueError(f"accounting: no {f.name}")
        return cls(**kept)


@dataclass(frozen=True)
class Run:
    """One training run as the benchmark reads it: its step records (each iteration once, as first executed;
    a `late` one, logged after rank 0's death, holds no rates), its totals, recoveries and final line (None:
    none)."""

    steps: list[dict[str, float]]
    totals: RunTotals
    recoveries: list[RecoveryReport]
    final: FinalLine | None


def parse_run(events: list[RunEvent]) -> Run:
    """A run from its recorded events (`run_events(stdout)`); ValueError without an accounting record."""
    steps = [{"step": e.step, **dict(e.fields)} for e in events if isinstance(e, StepLine) and not e.late]
    accounting = [e for e in events if isinstance(e, AccountingLine)]
    if not accounting:
        raise ValueError("the run recorded no accounting line")
    recoveries = [e for e in events if isinstance(e, RecoveryReport)]
    final = next((e for e in events if isinstance(e, FinalLine)), None)
    return Run(steps, RunTotals.of(accounting[-1].record()), recoveries, final)


def first_records(run: Run) -> dict[int, dict[str, float]]:
    """Each iteration's step record of its first execution."""
    out: dict[int, dict[str, float]] = {}
    for r in run.steps:
        out.setdefault(int(r["step"]), r)
    return out


def first_executions(run: Run, tokens: int) -> list[tuple[int, float]]:
    """(iteration, seconds) of each iteration's first execution."""
    return [(step, tokens / r["tok_per_s"]) for step, r in sorted(first_records(run).items())]


def iteration_times(run: Run, tokens: int) -> list[float]:
    """Seconds of each iteration's first execution after the warm-up."""
    return [seconds for step, seconds in first_executions(run, tokens) if step > WARMUP]


def head_s(run: Run) -> float:
    """Wall seconds from the start of training to the end of iteration `WARMUP`'s first execution."""
    return first_records(run)[WARMUP]["wall_s"]


@dataclass(frozen=True)
class Reference:
    """A fault-free `none` run as the strategies' yardstick (or the mean of the two bracketing one)."""

    iteration_s: float  # T: the mean first-execution iteration time after the warm-up
    head_s: float  # wall seconds to the end of iteration WARMUP: its start-up
    wall_s: float
    iterations: int

    @classmethod
    def of(cls, run: Run, tokens: int) -> Reference:
        t = run.totals
        return cls(statistics.fmean(iteration_times(run, tokens)), head_s(run), t.wall_s, t.iterations)

    def useful_s(self, iterations: int) -> float:
        """Wall seconds this reference takes for `iterations` iterations, its start-up included: its own wall
        time for its own count, at its pace after the warm-up for another."""
        pace = (self.wall_s - self.head_s) / max(1, self.iterations - WARMUP)
        return self.head_s + (iterations - WARMUP) * pace


def bracket(before: Reference, after: Reference) -> Reference:
    """The mean of the references run before and after a strategy (it cancels most of the machine's drift)."""
    mean = [statistics.fmean([getattr(before, f.name), getattr(after, f.name)]) for f in fields(Reference)]
    return Reference(*mean[:3], round(mean[3]))


def summarize(run: Run, ref: Reference, tokens: int) -> dict:
    """ETTR (the reference's wall for these iterations over the run's), overhead (first executions against T),
    time lost to failures and the failures of one run."""
    t = run.totals
    lost_s = t.recovery_s + t.recompute_s
    return {
        "ettr": ref.useful_s(t.iterations) / t.wall_s,
        "overhead": statistics.fmean(iteration_times(run, tokens)) / ref.iteration_s - 1,
        "recovery_s": lost_s,
        "failures": t.failures,
        "recovery_per_failure_s": lost_s / t.failures if t.failures else 0.0,
        "lost_tokens": int(t.lost_tokens),
        "wall_s": t.wall_s,
        "useful_s": ref.useful_s(t.iterations),
        "iterations": t.iterations,
        "host_mb": t.host_mb,
        "log_mb": t.log_mb,
    }


def lost_time(run: Run, ref: Reference, tokens: int, target_ettr: float) -> dict:
    """Where a run's wall time beyond its useful time (`Reference.useful_s`) went, in seconds.

    fetch/convert/catchup: the recovery lines' parts, restart: the rest of their seconds (detection, keeping
    live state, the processes' restart and set-up); resume: the rest of the accounting's recovery time
    (from a recovery line to training going on); recompute: rolled-back iterations run again; warmup: the
    start-up to the end of iteration `WARMUP` beyond the reference's (less the recovery lines within it);
    slower: the later first executions
    beyond T (checkpointing overhead and the first iterations of restarted processes); other: the rest
    (wall time in no iteration or recovery beyond the reference's, such as the iteration a death
    interrupted). `short`: how much shorter the wall must be for `target_ettr`."""
    t = run.totals
    parts = dict.fromkeys(("restart", *REPLAY_PARTS), 0.0)
    in_lines = 0.0
    for report in run.recoveries:
        replay = {k: v for k, v in report.parts().items() if k in REPLAY_PARTS}
        for key, value in replay.items():
            parts[key] += value
        parts["restart"] += report.seconds - sum(replay.values())  # a recorded report holds the line's values
        in_lines += report.seconds
    useful = ref.useful_s(t.iterations)
    later = sum(s for step, s in first_executions(run, tokens) if step > WARMUP)
    out = {
        "lost": t.wall_s - useful,
        **parts,
        "resume": t.recovery_s - in_lines,
        "recompute": t.recompute_s,
        "warmup": head_s(run) - ref.head_s - sum(r.seconds for r in run.recoveries if r.step <= WARMUP),
        "slower": later - (t.iterations - WARMUP) * ref.iteration_s,
    }
    out["other"] = out["lost"] - sum(v for k, v in out.items() if k != "lost")
    out["short"] = max(0.0, t.wall_s - useful / target_ettr)
    return out


def at_failures(run: Run, key: str) -> float:
    """The mean of `key` (the window W or the interval k) in effect when each failure struck: its value on
    the failed iteration's predecessor, first executed, where it had one (0: none had, or the run logs no
    such field)."""
    records = first_records(run)
    values = [records[r.step - 1].get(key, 0.0) for r in run.recoveries if r.step - 1 in records]
    values = [v for v in values if v > 0]
    return statistics.fmean(values) if values else 0.0
