"""Where a starting rank's state comes from (`moevement.recovery.start_source`), row by row, per strategy.

The rows are data: each strategy's capabilities are read from its registry entry, so a row pins what a
start does with `checkpoint.strategy` set so (the trainer gathers the facts: `trainer/run/start_facts.py`).
"""

from __future__ import annotations

import pytest

from moevement.recovery.start_source import Facts, Source, Survey, Why, after_rejoin, choose, surveys, why_it_starts
from trainer.strategy_registry import STRATEGIES

S, W = Source, Why
NOTHING = Facts()
SURVIVORS = Facts(survivors=True)
PERSISTED = Facts(persisted_window=True)
SURVIVORS_AND_PERSISTED = Facts(survivors=True, persisted_window=True)
RELAID = Facts(relaid_window=True)
DENSE = Facts(dense_checkpoint=True)
RELAID_OVER_DENSE = Facts(relaid_window=True, dense_checkpoint=True)

# (strategy, why it starts, what it found, where its state comes from)
CHOOSE_ROWS = [
    # moevement: a relaunch converts its persisted window; survivors' live state wins over it
    ("moevement", W.START, NOTHING, S.INITIAL),
    ("moevement", W.START, DENSE, S.DENSE_CHECKPOINT),
    ("moevement", W.START, PERSISTED, S.PERSISTED_WINDOW),
    ("moevement", W.TORCHRUN_RESTART, NOTHING, S.INITIAL),
    ("moevement", W.TORCHRUN_RESTART, PERSISTED, S.PERSISTED_WINDOW),
    ("moevement", W.TORCHRUN_RESTART, SURVIVORS, S.LIVE_STATE),
    ("moevement", W.TORCHRUN_RESTART, SURVIVORS_AND_PERSISTED, S.LIVE_STATE),
    ("moevement", W.IN_PLACE, SURVIVORS_AND_PERSISTED, S.LIVE_STATE),
    ("moevement", W.ELASTIC_ROUND, DENSE, S.DENSE_CHECKPOINT),
    ("moevement", W.ELASTIC_ROUND, RELAID_OVER_DENSE, S.RELAID_WINDOW),
    ("moevement", W.ELASTIC_ROUND, PERSISTED, S.INITIAL),  # an elastic round never converts a persisted window
    # gemini: after a death of the run, its replicated checkpoint in host memory (the initial state if none)
    ("gemini", W.START, NOTHING, S.INITIAL),
    ("gemini", W.START, DENSE, S.DENSE_CHECKPOINT),
    ("gemini", W.TORCHRUN_RESTART, SURVIVORS, S.HOST_CHECKPOINT),  # survivors kept markers, not state
    ("gemini", W.IN_PLACE, SURVIVORS, S.HOST_CHECKPOINT),
    ("gemini", W.TORCHRUN_RESTART, DENSE, S.HOST_CHECKPOINT),  # the run's checkpoint is newer than the dense one
    ("gemini", W.ELASTIC_ROUND, RELAID_OVER_DENSE, S.RELAID_WINDOW),
    ("gemini", W.ELASTIC_ROUND, DENSE, S.DENSE_CHECKPOINT),
    # checkfreq: the same from disk
    ("checkfreq", W.START, NOTHING, S.INITIAL),
    ("checkfreq", W.TORCHRUN_RESTART, NOTHING, S.DISK_CHECKPOINT),
    ("checkfreq", W.IN_PLACE, SURVIVORS, S.DISK_CHECKPOINT),
    ("checkfreq", W.ELASTIC_ROUND, RELAID, S.RELAID_WINDOW),
    # moc: partial checkpoints on disk; they do not re-lay
    ("moc", W.TORCHRUN_RESTART, SURVIVORS, S.DISK_CHECKPOINT),
    ("moc", W.ELASTIC_ROUND, RELAID_OVER_DENSE, S.DENSE_CHECKPOINT),
    ("moc", W.START, DENSE, S.DENSE_CHECKPOINT),
    # every_n (the docs' example): gemini's host-memory restart
    ("every_n", W.TORCHRUN_RESTART, NOTHING, S.HOST_CHECKPOINT),
    ("every_n", W.ELASTIC_ROUND, RELAID_OVER_DENSE, S.DENSE_CHECKPOINT),
    # none: only train.py's start
    ("none", W.TORCHRUN_RESTART, SURVIVORS_AND_PERSISTED, S.INITIAL),
    ("none", W.START, DENSE, S.DENSE_CHECKPOINT),
]


