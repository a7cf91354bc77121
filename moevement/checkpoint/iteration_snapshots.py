"""When each iteration's snapshot starts, and the overlap it is planned on (docs/design/sparse-checkpointing.md).

SS_t holds state_t, which is complete once iteration t-1's optimizer step is done and stays so until
iteration t's. With `checkpoint.overlap = iteration` its copy starts right there, at the end of
`end(t-1)` (`after_end`), and so overlaps the rest of iteration t-1 (the step line, data loading,
validation) as well as t's forward and backward; `begin(t)` finds it started. With `compute` it starts at
`begin(t)`. Either way the optimizer step's pre-hook (`before_step`) waits for it and records, for
Algorithm 1, the time the copy had: from when it began copying (or, for an iteration without a
snapshot, could have) to the step.

A snapshot started for an iteration that does not run next (the run ends, a recovery, a stop) is dropped:
its copy is cancelled between two chunks (`SnapshotInFlight.drop`).

Training thread only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from moevement.checkpoint.in_flight import SnapshotInFlight
from moevement.checkpoint.options import SparseOptions
from moevement.checkpoint.planner import WindowPlanner
from moevement.checkpoint.window import CurrentWindow
from moevement.storage.cpu_cost import measure


class IterationSnapshots:
    """Starts each iteration's snapshot in `current_window` through `in_flight` (`cfg`: overlap, profile_iters,
    ab_blocks) and feeds `planner`'s profile; keeps the step line's figures (`last`: `ckpt_mb`, `stall_ms`;
    `window_size`: the W of the window the current iteration's snapshot is in, 0 where none is open for it)."""

    def __init__(
        self, cfg: SparseOptions, planner: WindowPlanner, current_window: CurrentWindow, in_flight: SnapshotInFlight
    ) -> None:
        self.cfg, self.planner, self.current_window, self.in_flight = cfg, planner, current_window, in_flight
        # an interval baseline's copy starts at `begin`: its policy's selection (MoC's cursor) advances as it plans
        self.early = cfg.overlap == "iteration" and planner.policy is None
        self.iterations, self.paused = 0, False  # iterations begun; a recovery replaying (no snapshots)
        self.ready: float | None = None  # when the next snapshot's copy could start (None: at its `begin`)
        self.prepared: tuple[int, float] | None = None  # (iteration, MB) of the snapshot `after_end` started
        self.last = {"ckpt_mb": 0.0, "stall_ms": 0.0}
        self.window_size = 0  # the step line's `window`

    def begin(self, iteration: int) -> None:
        """Iteration `iteration` begins: its snapshot starts, unless `after_end` started it already."""
        self.iterations += 1
        now = time.perf_counter()
        if not self.early or self.ready is None:
            self.ready = now
        self.last = {"ckpt_mb": 0.0, "stall_ms": 0.0}
        prepared, self.prepared = self.prepared, None
        if prepared is not None and prepared[0] == iteration:
            self.last["ckpt_mb"] = prepared[1]
            self.in_flight.issue_if_reusable()  # a GPU copy that had to wait for its buffer, if it need not now
        else:
            if prepared is not None:
                self.in_flight.drop()  # started for another iteration: never the one that runs
            self.last["ckpt_mb"] = self._start(iteration, self.iterations)
        plan = self.current_window.plan  # the window of this iteration's snapshot (0: none is open for it)
        self.window_size = plan.window_size if plan is not None and plan.start <= iteration < plan.end else 0

    def before_step(self) -> None:
        """The optimizer step's pre-hook: wait for the copy, record the time it had (`Profile.record`)."""
        if self.paused:
            return
        now, pending = time.perf_counter(), self.in_flight.pending
        waited = self.in_flight.wait()
        copy_from = pending.copy_started() if pending is not None and self.early else None
        if (since := copy_from or self.ready) is not None:  # None: a step outside the loop's iterations
            self.planner.profile.record(now - since)
        if waited is not None:
            self.last["stall_ms"] = waited * 1e3

    def after_end(self, iteration: int) -> None:
        """`end(iteration)` committed its snapshot: state_{iteration+1} is complete (with `iteration`, its
        snapshot starts now)."""
        self.ready = time.perf_counter()
        if self.early and not self.paused:
            self.prepared = (iteration + 1, self._start(iteration + 1, self.iterations + 1))

    def drop_prepared(self) -> None:
        """The run ends or stops: a snapshot started for an iteration that will not run is dropped."""
        if self.prepared is not None:
            self.prepared = None
            self.in_flight.drop()

    def recovering(self) -> None:
        """A recovery starts (the in-flight snapshot was dropped): the next copy's time counts from its `begin`."""
        self.ready, self.prepared = None, None

    @contextmanager
    def pausing(self) -> Iterator[None]:
        """A recovery replays the iterations inside this block: no snapshot, no profile."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def _start(self, iteration: int, ordinal: int) -> float:
        """Start SS_iteration's copy if it takes one (`ordinal`: which iteration of this checkpointer it is, from
        1), opening a window at a boundary; its MB (0: no snapshot)."""
        if ordinal <= self.cfg.profile_iters or not self.planner.due(iteration):
            return 0.0
        if self.cfg.ab_blocks and (iteration // self.cfg.ab_blocks) % 2:
            return 0.0  # a benchmark's block without snapshots
        if self.current_window.ended_by(iteration):
            with measure("window"):
                if not self.current_window.start(iteration):
                    return 0.0  # its buffers are still being grown: no snapshot yet
        with measure("checkpointer"):
            header, sources, buffer = self.current_window.snapshot(iteration)
            self.in_flight.start(self.current_window.index, header, sources, buffer)
            return header.nbytes / 1e6
