"""Window planning: which operators each iteration of a window snapshots (docs/design/state-and-snapshots.md).

At a window boundary the planner runs Algorithm 1 on the profiled iteration time and copy bandwidth,
orders the operators by popularity (least popular experts first, non-expert operators last) and cuts the
order into W slots; W is agreed across ranks (the largest any rank needs) because windows are global.
W comes first: a popularity order only permutes the experts, so where they are alike in size Algorithm 1
sees the same sizes in any such order, and the router statistics (closed on their device at every
boundary) are read on the host only where the order can matter, a window of more than one slot.
An interval baseline's `SnapshotPolicy` replaces Algorithm 1: one slot holding the operators the policy
selects, at the iterations it chooses (no router statistics are kept then).

Training thread only.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from moevement.checkpoint.options import SparseOptions
from moevement.checkpoint.popularity import PopularityTracker
from moevement.checkpoint.profiler import Profile
from moevement.checkpoint.reservation import operator_layout_bytes, slot_bytes
from moevement.checkpoint.schedule import (
    WindowPlan,
    byte_slots,
    byte_window_size,
    find_window_size,
    generate_schedule,
    order_operators,
    slot_size_for,
)
from moevement.operators import LocalViews, Operator
from moevement.storage.snapshot import Entry, entry_layout
from parallelisms import collectives


class SnapshotPolicy(Protocol):
    """When an interval strategy snapshots, and what (implemented by `baselines.intervals.IntervalPolicy`)."""

    interval: int

    def due(self, iteration: int) -> bool: ...
    def select(self) -> list[str]: ...
    def choose(self, snapshot_bytes: float, bandwidth: float, overlap_s: float) -> int: ...
    def scheduled(self, iteration: int, interval: int) -> None: ...
    def observe_stall(self, seconds: float) -> None: ...


@dataclass(frozen=True)
class WindowLayouts:
    """(entries without checksums, source tensors, bytes) of each snapshot of a window, by slot.

    Laid out at the window's start (`WindowPlanner.layouts`), used by its iterations: the sources are views
    of the parameters and optimizer state, which the optimizer updates in place. A layout outlives neither
    its window nor a change of the optimizer's state tensors (`current`): a recovery aborts the window,
    and a first optimizer step inside a window (one skipped by the loss scaler before) lays it out again.
    """

    slots: list[tuple[list[Entry], list[torch.Tensor], int]]
    state: list[torch.Tensor]  # the optimizer's state tensors when laid out (`optimizer_tensors`)

    def current(self, state: list[torch.Tensor]) -> bool:
        """Whether the optimizer's state tensors now (`optimizer_tensors`) are those the layouts were resolved from."""
        return same_tensors(state, self.state)


def same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two lists hold the same tensor objects in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


@dataclass(frozen=True)
class WindowInputs:
    """What Algorithm 1 planned a window with on this rank: the iteration time it overlaps (s), each
    operator's FP32-state and compute-weight bytes in schedule order, the copy bandwidth (bytes/s), and
    the W the ranks agreed on (or the fixed one)."""

    iteration_s: float
    fp32_bytes: tuple[int, ...]
    compute_bytes: tuple[int, ...]
    bandwidth: float
    window_size: int


