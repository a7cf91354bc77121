"""Algorithm 1 of the paper: window size and the sparse snapshot schedule.

Operators are ordered by ascending popularity (non-expert operators count as most popular and go
last) and cut into `W` slots of `O_active` operators. Snapshot `SS_{t0+i}` holds the FP32 state
of slot `i` and the compute weights of slots `> i` (DESIGN.md §2), so its size is
`fp32(slot i) + compute(slots > i)`.

FindWindowSize picks the largest slot `O_active` for which every snapshot of the window can be
copied within one iteration at the measured (or capped) bandwidth; `W = ceil(O_total / O_active)`.
GenerateSchedule cuts the ordered operators into those slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class WindowPlan:
    """Window `[start, start + W)`: slot `i` (operator names) gets its FP32 state snapshotted at `start + i`."""

    start: int
    slots: tuple[tuple[str, ...], ...]

    @property
    def window(self) -> int:
        return len(self.slots)

    @property
    def end(self) -> int:
        """First iteration after the window."""
        return self.start + self.window

    def slot_at(self, iteration: int) -> int:
        if not self.start <= iteration < self.end:
            raise ValueError(f"iteration {iteration} is outside window [{self.start}, {self.end})")
        return iteration - self.start

    def frozen_after(self, slot: int) -> tuple[str, ...]:
        """Operators whose compute weights `SS_{start+slot}` holds: those of later slots."""
        return tuple(name for later in self.slots[slot + 1:] for name in later)


def order_operators(names: Sequence[str], experts: Sequence[bool], popularity: dict[str, float]) -> list[str]:
    """Ascending popularity; ties by registry position. Non-expert operators last, in registry order."""
    routed = [i for i, is_expert in enumerate(experts) if is_expert]
    routed.sort(key=lambda i: (popularity.get(names[i], 0.0), i))
    others = [i for i, is_expert in enumerate(experts) if not is_expert]
    return [names[i] for i in routed + others]


def generate_schedule(ordered: Sequence[str], o_active: int, window: int) -> tuple[tuple[str, ...], ...]:
    """Consecutive slots of `o_active` operators; trailing slots are empty when the window exceeds the need."""
    if o_active < 1 or window * o_active < len(ordered):
        raise ValueError(f"{window} slots of {o_active} cannot hold {len(ordered)} operators")
    return tuple(tuple(ordered[i * o_active:(i + 1) * o_active]) for i in range(window))


def snapshot_sizes(slots: Sequence[Sequence[int]], fp32: Sequence[int], compute: Sequence[int]) -> list[int]:
    """Bytes of each snapshot of a window whose slots hold operator indices."""
    later = sum(compute[j] for slot in slots for j in slot)
    sizes = []
    for slot in slots:
        later -= sum(compute[j] for j in slot)
        sizes.append(sum(fp32[j] for j in slot) + later)
    return sizes


def find_window_size(fp32: Sequence[int], compute: Sequence[int], iteration_s: float,
                     bandwidth: float) -> tuple[int, int]:
    """(W, O_active) for operators in schedule order with these FP32 / compute sizes in bytes.

    The largest `O_active` whose every snapshot takes at most `iteration_s` at `bandwidth` bytes/s.
    If even one operator per slot does not fit, returns one per slot (snapshots then stall).
    """
    n = len(fp32)
    if n == 0:
        return 1, 1
    budget = iteration_s * bandwidth
    for o_active in range(n, 0, -1):
        window = math.ceil(n / o_active)
        slots = [range(i * o_active, min(n, (i + 1) * o_active)) for i in range(window)]
        if max(snapshot_sizes(slots, fp32, compute)) <= budget:
            return window, o_active
    return n, 1


def slot_size_for(n_operators: int, window: int) -> int:
    """O_active for a window size given by the user or agreed across ranks: ceil(O_total / W)."""
    return max(1, math.ceil(n_operators / window))
