"""Failure injection plans: `--fault.at STEP:RANK[+RANK...][,STEP:RANK...]` and `--fault.crash STEP:RANK`.

`at`: at the start of iteration STEP the listed ranks lose all their state (parameters,
optimizer state, snapshots, replicas, logs) and recover in place (DESIGN.md §4). Ranks joined
by `+` fail together; a second event at the same STEP fires while the first one's recovery is
running (after its first replayed iteration) and widens it.

`crash`: at the start of iteration STEP the rank's process exits (first attempt only), so a
launcher such as `torchrun --max-restarts` restarts the whole job (global rollback).
"""

from __future__ import annotations

from dataclasses import dataclass


class FaultSpecError(ValueError):
    """A malformed fault specification; the message names the key."""


@dataclass(frozen=True)
class FaultEvent:
    step: int
    ranks: tuple[int, ...]


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
            raise FaultSpecError(f"config key '{key}' must look like STEP:RANK[+RANK...][,STEP:RANK...] "
                                 f"with STEP >= 1 and RANK >= 0, got {item!r}")
        events.append(event)
    return events


class FaultPlan:
    """The injected failures of a run, looked up by iteration."""

    def __init__(self, at: str = "", crash: str = ""):
        self.events = parse_events(at, "fault.at")
        self.crashes = parse_events(crash, "fault.crash")

    def check_world(self, world: int) -> None:
        if self.events and world == 1:
            raise FaultSpecError("config key 'fault.at' needs a multi-process run (torchrun): "
                                 "a single process has no survivor to recover from")
        for key, events in (("fault.at", self.events), ("fault.crash", self.crashes)):
            for event in events:
                if max(event.ranks) >= world:
                    raise FaultSpecError(f"config key '{key}' names rank {max(event.ranks)}, "
                                         f"but the job has {world} ranks")
        for event in self.events:
            failed = set().union(*(e.ranks for e in self.events if e.step == event.step))
            if len(failed) == world:
                raise FaultSpecError(f"config key 'fault.at' fails every rank at step {event.step}; in-place "
                                     "recovery needs a survivor (use fault.crash with torchrun --max-restarts)")

    def at(self, step: int) -> list[FaultEvent]:
        return [e for e in self.events if e.step == step]

    def crashes_at(self, step: int, rank: int) -> bool:
        return any(e.step == step and rank in e.ranks for e in self.crashes)

    def __bool__(self) -> bool:
        return bool(self.events or self.crashes)
