"""Algorithm 1 of the paper: window size and the sparse snapshot schedule.

Operators are ordered by ascending popularity (non-expert operators count as most popular and go
last) and cut into `W` slots of `O_active` operators. Snapshot `SS_{t0+i}` holds the FP32 state
of slot `i` and the compute weights of slots `> i` (docs/design/state-and-snapshots.md), so its size is
`fp32(slot i) + compute(slots > i)`.

FindWindowSize picks the largest slot `O_active` for which every snapshot of the window can be
copied within one iteration at the measured (or capped) bandwidth; `W = ceil(O_total / O_active)`.
GenerateSchedule cuts the ordered operators into those slots.

Equal operator counts (`slots = "count"`, the paper) suit operators of similar size. When sizes
differ a lot (small models: a dense block can be 10x an expert) the slot holding the largest
operators decides `O_active` for all. `slots = "bytes"` cuts by bytes instead: `byte_window_size`
is the fewest consecutive slots in the same order whose snapshots each fit the budget (greedy,
which is optimal here), and `byte_slots` cuts the operators into a given `W` slots with the
largest snapshot as small as possible.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class WindowSpan(NamedTuple):
    """The iterations of a window: `[start, start + size)`, `size` its W."""

    start: int
    size: int


@dataclass(frozen=True)
class WindowPlan:
    """Window `[start, start + W)`: slot `i` (operator names) gets its FP32 state snapshotted at `start + i`."""

    start: int
    slots: tuple[tuple[str, ...], ...]

    @property
    def window_size(self) -> int:
        """W: the window's slots, one snapshot each."""
        return len(self.slots)

    @property
    def end(self) -> int:
        """First iteration after the window."""
        return self.start + self.window_size

    def slot_at(self, iteration: int) -> int:
        if not self.start <= iteration < self.end:
            raise ValueError(f"iteration {iteration} is outside window [{self.start}, {self.end})")
        return iteration - self.start

    def frozen_after(self, slot: int) -> tuple[str, ...]:
        """Operators whose compute weights `SS_{start+slot}` holds: those of later slots. Its cost is the
        operators it names: the empty slots that end a window longer than its operators need are not walked."""
        return tuple(name for later in self.slots[slot + 1 : self._occupied] for name in later)

    @functools.cached_property
    def _occupied(self) -> int:
        """How many slots precede the trailing empty ones."""
        return next((i + 1 for i in range(len(self.slots) - 1, -1, -1) if self.slots[i]), 0)


def order_operators(names: Sequence[str], experts: Sequence[bool], popularity: dict[str, float]) -> list[str]:
    """Ascending popularity; ties by registry position. Non-expert operators last, in registry order."""
    routed = [i for i, is_expert in enumerate(experts) if is_expert]
    routed.sort(key=lambda i: (popularity.get(names[i], 0.0), i))
    others = [i for i, is_expert in enumerate(experts) if not is_expert]
    return [names[i] for i in routed + others]


def generate_schedule(ordered: Sequence[str], o_active: int, window_size: int) -> tuple[tuple[str, ...], ...]:
    """Consecutive slots of `o_active` operators; trailing slots are empty when the window exceeds the need."""
    if o_active < 1 or window_size * o_active < len(ordered):
        raise ValueError(f"{window_size} slots of {o_active} cannot hold {len(ordered)} operators")
    return tuple(tuple(ordered[i * o_active : (i + 1) * o_active]) for i in range(window_size))


def snapshot_sizes(slots: Sequence[Sequence[int]], fp32: Sequence[int], compute: Sequence[int]) -> list[int]:
    """Bytes of each snapshot of a window whose slots hold operator indices."""
    later = sum(compute[j] for slot in slots for j in slot)
    sizes = []
    for slot in slots:
        later -= sum(compute[j] for j in slot)
        sizes.append(sum(fp32[j] for j in slot) + later)
    return sizes


def find_window_size(
    fp32: Sequence[int], compute: Sequence[int], iteration_s: float, bandwidth: float
) -> tuple[int, int]:
    """(W, O_active) for operators in schedule order with these FP32 / compute sizes in bytes.

    The largest `O_active` whose every snapshot takes at most `iteration_s` at `bandwidth` bytes/s.
    If even one operator per slot does not fit, returns one per slot (snapshots then stall).
    """
    n = len(fp32)
    if n == 0:
        return 1, 1
    budget = iteration_s * bandwidth
    for o_active in range(n, 0, -1):
        window_size = math.ceil(n / o_active)
        slots = [range(i * o_active, min(n, (i + 1) * o_active)) for i in range(window_size)]
        if max(snapshot_sizes(slots, fp32, compute)) <= budget:
            return window_size, o_active
    return n, 1


def slot_size_for(n_operators: int, window_size: int) -> int:
    """O_active for a window size given by the user or agreed across ranks: ceil(O_total / W)."""
    return max(1, math.ceil(n_operators / window_size))


def _greedy_slots(
    fp32: Sequence[int], compute: Sequence[int], budget: float, oversize_alone: bool = False
) -> list[int] | None:
    """Slot lengths from filling each slot as far as its snapshot fits `budget`.

    An operator that does not fit even alone gets a slot of its own if `oversize_alone`, else None."""
    rest, lengths, i, n = sum(compute), [], 0, len(fp32)
    while i < n:
        rest -= compute[i]
        size, j = fp32[i] + rest, i + 1
        if size > budget and not oversize_alone:
            return None
        while size <= budget and j < n and size + fp32[j] - compute[j] <= budget:
            size += fp32[j] - compute[j]
            rest -= compute[j]
            j += 1
        lengths.append(j - i)
        i = j
    return lengths


def byte_window_size(fp32: Sequence[int], compute: Sequence[int], iteration_s: float, bandwidth: float) -> int:
    """Fewest consecutive slots whose every snapshot takes at most `iteration_s` at `bandwidth` bytes/s.

    Filling each slot as far as it fits is optimal: a snapshot grows as its slot starts earlier or
    ends later, so the greedy cut is never behind another. An operator that does not fit alone gets
    a slot of its own (that snapshot then stalls)."""
    return max(1, len(_greedy_slots(fp32, compute, iteration_s * bandwidth, oversize_alone=True)))


def byte_slots(
    ordered: Sequence[str], fp32: Sequence[int], compute: Sequence[int], window_size: int
) -> tuple[tuple[str, ...], ...]:
    """Cut the ordered operators into `window_size` consecutive slots with the largest snapshot as small as possible.

    Binary search on the budget with the greedy cut; trailing slots are empty when fewer suffice."""
    lo, hi = 0, sum(fp32) + sum(compute)  # one slot holding everything always fits `hi`
    while lo < hi:
        mid = (lo + hi) // 2
        lengths = _greedy_slots(fp32, compute, mid)
        if lengths is not None and len(lengths) <= window_size:
            hi = mid
        else:
            lo = mid + 1
    slots, start = [], 0
    for length in _greedy_slots(fp32, compute, lo):
        slots.append(tuple(ordered[start : start + length]))
        start += length
    return tuple(slots) + ((),) * (window_size - len(slots))
