"""Sparse-to-dense conversion (`moevement/recovery/conversion.py`) in one process, operator by operator.

A tiny MoE trains with the real sparse checkpointer (W = 3 from iteration 3 on: windows 3-5, 6-8, 9-11),
with clipping and a learning rate that changes every iteration. Before iteration FAILED = 11 its memory is
wiped (window 9 in flight is dropped) and `Conversion.replay` rebuilds it from the persisted window 6-8 and
the logged scalars: conversion 6..8, catch-up 9..10. At the start of every replayed iteration t each
operator is compared, bit for bit, with state_t of the run that never failed: an active operator's FP32
weights, buffers and AdamW state; a frozen one's compute weights (fp32 here). At the end every operator
holds state_11.
"""

from __future__ import annotations

import dataclasses

import pytest

from moevement.checkpoint.profiler import Profile
from moevement.recovery.conversion import ReplayPlan, ReplayStats
from moevement.recovery.fetch import RecoveryError
from moevement.recovery.replay import wipe_operators
from moevement.topology import Topology
from tests import helpers
from tests.tiny_moe import (
    FAILED,
    Run,
    conversion_of,
    differences,
    frozen_by_iteration,
    recording_hooks,
    train_run,
)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """The conversion asks the process group for its rank (replay threads): a real one-rank gloo group."""
    with helpers.one_rank_group():
        yield


def replay_after_failure(
    run: Run, scalars: dict[int, dict] | None = None, frozen_weight_grad: bool = False
) -> dict[int, list[str]]:
    """Wipe the run's memory before iteration `last+1` and convert its persisted window (replaying up to
    `last`) with the logged scalars (or `scalars`); returns, per replayed iteration, what differed from the
    fault-free state at its start, then (under key `last+1`) what differs after the replay."""
    engine, optimizer = run.engine, run.optimizer
    end = max(run.states)
    engine.abort_window()
    wipe_operators(engine.ops, optimizer)
    t0 = engine.persisted.rollback_point()
    window_size = engine.persisted.span.size if engine.persisted.span else 0
    seen: dict[int, list[str]] = {}
    hooks = recording_hooks(run, frozen_by_iteration(engine), seen)
    conversion = conversion_of(run, hooks, Topology.single(), frozen_weight_grad)
    if not window_size:
        conversion.load_initial_state()
    logged = scalars or engine.persisted.scalars(t0, end)
    assert conversion.replay(
        ReplayPlan(t0, end, window_size, {0}, engine.persisted.snapshot, logged, {}), ReplayStats()
    )
    seen[end] = differences(engine.ops, optimizer, run.states[end], set())
    return seen


def test_each_operator_is_exact_at_every_replayed_iteration(tmp_path):
    run = train_run(tmp_path / "rank0", FAILED - 1)
    assert run.engine.persisted.span == (6, 3)
    assert min(s["clip_coef"] for s in run.engine.persisted.scalars(6, FAILED).values()) < 1
    seen = replay_after_failure(run)
    assert sorted(seen) == list(range(6, FAILED + 1))
    assert {t: diffs for t, diffs in seen.items() if diffs} == {}  # {iteration: ["operator: tensor", ...]}


# An ablation switch; the default replay's exactness: test_each_operator_is_exact_at_every_replayed_iteration.
@pytest.mark.slow
def test_frozen_operators_that_compute_their_weight_gradient_still_replay_exactly(tmp_path):
    """The ablation switch (`fault.frozen_weight_grad`): frozen operators run their weight-gradient products
    and drop the result; no operator differs at any replayed iteration."""
    run = train_run(tmp_path / "rank0", FAILED - 1)
    seen = replay_after_failure(run, frozen_weight_grad=True)
    assert sorted(seen) == list(range(6, FAILED + 1))
    assert {t: diffs for t, diffs in seen.items() if diffs} == {}


def test_a_wrong_logged_update_shows_in_exactly_the_operators_it_trained(tmp_path):
    """The comparison localizes: with iteration 7's logged learning rate doubled, the first difference is
    at the start of 8, in the operators active at 7 (slots 0 and 1); slot 2's operators, loaded at 8 from
    their snapshot, are still exact there."""
    run = train_run(tmp_path / "rank0", FAILED - 1)
    headers = [run.engine.persisted.snapshot(i)[0] for i in range(3)]
    scalars = run.engine.persisted.scalars(6, FAILED)
    scalars[7] = {**scalars[7], "lr": 2 * scalars[7]["lr"]}
    seen = replay_after_failure(run, scalars)
    assert seen[6] == seen[7] == []
    trained_at_7 = {*headers[0].active, *headers[1].active}
    assert {diff.split(":")[0] for diff in seen[8]} == trained_at_7, seen[8]
    assert seen[FAILED], "a wrong update must leave the converted state wrong"


def test_a_failure_before_the_first_window_replays_from_the_initial_state(tmp_path):
    """Before iteration 3 nothing is persisted: every operator restarts from its initial value and the
    replay of 1..2 (no snapshot to load) is exact at every iteration."""
    run = train_run(tmp_path / "rank0", 2)
    assert run.engine.persisted.span is None
    seen = replay_after_failure(run)
    assert sorted(seen) == [1, 2, 3] and {t: diffs for t, diffs in seen.items() if diffs} == {}


def test_a_snapshot_of_another_model_is_refused_naming_its_operator(tmp_path):
    run = train_run(tmp_path / "rank0", FAILED - 1)
    snapshot = run.engine.persisted.snapshot

    def foreign(slot: int):
        header, tensors = snapshot(slot)
        return dataclasses.replace(header, active=[*header.active, "layers.7.moe.experts.0"]), tensors

    run.engine.persisted.snapshot = foreign
    with pytest.raises(RecoveryError, match=r"iteration 6 names operators .*\(layers\.7\.moe\.experts\.0\)"):
        replay_after_failure(run)


def test_a_window_ordered_by_statistics_the_host_never_read_replays_exactly(tmp_path, monkeypatch):
    """Algorithm 1 plans windows of one slot at 3-7 (their router statistics and reorder rule stay on the
    device, unread) and one of three slots at 8-10, whose popularity order is read then: slot 0 holds the
    least popular experts. A failure at 11 converts 8-10 and catches up, every operator exact throughout."""
    plans = []

    def scripted(profile: Profile) -> None:  # the snapshot budget: everything for five windows, then little
        plans.append(None)
        profile.iteration_s = 1e12 if len(plans) <= 5 else 1e-12

    monkeypatch.setattr(Profile, "update", scripted)
    monkeypatch.setattr(Profile, "measure_bandwidth", lambda p, _dir, _dev: setattr(p, "measured_bandwidth", 1e9))
    # prefault off: each window starts where it is planned (no iteration waits for its buffers); the seventh plan,
    # at the end of 10, is of the window SS_11 starts in (its copy starts there: checkpoint.overlap = iteration)
    run = train_run(tmp_path / "rank0", FAILED - 1, window=0, max_window=3, prefault=False)
    assert len(plans) == 7 and run.engine.persisted.span == (8, 3)
    slot0 = run.engine.persisted.snapshot(0)[0].active
    assert len(slot0) == 6 and all(run.engine.ops_by_name[name].kind == "expert" for name in slot0)
    seen = replay_after_failure(run)
    assert sorted(seen) == list(range(8, FAILED + 1))
    assert {t: diffs for t, diffs in seen.items() if diffs} == {}