@pytest.mark.parametrize(("strategy", "why", "facts", "source"), CHOOSE_ROWS)
def test_each_row_chooses_its_source(strategy, why, facts, source):
    assert choose(why, facts, STRATEGIES[strategy].restores) is source


# (strategy, why, what it looks for)
SURVEY_ROWS = [
    ("moevement", W.START, Survey(live_state=True, persisted_window=True, host_checkpoint=False, relaid_window=False)),
    ("moevement", W.IN_PLACE, Survey(True, True, False, False)),
    ("moevement", W.ELASTIC_ROUND, Survey(False, False, False, True)),
    ("gemini", W.START, Survey(True, False, False, False)),
    ("gemini", W.TORCHRUN_RESTART, Survey(True, False, True, False)),
    ("gemini", W.IN_PLACE, Survey(True, False, True, False)),
    ("gemini", W.ELASTIC_ROUND, Survey(False, False, False, True)),
    ("checkfreq", W.TORCHRUN_RESTART, Survey(True, False, False, False)),  # its disk is read by its restart
    ("checkfreq", W.ELASTIC_ROUND, Survey(False, False, False, True)),
    ("moc", W.ELASTIC_ROUND, Survey(False, False, False, False)),
]


@pytest.mark.parametrize(("strategy", "why", "survey"), SURVEY_ROWS)
def test_each_row_looks_for_what_its_strategy_restores(strategy, why, survey):
    assert surveys(why, STRATEGIES[strategy].restores) == survey


# (attempt, generation, elastic, why)
WHY_ROWS = [
    (0, 0, False, W.START),
    (2, 0, False, W.TORCHRUN_RESTART),
    (0, 1, False, W.IN_PLACE),
    (3, 2, True, W.IN_PLACE),  # survivors stayed alive: in place even in an elastic job
    (0, 0, True, W.ELASTIC_ROUND),
    (1, 0, True, W.ELASTIC_ROUND),
]


@pytest.mark.parametrize(("attempt", "generation", "elastic", "why"), WHY_ROWS)
def test_why_a_rank_starts(attempt, generation, elastic, why):
    assert why_it_starts(attempt, generation, elastic) is why


# (window start t0, survivors' iteration, their logs' first iteration, a persisted window found, source)
AFTER_REJOIN_ROWS = [
    (6, 11, 6, True, S.LIVE_STATE),
    (6, 11, 3, True, S.LIVE_STATE),
    (1, 5, 1, False, S.LIVE_STATE),  # no window: the initial state, logs from 1
    (6, 11, 7, True, S.PERSISTED_WINDOW),  # logs do not reach back to the window: every stage rolls back
    (1, 5, 2, False, S.INITIAL),
    (9, 8, 1, True, S.PERSISTED_WINDOW),  # a window newer than the survivors' iteration
]


@pytest.mark.parametrize(("t0", "target", "logs_from", "found", "source"), AFTER_REJOIN_ROWS)
def test_after_rejoin(t0, target, logs_from, found, source):
    assert after_rejoin(t0, target, logs_from, found) is source


def test_every_source_a_strategy_restores_is_chosen_by_some_row():
    """No capability of an entry is dead: each is the answer of a row above for that strategy."""
    chosen = {(strategy, source) for strategy, _, _, source in CHOOSE_ROWS}
    for name, entry in STRATEGIES.items():
        assert {(name, source) for source in entry.restores} <= chosen, name
