"""The window a rank's snapshots are taken in: its plan, its snapshots' layouts, its index (docs/design.md §2).

Windows are numbered from 0 (a restarted job goes on from the index it adopted); a window's parity
(`index % 2`) picks its set of buffers. At a window boundary `start` plans the next window (collective:
W is agreed across ranks), lays out its snapshots and grows its buffers; each of its iterations then
takes `snapshot` (header, source tensors, buffer). A recovery drops the in-flight window (`abort`): the
next window follows the persisted one.

Training thread only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moevement.checkpoint.planner import WindowLayouts, WindowPlanner
from moevement.checkpoint.schedule import WindowPlan
from moevement.operators import optimizer_tensors
from moevement.storage.host_memory import HostBuffer
from moevement.storage.snapshot import SnapshotHeader
from moevement.storage.snapshot_buffers import SnapshotBuffers


class CurrentWindow:
    """The window `planner` planned last over this rank's operators, its snapshots in `buffers`; their
    headers name `rank` and carry `job_meta`; `rank_dir` is where the copy bandwidth is re-measured."""

    def __init__(
        self, planner: WindowPlanner, buffers: SnapshotBuffers, rank_dir: Path, rank: int, job_meta: dict
    ) -> None:
        self.planner, self.buffers, self.rank_dir, self.rank, self.job_meta = planner, buffers, rank_dir, rank, job_meta
        self.plan: WindowPlan | None = None
        self.layouts: WindowLayouts | None = None  # the plan's snapshot layouts
        self.index = -1
        self.started_at = -1  # the iteration that started the window (its layouts are current then)

    def ended_by(self, iteration: int) -> bool:
        """Whether no window is open or `iteration` lies beyond it: a snapshot at `iteration` starts a window."""
        return self.plan is None or iteration >= self.plan.end

    def start(self, iteration: int) -> None:
        """Plan window [iteration, iteration + W), lay out its snapshots and size its buffers (same W on every rank)."""
        follows, state = self.plan is not None, optimizer_tensors(self.planner.optimizer)
        self.index += 1
        self.plan = self.planner.plan(iteration, self.index, follows, self.rank_dir, state)
        self.layouts = self.planner.layouts(self.plan, state)
        self.started_at = iteration
        # Buffers grow on the training thread at the window boundary: grown by the copy thread, their
        # pages would fault in at idle priority while the copy is due, and the step would stall.
        self.buffers.reserve(self.index % 2, [max(nbytes, 1) for _, _, nbytes in self.layouts.slots])

    def snapshot(self, iteration: int) -> tuple[SnapshotHeader, list[torch.Tensor], HostBuffer]:
        """SS_iteration's header (no checksums yet), source tensors and buffer. The window's snapshots are
        laid out again if the optimizer's state tensors changed (a first optimizer step inside the window)."""
        if iteration != self.started_at:
            state = optimizer_tensors(self.planner.optimizer)
            if not self.layouts.current(state):
                self.layouts = self.planner.layouts(self.plan, state)
        slot = self.plan.slot_at(iteration)
        header, sources = _snapshot_header(self.plan, iteration, self.rank, self.layouts.slots[slot], self.job_meta)
        return header, sources, self.buffers.buffer(self.index % 2, slot)

    def abort(self, persisted_index: int) -> None:
        """A recovery dropped the in-flight window: the next window follows window `persisted_index`, and
        lays its snapshots out afresh (the recovery may have replaced tensors)."""
        self.plan, self.index = None, persisted_index
        self.planner.forget_layouts()


def _snapshot_header(plan: WindowPlan, iteration: int, rank: int, entry_layout, job_meta: dict):
    """(header, source tensors) of SS_iteration; `entry_layout`: (entries, sources, bytes) of its slot."""
    entries, sources, nbytes = entry_layout
    slot = plan.slot_at(iteration)
    active, frozen = list(plan.slots[slot]), list(plan.frozen_after(slot))
    meta = {**job_meta, "data_position": iteration}
    return SnapshotHeader(
        iteration, plan.start, slot, plan.window, rank, active, frozen, entries, nbytes, meta
    ), sources
