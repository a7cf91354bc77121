"""How large a rank's snapshot buffers grow for the windows it may plan, known before any window is planned
(docs/design/sparse-checkpointing.md): what a start-up reserves where the plan does not depend on the profile, and what
`train.py --dry-run` prints (`trainer/estimates/host_estimate.py`).

A snapshot's bytes are its entries', each padded to a block (`moevement.storage.snapshot.layout_of`), so a slot's
snapshot is the sum, over its operators, of their FP32 state as laid out, and over the later slots' operators, of
their compute weights as laid out: per operator two numbers (`operator_layout_bytes`). A slot's buffer keeps the
largest snapshot it ever holds: over every window size considered and both operator orders a window may have
(the model's, for a first window; routed experts first, as a popularity order puts them; experts are all of one
size, so which expert goes where does not change a size) (`slot_bytes`).

Before the first optimizer step a parameter has no optimizer state yet; it counts as AdamW's (two moments shaped
like the parameter's local part, and a step counter), the state the trainer's optimizer gives it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from moevement.checkpoint.schedule import byte_slots, generate_schedule, order_operators, slot_size_for, snapshot_sizes
from moevement.operators import OPTIMIZER_KEYS, Operator, local_tensor
from moevement.storage.snapshot import entry_layout


@dataclass(frozen=True)
class OperatorBytes:
    """Per operator, in registry order: FP32-state and compute-weight bytes as a snapshot lays them out, and
    their entry counts."""

    fp32: list[int]
    compute: list[int]
    fp32_entries: list[int]
    compute_entries: list[int]


class _WithAdamWState:
    """An optimizer's `state` as `Operator.master_tensors` reads it, with AdamW's state (on meta) for every
    parameter that has none yet."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.state = dict(optimizer.state)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not any(k in self.state.get(p, {}) for k in OPTIMIZER_KEYS):
                    like = torch.empty_like(local_tensor(p), device="meta")
                    step = torch.zeros((), dtype=torch.float32, device="meta")
                    self.state[p] = {"exp_avg": like, "exp_avg_sq": like, "step": step}


def operator_layout_bytes(ops: list[Operator], optimizer, compute_dtype: torch.dtype) -> OperatorBytes:
    """Each operator's bytes and entries in a snapshot (see the module docstring)."""
    state = _WithAdamWState(optimizer)
    out = OperatorBytes([], [], [], [])
    for op in ops:
        fp32, _, fp32_bytes = entry_layout([op], [], state, compute_dtype)
        compute, _, compute_bytes = entry_layout([], [op], state, compute_dtype)
        out.fp32.append(fp32_bytes)
        out.compute.append(compute_bytes)
        out.fp32_entries.append(len(fp32))
        out.compute_entries.append(len(compute))
    return out


def slot_bytes(
    ops: list[Operator],
    sizes: OperatorBytes,
    window_sizes: Iterable[int],
    slots: str,
    cost: Callable[[int, int], int] = lambda nbytes, _entries: nbytes,
) -> list[int]:
    """Per slot index, the largest `cost(bytes, entries)` of the snapshot any window of `window_sizes` gives it (by
    default its bytes), in either order a window may have, its operators cut into slots by count or by bytes
    (`slots`, as the planner cuts)."""
    names = [op.name for op in ops]
    orders = [names, order_operators(names, [op.kind == "expert" for op in ops], {})]
    index = {name: i for i, name in enumerate(names)}
    largest: list[int] = []
    for window_size in window_sizes:
        for order in orders:
            members = [[index[n] for n in slot] for slot in _cut(order, index, sizes, window_size, slots)]
            nbytes = snapshot_sizes(members, sizes.fp32, sizes.compute)
            entries = snapshot_sizes(members, sizes.fp32_entries, sizes.compute_entries)
            for slot, (n, e) in enumerate(zip(nbytes, entries)):
                largest.extend([0] * (slot + 1 - len(largest)))
                largest[slot] = max(largest[slot], cost(n, e))
    return largest


def _cut(
    order: Sequence[str], index: dict[str, int], sizes: OperatorBytes, window_size: int, slots: str
) -> tuple[tuple[str, ...], ...]:
    if slots == "bytes":
        fp32, compute = [sizes.fp32[index[n]] for n in order], [sizes.compute[index[n]] for n in order]
        return byte_slots(order, fp32, compute, window_size)
    return generate_schedule(order, slot_size_for(len(order), window_size), window_size)