class WindowPlanner:
    """Plans windows over this rank's operators with `cfg`'s window, max_window, slots, ordering, ema_decay,
    bandwidth_gbps and reprofile_every."""

    def __init__(
        self,
        cfg: SparseOptions,
        ops: list[Operator],
        optimizer: torch.optim.Optimizer,
        compute_dtype: torch.dtype,
        device: torch.device,
        world: int,
        policy: SnapshotPolicy | None,
    ):
        self.cfg, self.optimizer, self.compute_dtype, self.device, self.world = (
            cfg,
            optimizer,
            compute_dtype,
            device,
            world,
        )
        self.ops = ops
        self.ops_by_name = {op.name: op for op in ops}
        self.registry_order = [op.name for op in ops]
        self.is_expert = [op.kind == "expert" for op in ops]
        self.kind_order = order_operators(self.registry_order, self.is_expert, {})  # experts first, as ordered
        self.policy = policy
        self.profile = Profile(cfg.bandwidth_gbps, cfg.overlap)
        self.reset_popularity()
        self._laid_out: tuple[tuple, tuple[frozenset[str], ...], WindowLayouts] | None = None  # slots, by set
        self._sizes: tuple[list[torch.Tensor], dict[str, tuple[int, int]]] | None = None
        self._fixed: tuple[list[str], dict, tuple[tuple[str, ...], ...]] | None = None  # a fixed W's last slots
        self._alike: tuple[dict, bool] | None = None  # (sizes, whether every expert operator has the same sizes)
        self.last_inputs: WindowInputs | None = None  # what Algorithm 1 last planned a window with

    def reset_popularity(self) -> None:
        """Forget the popularity history and return to registry order (applied at the next window)."""
        self.tracker = PopularityTracker(self.cfg.ordering, self.cfg.ema_decay)
        self.order = list(self.registry_order)

    @property
    def order_fixed(self) -> bool:
        """Whether the operators keep the model's order for good, so router statistics cannot matter: every
        window is one slot (a fixed W = 1), the `fixed` policy, or an interval baseline (its policy selects)."""
        return self.policy is not None or self.cfg.window == 1 or self.cfg.ordering == "fixed"

    def observe(self, tokens: dict[str, torch.Tensor], gate_probs: dict[str, torch.Tensor]) -> None:
        """An iteration's router statistics, kept on their device (not at all where the order cannot matter)."""
        if not self.order_fixed:
            self.tracker.observe(tokens, gate_probs)

    def due(self, iteration: int) -> bool:
        """Whether `iteration` takes a snapshot (always for MoEvement; by the policy for a baseline)."""
        return self.policy is None or self.policy.due(iteration)

    def plan(
        self, iteration: int, window_index: int, follows_a_window: bool, measure_dir: Path, state: list[torch.Tensor]
    ) -> WindowPlan:
        """Window number `window_index`, starting at `iteration` (collective: W is agreed across ranks), for the
        optimizer's state tensors `state` (`optimizer_tensors`, read by the caller for this plan and its layouts).
        The copy bandwidth is measured for a process's first window (not at its start, where a replacement's
        peers would wait for it) and again every `reprofile_every` windows, never right after a recovery."""
        self.profile.update()
        every = self.cfg.reprofile_every
        if not self.profile.measured_bandwidth or (follows_a_window and every and window_index % every == 0):
            self.profile.measure_bandwidth(measure_dir, self.device)
        sizes = self._op_bytes(state)
        slots = self._interval_checkpoint(iteration, sizes) if self.policy is not None else self._sparse_slots(sizes)
        return WindowPlan(iteration, slots)

    def layouts(self, plan: WindowPlan, state: list[torch.Tensor]) -> WindowLayouts:
        """The layout of every snapshot of the window, resolved once at its start: SS_{start+slot} holds the
        FP32 state of slot `slot`'s operators and the compute weights of the later slots' operators.

        A window whose slots hold the same operators as the one before (in any order: entries are found by
        name) reuses its layouts while the optimizer's state tensors are those they were resolved from (at
        W=1 every iteration is such a window); a recovery, which may replace tensors, drops them first
        (`forget_layouts`). `state`: the optimizer's state tensors now (`optimizer_tensors`)."""
        if self._laid_out is not None:
            slots, key, laid_out = self._laid_out
            # the same slots object (a fixed W's), or the same operators per slot
            same = slots is plan.slots or key == tuple(frozenset(slot) for slot in plan.slots)
            if same and laid_out.current(state):
                return laid_out
        views = LocalViews()
        slots = []
        for slot in range(plan.window_size):
            active = [self.ops_by_name[n] for n in plan.slots[slot]]
            frozen = [self.ops_by_name[n] for n in plan.frozen_after(slot)]
            slots.append(entry_layout(active, frozen, self.optimizer, self.compute_dtype, views))
        laid_out = WindowLayouts(slots, state)
        self._laid_out = (plan.slots, tuple(frozenset(slot) for slot in plan.slots), laid_out)
        return laid_out

    def forget_layouts(self) -> None:
        """The model's or the optimizer's tensors may have been replaced (a recovery): lay out afresh."""
        self._laid_out = self._sizes = None

    def _op_bytes(self, state: list[torch.Tensor]) -> dict[str, tuple[int, int]]:
        """Each operator's (FP32 state, compute weight) bytes, measured again once the optimizer's state
        tensors (`state`, read now) change (a first step creates them)."""
        if self._sizes is not None and same_tensors(state, self._sizes[0]):
            return self._sizes[1]
        sizes = {op.name: (op.fp32_bytes(self.optimizer), op.compute_bytes(self.compute_dtype)) for op in self.ops}
        self._sizes = (state, sizes)
        return sizes

    def _sparse_slots(self, sizes: dict[str, tuple[int, int]]) -> tuple[tuple[str, ...], ...]:
        """Algorithm 1 on this rank's operators (of these sizes), at most `max_window` slots; W agreed across
        ranks (or fixed by `checkpoint.window`). The window's router statistics are closed on their device, W is decided
        before the order, and the order is read from the statistics only where it can matter (W > 1): a window
        of one slot holds every operator whatever their order, and waits for nothing."""
        self.tracker.close_window()
        if self.cfg.window:
            return self._fixed_slots(sizes)
        fp32, compute = _in_order(self._sized_order(sizes), sizes)
        t, bandwidth, most = self.profile.iteration_s, self.profile.bandwidth, self.cfg.max_window
        if self.cfg.slots == "bytes":
            window_size = min(most, self._agree(byte_window_size(fp32, compute, t, bandwidth)))
        else:
            window_size = min(most, self._agree(find_window_size(fp32, compute, t, bandwidth)[0]))
            self.last_inputs = WindowInputs(t, tuple(fp32), tuple(compute), bandwidth, window_size)
        if window_size > 1:
            self._refresh_order()
        return self._cut(window_size, sizes)

    def _fixed_slots(self, sizes: dict[str, tuple[int, int]]) -> tuple[tuple[str, ...], ...]:
        """A fixed W's slots: those of the last window while the order and sizes are the same (every window at
        W = 1, whose order never changes)."""
        self._refresh_order()
        if self._fixed is not None and self._fixed[0] is self.order and self._fixed[1] is sizes:
            return self._fixed[2]
        if self.cfg.slots == "count":
            fp32, compute = _in_order(self.order, sizes)
            t, bandwidth = self.profile.iteration_s, self.profile.bandwidth
            self.last_inputs = WindowInputs(t, tuple(fp32), tuple(compute), bandwidth, self.cfg.window)
        slots = self._cut(self.cfg.window, sizes)
        self._fixed = (self.order, sizes, slots)
        return slots

    def _cut(self, window_size: int, sizes: dict[str, tuple[int, int]]) -> tuple[tuple[str, ...], ...]:
        """The current order cut into `window_size` slots (by count, or by bytes of operators of these sizes)."""
        if self.cfg.slots == "bytes":
            return byte_slots(self.order, *_in_order(self.order, sizes), window_size)
        return generate_schedule(self.order, slot_size_for(len(self.order), window_size), window_size)

    def _sized_order(self, sizes: dict[str, tuple[int, int]]) -> list[str]:
        """An order whose operator sizes come in the sequence this window's order gives them, known before that
        order: the current one while no statistics were seen (the model's order); after, the experts first in
        registry order, as a popularity order puts them (one that only permutes the experts, so with experts all
        of one size the sequence is the same); where experts differ in size, the window's order itself."""
        if self.tracker.reference is None:
            return self.order
        if self._alike is None or self._alike[0] is not sizes:
            self._alike = (sizes, len({sizes[n] for n, e in zip(self.registry_order, self.is_expert) if e}) <= 1)
        if self._alike[1]:
            return self.kind_order
        self._refresh_order()
        return self.order

    def _refresh_order(self) -> None:
        """The order of the popularity the router statistics last set (one host read), where a window closed
        since it was last read; the order object stays while the order does not change (a fixed W's slots are
        reused by its identity)."""
        if not self.tracker.unread:
            return
        order = order_operators(self.registry_order, self.is_expert, self.tracker.popularity())
        if order != self.order:
            self.order = order

    def _interval_checkpoint(self, iteration: int, sizes: dict[str, tuple[int, int]]) -> tuple[tuple[str, ...]]:
        """An interval baseline's checkpoint at `iteration`: its operators (of these sizes), and when the next
        one is due."""
        names = tuple(self.policy.select())
        nbytes = sum(sizes[n][0] for n in names)
        interval = self._agree(self.policy.choose(nbytes, self.profile.bandwidth, self.profile.iteration_s))
        self.policy.scheduled(iteration, interval)
        return (names,)

    def _agree(self, window_size: int) -> int:
        """The largest window (or interval) any rank needs: checkpoints are global so they replicate in lockstep."""
        if self.world == 1:
            return window_size
        agreed = torch.tensor([window_size], dtype=torch.int64, device=self.device)
        collectives.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return int(agreed)

    def all_ranks(self, holds: bool) -> bool:
        """Whether `holds` is true on every rank (collective)."""
        if self.world == 1:
            return holds
        flag = torch.tensor([int(holds)], dtype=torch.int64, device=self.device)
        collectives.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag)

    def startup_sizes(self) -> list[int] | None:
        """Per slot, the bytes of the largest snapshot this rank's buffers will hold where that is known before
        any window is planned (`reservation`): a fixed `checkpoint.window`'s slots in either operator order, or an
        interval baseline's one slot of every operator's FP32 state. None where Algorithm 1 chooses W."""
        if self.policy is None and not self.cfg.window:
            return None
        sizes = operator_layout_bytes(self.ops, self.optimizer, self.compute_dtype)
        if self.policy is not None:
            return [max(sum(sizes.fp32), 1)]
        return [max(n, 1) for n in slot_bytes(self.ops, sizes, [self.cfg.window], self.cfg.slots)]


def _in_order(order: list[str], sizes: dict[str, tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(FP32-state bytes, compute-weight bytes) of the operators in `order`."""
    return [sizes[n][0] for n in order], [sizes[n][1] for n in order]
