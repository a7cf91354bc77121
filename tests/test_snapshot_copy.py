"""A snapshot's copy in runs: the slices of stacked tensors and their shared step counters are copied with
one call per stack, and what lands in the buffer is every source, bit for bit, whatever order and sharing
the sources come in."""

from __future__ import annotations

import torch

from moevement.storage.snapshot import FORMAT, layout_of, read_entries
from moevement.storage.snapshot_copy import CopyPlan, Throttle, copy_entries


def _stacked_items(experts: int = 6, stacks: int = 3):
    """Items shaped like a MoE layer's snapshot, operator by operator as the registry names them: each expert's
    slice of every stack (weight, two moments, the stack's one step counter), then an unstacked tensor, then
    compute copies (bfloat16) of every other expert's slices."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(experts, 16, 64, generator=g) for _ in range(stacks)]
    moments = [[torch.randn(experts, 16, 64, generator=g) for _ in range(2)] for _ in range(stacks)]
    steps = [torch.tensor(float(7 + s)) for s in range(stacks)]
    slices = [w.unbind(0) for w in weights]
    items = []
    for e in range(experts):
        for s in range(stacks):
            items.append((f"x{e}", f"w{s}.{e}", "master", slices[s][e], torch.float32))
            for k, m in enumerate(moments[s]):
                items.append((f"x{e}", f"w{s}.{e}.m{k}", "master", m.unbind(0)[e], torch.float32))
            items.append((f"x{e}", f"w{s}.{e}.step", "master", steps[s], torch.float32))
    items.append(("block", "norm", "master", torch.randn(37, generator=g), torch.float32))  # padded: ends runs
    for e in range(0, experts, 2):
        for s in range(stacks):
            items.append((f"x{e}", f"w{s}.{e}", "compute", slices[s][e], torch.bfloat16))
    return items


def test_stacked_slices_and_step_counters_are_copied_in_runs_bit_for_bit():
    items = _stacked_items()
    entries, sources, nbytes = layout_of(items)
    assert [e.offset for e in entries] == sorted(e.offset for e in entries)
    buffer = torch.full((nbytes,), 255, dtype=torch.uint8)
    plan = CopyPlan.of(buffer, entries, sources, chunk_bytes=1 << 30)
    # per stack: the weights, each moment and the step counter are one run each (3 x 4), then the norm, then the
    # compute copies of every other expert (one per slice: their sources do not follow one another)
    assert plan.runs == 3 * 4 + 1 + 3 * 3
    sums = copy_entries(buffer, entries, sources, Throttle(), plan=plan)
    header = _Header(entries, sums, nbytes)
    read = read_entries(buffer, header)
    for _, name, role, src, dtype in items:
        assert torch.equal(read[(role, name)], src.to(dtype)), (role, name)
    assert len(read) == len(items)


def test_a_plan_zeroes_padding_and_runs_stop_at_chunk_ends():
    """A run never crosses a chunk (each chunk is hashed once its copy is done); padding is zeroed once, when
    the plan is made, and copies leave it so."""
    items = _stacked_items(experts=8, stacks=1)
    entries, sources, nbytes = layout_of(items)
    buffer = torch.full((nbytes,), 255, dtype=torch.uint8)
    plan = CopyPlan.of(buffer, entries, sources, chunk_bytes=3 * 4096)  # three expert slices per chunk
    assert len(plan.groups) > 4
    for group in plan.groups:
        assert sum(t.numel() * t.element_size() for t in group.targets) == group.nbytes
    copy_entries(buffer, entries, sources, Throttle(), plan=plan)
    for e in entries:
        pad = buffer[e.offset + e.nbytes : e.offset + -(-e.nbytes // 1024) * 1024]
        assert not pad.any(), e.name


def test_layout_order_does_not_depend_on_addresses():
    """Two copies of the same state at different addresses lay out the same entries in the same order."""
    first, second = _stacked_items(), _stacked_items()
    names = [(e.role, e.name, e.offset) for e in layout_of(first)[0]]
    assert names == [(e.role, e.name, e.offset) for e in layout_of(second)[0]]


class _Header:
    def __init__(self, entries, checksums, nbytes):
        self.entries, self.checksums, self.nbytes, self.iteration = entries, checksums, nbytes, 0
        self.checksum_format = FORMAT
