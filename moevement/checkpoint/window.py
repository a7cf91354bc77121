"""The window a rank's snapshots are taken in: its plan, its snapshots' layouts, its index
(docs/design/state-and-snapshots.md).

Windows are numbered from 0 (a restarted job goes on from the index it adopted); a window's parity
(`index % 2`) picks its set of buffers. At a window boundary `start` plans the next window (collective:
W is agreed across ranks) and lays out its snapshots; each of its iterations then takes `snapshot`
(header, source tensors, buffer). A recovery drops the in-flight window (`abort`): the next window
follows the persisted one.

Buffers are never grown while a window needs them (docs/design/sparse-checkpointing.md): with
`checkpoint.prefault` a planned window whose buffers do not yet hold its snapshots on every rank waits
(`start` returns False, the iteration takes no snapshot) while the prefault thread grows them, and starts at
the first iteration at which every rank's are ready (agreed with one small all-reduce). Growing the set of the
other parity for the same plan at once readies the next window too. Without `prefault`, or for an interval
baseline (whose checkpoint iterations are its policy's), the buffers grow at the window's start on the
training thread.

Training thread only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moevement.checkpoint.planner import WindowLayouts, WindowPlanner
from moevement.checkpoint.profiler import reserve_probe
from moevement.checkpoint.schedule import WindowPlan
from moevement.operators import optimizer_tensors
from moevement.storage.host_memory import HostBuffer, prefault_rank_dir
from moevement.storage.snapshot import SnapshotHeader
from moevement.storage.snapshot_buffers import SnapshotBuffers


class CurrentWindow:
    """The window `planner` planned last over this rank's operators, its snapshots in `buffers`; their
    headers name `rank` and carry `job_meta`; `rank_dir` is where the copy bandwidth is re-measured.
    `prefault`: a window waits for its buffers rather than growing them on the training thread."""

    def __init__(
        self,
        planner: WindowPlanner,
        buffers: SnapshotBuffers,
        rank_dir: Path,
        rank: int,
        job_meta: dict,
        prefault: bool = False,
    ) -> None:
        self.planner, self.buffers, self.rank_dir, self.rank, self.job_meta = planner, buffers, rank_dir, rank, job_meta
        self.prefault = prefault and planner.policy is None  # a baseline's checkpoint iterations are its policy's
        self.plan: WindowPlan | None = None
        self.layouts: WindowLayouts | None = None  # the plan's snapshot layouts
        self.index = -1
        self.started_at = -1  # the iteration that started the window (its layouts are current then)
        self.waiting: tuple[WindowPlan, WindowLayouts] | None = None  # planned, its buffers not yet ready
        self.waited = 0  # iterations the newest window waited for its buffers

    def reserve_at_start_up(self) -> None:
        """Start-up (`checkpoint.prefault`): map the buffer files the rank directory holds (an earlier process of
        the rank left them; a survivor's earlier generation kept its mappings), the bandwidth probe's too, and
        grow both window parities where the plan is known before training (`WindowPlanner.startup_sizes`).
        Where Algorithm 1 chooses W, the first window waits for its buffers instead (`start`)."""
        prefault_rank_dir(self.rank_dir, pin=self.buffers.pin)
        reserve_probe(self.rank_dir, self.planner.device)
        sizes = self.planner.startup_sizes()
        if sizes is not None:
            for parity in (0, 1):
                self.buffers.reserve(parity, sizes)

    def ended_by(self, iteration: int) -> bool:
        """Whether no window is open or `iteration` lies beyond it: a snapshot at `iteration` starts a window."""
        return self.plan is None or iteration >= self.plan.end

    def start(self, iteration: int) -> bool:
        """Start window [iteration, iteration + W) (same W, same iteration on every rank): plan it and lay out its
        snapshots, or take the plan that waits for its buffers; returns whether it started (False: some rank's
        buffers are still being grown, and this iteration takes no snapshot)."""
        index = self.index + 1
        if self.waiting is None:
            state = optimizer_tensors(self.planner.optimizer)
            plan = self.planner.plan(iteration, index, self.plan is not None, self.rank_dir, state)
            self.waiting, self.waited = (plan, self.planner.layouts(plan, state)), 0
            self._ask_for_buffers(index, self._sizes(self.waiting[1]))
        plan, layouts = self.waiting
        if not self._buffers_ready(index % 2, self._sizes(layouts)):
            self.waited += 1
            return False
        self.waiting, self.index, self.started_at = None, index, iteration
        self.plan = plan if plan.start == iteration else WindowPlan(iteration, plan.slots)
        self.layouts = layouts
        return True

    def _ask_for_buffers(self, index: int, sizes: list[int]) -> None:
        """Have window `index`'s buffers grown to `sizes`: on the prefault thread, with the other parity's for
        the window after (the same plan, most likely), or here and now."""
        if self.prefault:
            self.buffers.reserve_ahead(index % 2, sizes)
            self.buffers.reserve_ahead((index + 1) % 2, sizes)
        else:
            # Grown by the copy thread, their pages would fault in at idle priority while the copy is due,
            # and the step would stall.
            self.buffers.reserve(index % 2, sizes)

    def _buffers_ready(self, parity: int, sizes: list[int]) -> bool:
        """Whether every rank's buffers of `parity` hold its planned snapshots (collective with `prefault`)."""
        return not self.prefault or self.planner.all_ranks(self.buffers.ready(parity, sizes))

    @staticmethod
    def _sizes(layouts: WindowLayouts) -> list[int]:
        return [max(nbytes, 1) for _, _, nbytes in layouts.slots]

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
        self.plan, self.index, self.waiting = None, persisted_index, None
        self.planner.forget_layouts()


def _snapshot_header(plan: WindowPlan, iteration: int, rank: int, entry_layout, job_meta: dict):
    """(header, source tensors) of SS_iteration; `entry_layout`: (entries, sources, bytes) of its slot."""
    entries, sources, nbytes = entry_layout
    slot = plan.slot_at(iteration)
    active, frozen = list(plan.slots[slot]), list(plan.frozen_after(slot))
    meta = {**job_meta, "data_position": iteration}
    return SnapshotHeader(
        iteration, plan.start, slot, plan.window_size, rank, active, frozen, entries, nbytes, meta
    ), sources
