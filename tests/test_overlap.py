"""`checkpoint.overlap = iteration`: the copy of SS_{t+1} starts at the end of iteration t (state_{t+1} is
complete once t's optimizer step is done), is planned on the time it really had, at the rate copies got beside
training, and a copy started for an iteration that never runs is cancelled, not waited for."""

from __future__ import annotations

import functools

import torch

from moevement.checkpoint.profiler import Profile, gbps_to_bytes
from moevement.storage.host_memory import read_header
from tests.tiny_moe import iteration, tiny_engine


def test_the_next_snapshot_is_copied_from_the_end_of_the_iteration_before(tmp_path):
    """After `end(t)` the snapshot in flight is SS_{t+1} (started there, its copy timed from there), and the
    snapshots are the exact state before each step; under `compute` nothing is in flight between iterations."""
    from moevement.storage.snapshot import read_entries

    data = torch.Generator().manual_seed(1)
    model, optimizer, engine = tiny_engine(tmp_path / "iteration", window=3)
    for t in range(1, 9):
        before = iteration(engine, model, optimizer, t, data)
        if t >= 3:
            header, raw = engine.latest
            assert header.iteration == t and all(
                torch.equal(v, before[name] if role == "master" else before[name].to(v.dtype))
                for (role, name), v in read_entries(raw, header).items()
            )
            assert engine.in_flight.pending.header.iteration == t + 1
    engine.close()

    model, optimizer, engine = tiny_engine(tmp_path / "compute", window=3, overlap="compute")
    for t in range(1, 5):
        iteration(engine, model, optimizer, t, data)
        assert engine.in_flight.pending is None
    engine.close()


def test_a_copy_started_for_an_iteration_that_never_runs_is_cancelled(tmp_path):
    """At a cap under which the speculative copy after the last iteration would take hours, closing the
    checkpointer cancels it between two chunks: it returns, and that snapshot was never committed. A recovery
    (`abort_window`) cancels it the same way."""
    data = torch.Generator().manual_seed(1)
    for how in ("close", "abort_window"):
        model, optimizer, engine = tiny_engine(tmp_path / how, window=1)
        for t in range(1, 4):
            iteration(engine, model, optimizer, t, data)

        profile = engine.planner.profile
        crawl = functools.partial(setattr, profile, "cap", gbps_to_bytes(1e-6))  # from SS_5 on, a copy takes hours
        iteration(engine, model, optimizer, 4, data, after_step=crawl)
        pending = engine.in_flight.pending
        assert pending.header.iteration == 5 and not pending.copy.future.done()
        getattr(engine, how)()
        assert pending.copy.future.done() and engine.in_flight.pending is None
        assert read_header(pending.buffer.path) is None, "never committed"
        if how == "abort_window":
            engine.close()


def test_the_plan_uses_the_rate_copies_got_beside_training():
    """With `iteration`, once copies ran, Algorithm 1's bandwidth is their bytes over their copying seconds (the
    cap's sleeps left out), and the cap where it is lower; with `compute`, the probe's."""
    iteration, compute = Profile(0.0, "iteration"), Profile(0.0, "compute")
    for profile in (iteration, compute):
        profile.measured_bandwidth = 4e9
        profile.record_copy(100_000_000, 0.5)
        profile.record_copy(300_000_000, 1.5)
        profile.update()
    assert iteration.bandwidth == 2e8 and compute.bandwidth == 4e9
    capped = Profile(1.0, "iteration")
    capped.measured_bandwidth = 4e9
    capped.record_copy(100_000_000, 0.01)
    capped.update()
    assert capped.bandwidth == gbps_to_bytes(1.0)
