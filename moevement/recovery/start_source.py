"""Where a starting or rejoining rank's state comes from, as two tables (docs/design/lifecycle/start.md).

A checkpoint strategy says what it can restore (`Source`s: its registry entry, `trainer/strategy_registry.py`);
`surveys` says what a rank looks for, given why it starts; the trainer gathers those facts in one place
(`trainer/run/start_facts.py`: host memory, disk, the dense checkpoint train.py loaded); `choose` picks the
source. The strategy then restores from it (`CheckpointStrategy.resume`). Imports nothing, so it is tested
as tables.

`choose` (first row that holds):

| why it starts            | facts                                  | the strategy restores | source             |
|--------------------------|----------------------------------------|-----------------------|--------------------|
| any                      | some rank kept its live state          | LIVE_STATE            | LIVE_STATE         |
| an elastic round         | a window re-laid into the new layout   | RELAID_WINDOW         | RELAID_WINDOW      |
| not an elastic round     | a persisted sparse window every rank loads | PERSISTED_WINDOW  | PERSISTED_WINDOW   |
| torchrun restart, in place | -                                    | HOST_CHECKPOINT       | HOST_CHECKPOINT    |
| torchrun restart, in place | -                                    | DISK_CHECKPOINT       | DISK_CHECKPOINT    |
| any                      | train.py loaded a dense checkpoint     | -                     | DENSE_CHECKPOINT   |
| any                      | -                                      | -                     | INITIAL            |

`after_rejoin` (a LIVE_STATE start, once the survivors' kept states are gathered):

| the survivors' logs                                   | a persisted window | source           |
|-------------------------------------------------------|--------------------|------------------|
| reach back to the window's start, which is not newer  | -                  | LIVE_STATE       |
| the same does not hold                                | found              | PERSISTED_WINDOW |
| the same does not hold                                | none               | INITIAL          |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Why(enum.Enum):
    START = "start"  # attempt 0, generation 0: a new job, or a relaunch of the job (its persisted state may be there)
    TORCHRUN_RESTART = "torchrun_restart"  # every worker restarted (attempt > 0): survivors kept state in host memory
    IN_PLACE = "in_place"  # a later generation of the attempt: a dead worker replaced, survivors kept state in memory
    ELASTIC_ROUND = "elastic_round"  # an elastic job's start or torchrun round (not in place): its dense checkpoint


def why_it_starts(attempt: int, generation: int, elastic: bool) -> Why:
    """Why a rank starts: its torchrun `attempt`, its in-place `generation`, whether the job is `elastic`."""
    if generation > 0:
        return Why.IN_PLACE
    if elastic:
        return Why.ELASTIC_ROUND
    return Why.TORCHRUN_RESTART if attempt > 0 else Why.START


class Source(enum.Enum):
    INITIAL = "initial"  # the seed's initial state
    DENSE_CHECKPOINT = "dense_checkpoint"  # the dense checkpoint train.py loaded (state_{step+1})
    LIVE_STATE = "live_state"  # survivors' kept state; the other ranks' stages replay to it (MoEvement's rejoin)
    PERSISTED_WINDOW = "persisted_window"  # the newest persisted sparse window (host memory or persist_dir), converted
    RELAID_WINDOW = "relaid_window"  # a window newer than the dense checkpoint, re-laid into the round's layout
    HOST_CHECKPOINT = "host_checkpoint"  # the newest replicated checkpoint in host memory, every rank rolled back
    DISK_CHECKPOINT = "disk_checkpoint"  # the newest checkpoint on disk every rank holds, every rank rolled back


RESTARTED = (Why.TORCHRUN_RESTART, Why.IN_PLACE)  # the job ran in this torchrun run before: a death happened


@dataclass(frozen=True)
class Survey:
    """What a starting rank looks for (each a collective over every rank where it looks)."""

    live_state: bool  # the state this rank kept (in memory in place, in its host directory after a torchrun restart)
    persisted_window: bool  # the strategy's persisted sparse window (host memory or persist_dir)
    host_checkpoint: bool  # the strategy's newest replicated checkpoint in host memory
    relaid_window: bool  # a window of another layout in host memory (or on disk) to re-lay


def surveys(why: Why, restores: frozenset[Source]) -> Survey:
    """What a rank starting for `why` looks for, with a strategy that `restores` these sources."""
    elastic = why is Why.ELASTIC_ROUND
    return Survey(
        live_state=not elastic,
        persisted_window=Source.PERSISTED_WINDOW in restores and not elastic,
        host_checkpoint=Source.HOST_CHECKPOINT in restores and why in RESTARTED,
        relaid_window=Source.RELAID_WINDOW in restores and elastic,
    )


@dataclass(frozen=True)
class Facts:
    """What a starting rank found (`trainer/run/start_facts.py` gathers them; agreed over every rank)."""

    survivors: bool = False  # some rank kept its live state
    persisted_window: bool = False  # a persisted sparse window every rank can load was found
    relaid_window: bool = False  # a window every rank can re-lay into this layout was found
    dense_checkpoint: bool = False  # train.py loaded a dense checkpoint (its step > 0)


def choose(why: Why, facts: Facts, restores: frozenset[Source]) -> Source:
    """The source of a rank starting for `why` with `facts`, its strategy restoring `restores` (the first
    table of the module docstring, in order)."""
    if facts.survivors and Source.LIVE_STATE in restores:
        return Source.LIVE_STATE
    if why is Why.ELASTIC_ROUND and facts.relaid_window and Source.RELAID_WINDOW in restores:
        return Source.RELAID_WINDOW
    if why is not Why.ELASTIC_ROUND and facts.persisted_window and Source.PERSISTED_WINDOW in restores:
        return Source.PERSISTED_WINDOW
    if why in RESTARTED:
        for source in (Source.HOST_CHECKPOINT, Source.DISK_CHECKPOINT):
            if source in restores:
                return source
    return Source.DENSE_CHECKPOINT if facts.dense_checkpoint else Source.INITIAL


def after_rejoin(window_start: int, target: int, logs_from: int, found: bool) -> Source:
    """A LIVE_STATE start once the survivors' kept states are gathered: LIVE_STATE when the survivors (those
    at the newest iteration `target`) hold logs from `logs_from` on, which reach back to `window_start` (the
    persisted window's, 1 without one), itself not newer than `target`; else every stage rolls back to the
    persisted window (`found`) or to the initial state (the second table of the module docstring)."""
    if logs_from <= window_start <= target:
        return Source.LIVE_STATE
    return Source.PERSISTED_WINDOW if found else Source.INITIAL
