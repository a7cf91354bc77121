"""Failure injection plans: `--fault.at STEP:RANK[+RANK...][,STEP:RANK...]`, `--fault.crash STEP:RANK`,
`--fault.mtbf_iters M --fault.seed S` and `--fault.trace FILE`.

`at`: at the start of iteration STEP the listed ranks lose all their state (parameters,
optimizer state, snapshots, replicas, logs) and recover in place (docs/design/recovery.md). Ranks joined
by `+` fail together; a second event at the same STEP fires while the first one's recovery is
running (after its first replayed iteration) and widens it.

`crash`: at the start of iteration STEP the rank's process exits (first attempt only), so a
launcher such as `torchrun --max-restarts` restarts the whole job (global rollback).

`mtbf_iters`: Poisson failures, one random rank each, with exponential inter-arrival times of mean
M iterations drawn from `random.Random(S)`; a failure strikes at the next iteration boundary.
`trace`: a CSV with a header `iteration,rank` (or `time_s,rank`: wall seconds since training
started; rank 0's clock decides the iteration, and every rank follows it).
Every failure fires once: a strategy that rolls back and runs iterations again does not meet the
same failure twice, so all strategies see the same schedule.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass


class FaultSpecError(ValueError):
    """A malformed fault specification; the message names the key."""


@dataclass(frozen=True)
class FaultEvent:
    step: int
    ranks: tuple[int, ...]


def _shown(item: str, limit: int = 60) -> str:
    """`item` quoted, cut to `limit` characters (and its length) when longer: an error line stays short."""
    return repr(item) if len(item) <= limit else f"{item[:limit]!r}... ({len(item)} characters)"


def parse_events(spec: str, key: str) -> list[FaultEvent]:
    """`"5:1,5:2+3"` -> [FaultEvent(5, (1,)), FaultEvent(5, (2, 3))], in the order given."""
    events = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        step, sep, ranks = item.partition(":")
        try:
            event = FaultEvent(int(step), tuple(sorted({int(r) for r in ranks.split("+")})))
        except ValueError:
            event = None
        if not sep or event is None or event.step < 1 or min(event.ranks) < 0:
            raise FaultSpecError(
                f"config key '{key}' must look like STEP:RANK[+RANK...][,STEP:RANK...] "
                f"with STEP >= 1 and RANK >= 0, got {_shown(item)}"
            )
        events.append(event)
    return events


TRAINING_PHASES = ("forward", "backward", "clip", "optimizer", "snapshot", "replication")  # of every iteration
# At the end of a run, after its last iteration: `digest` as the final state digest starts, `save` as
# `checkpoint.save_final` starts, `saved` once it is published, `accounting` right after the accounting line
# (without `save_final`, the job has not recorded its end yet), `final` once the job has finished
END_PHASES = ("digest", "save", "saved", "accounting", "final")
# `validation`: during the validation of an iteration that runs one; `replay`: of a restart; `join`: a
# survivor's join of the in-place generation that follows a death; `dense_save`: while the periodic dense
# checkpoint of the iteration is written in the background (after this rank's first file); `dense_prune`:
# while rank 0 prunes the older periodic checkpoints after publishing it (after the first file it deletes)
KILL_PHASES = (*TRAINING_PHASES, "validation", "replay", "join", "dense_save", "dense_prune", *END_PHASES)


@dataclass(frozen=True)
class KillEvent:
    """Rank `rank` SIGKILLs itself in `phase` of iteration `step` (a real death, no clean-up); phase `replay`:
    in the forward pass of `step` replayed by a restarted job's start-up (a rejoin or a whole-job restart);
    phase `validation`: in the validation that follows iteration `step`; phase `join`: right after it joined,
    as a survivor that kept its state of iteration `step`, the process groups of the next generation; the
    `END_PHASES`: at the end of a run whose last iteration is `step`."""

    step: int
    rank: int
    phase: str

    @property
    def key(self) -> str:
        """The death's name on torchrun's store once it struck: a join follows the death at the same step."""
        return f"kill/{self.step}" + ("/join" if self.phase == "join" else "")


def parse_kills(spec: str, key: str = "fault.kill") -> list[KillEvent]:
    """`"12:1,20:3:optimizer"` -> [KillEvent(12, 1, "forward"), KillEvent(20, 3, "optimizer")]."""
    kills = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        phase = parts[2] if len(parts) == 3 else "forward"
        try:
            kill = KillEvent(int(parts[0]), int(parts[1]), phase) if len(parts) in (2, 3) else None
        except ValueError:
            kill = None
        if kill is None or kill.step < 1 or kill.rank < 0 or phase not in KILL_PHASES:
            raise FaultSpecError(
                f"config key '{key}' must look like STEP:RANK[:PHASE][,...] with STEP >= 1, RANK >= 0 and "
                f"PHASE one of {', '.join(KILL_PHASES)}, got {_shown(item)}"
            )
        kills.append(kill)
    return kills


def check_last_step(events: list[FaultEvent], key: str, last_step: int) -> None:
    """Refuse a failure after iteration `last_step` (the run's last): it would silently never fire."""
    late = [e.step for e in events if e.step > last_step]
    if late:
        raise FaultSpecError(
            f"config key '{key}' has a failure at step {max(late)}, after the run's last step "
            f"{last_step} (training.stop_at, or training.steps when it is 0): it would never fire"
        )


def poisson_events(mtbf_iters: float, seed: int, world: int, last_step: int) -> list[FaultEvent]:
    """Failures of one random rank each, exponential inter-arrival times of mean `mtbf_iters` iterations."""
    rng, events, clock = random.Random(seed), [], 0.0
    while True:
        clock += rng.expovariate(1.0 / mtbf_iters)
        step, rank = max(1, math.ceil(clock)), rng.randrange(world)
        if step > last_step:
            return events
        if not events or events[-1].step != step:
            events.append(FaultEvent(step, (rank,)))


def read_trace(path: str) -> tuple[list[FaultEvent], list[tuple[float, int]]]:
    """(iteration events, (seconds, rank) events) of a failure trace CSV.

    A file that cannot be read, is not UTF-8 CSV, lacks a `rank` and an `iteration` or `time_s`
    header column, has no failure row, or has a bad value raises FaultSpecError naming the file."""
    name = f"config key 'fault.trace': {path}"
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = [(reader.line_num, row) for row in reader]
            header = reader.fieldnames or []
    except OSError as e:
        raise FaultSpecError(f"{name}: cannot read it: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise FaultSpecError(f"{name} is not UTF-8 text (byte offset {e.start})") from None
    except csv.Error as e:
        raise FaultSpecError(f"{name} is not a CSV file: {e}") from None
    if "rank" not in header or not {"iteration", "time_s"} & set(header):
        raise FaultSpecError(f"{name} must start with a header `iteration,rank` or `time_s,rank`, got {header}")
    if not rows:
        raise FaultSpecError(f"{name} has a header but no failure rows")
    by_step, by_time = [], []
    for n, row in rows:
        try:
            rank = int(row["rank"])
            if row.get("iteration") not in (None, ""):
                by_step.append(FaultEvent(int(row["iteration"]), (rank,)))
            else:
                by_time.append((float(row["time_s"]), rank))
        except (KeyError, TypeError, ValueError):
            raise FaultSpecError(
                f"{name} line {n} must have `rank` and `iteration` or `time_s` columns with numbers, got {dict(row)}"
            ) from None
    if any(e.step < 1 for e in by_step) or any(r < 0 for _, r in by_time) or any(min(e.ranks) < 0 for e in by_step):
        raise FaultSpecError(f"{name} has an iteration < 1 or a rank < 0")
    if any(not (math.isfinite(t) and t >= 0) for t, _ in by_time):
        raise FaultSpecError(f"{name} has a time_s that is negative or not a finite number")
    return by_step, sorted(by_time)


class FaultPlan:
    """The injected failures of a run, looked up by iteration; each fires once.

    `last_step`: the run's last iteration. Poisson failures stop there; a `fault.at` or `fault.crash`
    failure after it could never fire and is refused (FaultSpecError naming the key, the step and
    `last_step`); 0 leaves them unchecked. Trace rows after it are ignored, like Poisson failures.
    """

    def __init__(
        self,
        at: str = "",
        crash: str = "",
        *,
        kill: str = "",
        mtbf_iters: float = 0.0,
        seed: int = 0,
        trace: str = "",
        world: int = 1,
        last_step: int = 0,
    ):
        self.events = parse_events(at, "fault.at")
        self.crashes = parse_events(crash, "fault.crash")
        self.kills = parse_kills(kill)
        if last_step >= 1:
            check_last_step(self.events, "fault.at", last_step)
            check_last_step(self.crashes, "fault.crash", last_step)
            check_last_step([FaultEvent(k.step, (k.rank,)) for k in self.kills], "fault.kill", last_step)
        self.timed: list[tuple[float, int]] = []
        if mtbf_iters > 0:
            self.events += poisson_events(mtbf_iters, seed, world, last_step)
        if trace:
            by_step, self.timed = read_trace(trace)
            self.events += by_step
        self.events.sort(key=lambda e: e.step)
        self.fired: set[int] = set()

    def check_world(self, world: int) -> None:
        if (self.events or self.timed) and world == 1:
            raise FaultSpecError(
                "config key 'fault.at' needs a multi-process run (torchrun): "
                "a single process has no survivor to recover from"
            )
        kills = [FaultEvent(k.step, (k.rank,)) for k in self.kills]
        for key, events in (("fault.at", self.events), ("fault.crash", self.crashes), ("fault.kill", kills)):
            for event in events:
                if max(event.ranks) >= world:
                    raise FaultSpecError(
                        f"config key '{key}' names rank {max(event.ranks)}, but the job has {world} ranks"
                    )
        if any(rank >= world for _, rank in self.timed):
            raise FaultSpecError(f"config key 'fault.trace' names a rank >= {world}, the job's rank count")
        for event in self.events:
            failed = set().union(*(e.ranks for e in self.events if e.step == event.step))
            if len(failed) == world:
                raise FaultSpecError(
                    f"config key 'fault.at' fails every rank at step {event.step}; in-place "
                    "recovery needs a survivor (use fault.crash with torchrun --max-restarts)"
                )

    def at(self, step: int, elapsed_s: float | None = None) -> list[FaultEvent]:
        """The failures at the start of iteration `step` not yet fired (marked fired now).

        `elapsed_s`: seconds since training started, on rank 0 (decides the trace's timed failures)."""
        due = [e for i, e in enumerate(self.events) if e.step == step and i not in self.fired]
        self.fired |= {i for i, e in enumerate(self.events) if e.step == step}
        while self.timed and elapsed_s is not None and self.timed[0][0] <= elapsed_s:
            due.append(FaultEvent(step, (self.timed.pop(0)[1],)))
        return due

    def count(self) -> int:
        return len(self.events) + len(self.timed)

    def kill_of(self, rank: int, fired: int) -> KillEvent | None:
        """The kill of `rank` once `fired` distinct kills struck (`KillEvent.key`: the kills of one step strike
        together, a `join` after them): the n-th distinct key, in the order given, is due after n (each death
        follows the previous one)."""
        keys = list(dict.fromkeys(k.key for k in self.kills))
        due = [k for k in self.kills if k.rank == rank and keys.index(k.key) == fired]
        return due[0] if due else None

    def crashes_at(self, step: int, rank: int) -> bool:
        return any(e.step == step and rank in e.ranks for e in self.crashes)

    def __bool__(self) -> bool:
        return bool(self.events or self.crashes or self.kills or self.timed)
