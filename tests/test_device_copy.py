"""A GPU's snapshot copy, run on CPU: chunks gathered through a staging ring land bit for bit, and the checksum
the device computes over the ring (`word_checksum`) is what the CPU recomputes when it verifies, and catches
what a sum misses."""

from __future__ import annotations

import json

import pytest
import torch

from moevement.checkpoint.in_flight import SnapshotInFlight
from moevement.storage import word_checksum
from moevement.storage.device_copy import DevicePlan, ring_bytes, slot_bytes
from moevement.storage.private_files import make_private_dirs
from moevement.storage.snapshot import CHUNK_BYTES, SnapshotError, SnapshotHeader, layout_of, read_entries
from moevement.storage.snapshot_buffers import SnapshotBuffers
from moevement.storage.snapshot_copy import Throttle, chunk_ends, copy_entries
from tests.test_snapshot_copy import _stacked_items


@pytest.fixture
def staged_buffers(tmp_path):
    """A rank's snapshot buffers taking a GPU's path on the CPU; every buffer released after the test."""
    buffers = SnapshotBuffers(make_private_dirs(tmp_path, "rank0"), torch.device("cpu"), "normal", staged=True)
    yield buffers
    for buf in buffers.all():
        buf.release()
    buffers.close()


def _reads_back(data: torch.Tensor, committed: SnapshotHeader, items) -> bool:
    """Whether the committed snapshot in `data` verifies and holds every item's source, cast as laid out."""
    read = read_entries(data, committed)
    return all(torch.equal(read[(role, name)], src.to(dtype)) for _, name, role, src, dtype in items)


def _checksum(t: torch.Tensor) -> str:
    return word_checksum.checksum(memoryview(t.numpy()))


def test_word_checksum_catches_what_a_sum_misses_and_equals_its_device_form():
    """Compensating changes and two top-bit flips within one block, swapped words, moved blocks and a word
    more or less all change it; summed over a zero-extended slot (`ChunkSums`, as the device does) it equals
    the CPU's checksum of the bytes."""
    raw = torch.randint(0, 256, (3 * 65536 + 5 * 1024,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    base = _checksum(raw)
    words = raw[:4096].clone().view(torch.int64)
    compensating = raw.clone()
    compensating[:4096].view(torch.int64)[:2] = torch.stack([words[0] + 1, words[1] - 1])
    swapped = raw.clone()
    swapped[:4096].view(torch.int64)[:2] = words[:2].flip(0)
    top_bits = raw.clone()
    top_bits[:4096].view(torch.int64)[:2] ^= torch.tensor(-(2**63))  # a multiple of 2^63 under any odd key
    moved = raw.clone()
    moved[:65536], moved[65536:131072] = raw[65536:131072], raw[:65536]
    shorter, longer = raw[:-8], torch.cat([raw, torch.zeros(8, dtype=torch.uint8)])
    variants = [compensating, swapped, top_bits, moved]
    assert not any(torch.equal(v, raw) for v in variants)
    assert len({base, *map(_checksum, [*variants, shorter, longer])}) == 7
    slot = torch.full((word_checksum.block_rounded(raw.numel()),), 0, dtype=torch.uint8)
    slot[: raw.numel()] = raw
    sums = word_checksum.ChunkSums([0, slot.numel() // word_checksum.BLOCK_BYTES], torch.device("cpu"))
    word_checksum.block_sums(slot, out=sums.views[1])
    sums.combine()
    assert word_checksum.finish(int(sums.sums[1]), raw.numel()) == base and int(sums.sums[0]) == 0
    with pytest.raises(ValueError, match="whole 64-bit words"):
        _checksum(raw[:-1])


def test_a_host_chunk_summed_over_its_entries_words_equals_the_checksum_of_all_its_bytes():
    """`SparseWords` (a GPU's step counters: values at padded offsets, zeros between) gives the CPU checksum
    of the whole chunk, across a block boundary and for a length that is not whole blocks, and changes with
    any of its words."""
    spans = [(0, 4), (1024, 1028), (65536 - 8, 65536 + 16), (70 * 1024, 70 * 1024 + 8)]
    nbytes = 71 * 1024
    chunk = torch.zeros(nbytes, dtype=torch.uint8)
    g = torch.Generator().manual_seed(1)
    for lo, hi in spans:
        chunk[lo:hi] = torch.randint(0, 256, (hi - lo,), dtype=torch.uint8, generator=g)
    words = word_checksum.SparseWords(spans, nbytes)
    before = words.checksum(chunk)
    assert before == _checksum(chunk)
    chunk[65536 + 8] ^= 1
    assert words.checksum(chunk) == _checksum(chunk) != before


def test_chunks_gathered_through_a_staging_ring_land_bit_for_bit_and_verify():
    """Stale bytes in the ring, slots taken in turn: the buffer ends as the direct copy leaves it, padding
    zero; the header's device checksums verify, and a flipped bit is caught naming its tensor."""
    items = _stacked_items(experts=8, stacks=2)
    entries, sources, nbytes = layout_of(items)
    direct = torch.full((nbytes,), 255, dtype=torch.uint8)
    copy_entries(direct, entries, sources, Throttle())
    chunk = 4 * 4096
    need = slot_bytes(entries, sources, chunk, torch.device("cpu"))
    assert need == 65536  # no chunk is longer than `chunk`: one 64 KiB block each
    slots = torch.full((2 * need,), 77, dtype=torch.uint8).chunk(2)
    buffer = torch.full((nbytes,), 255, dtype=torch.uint8)
    plan = DevicePlan.of(buffer, entries, sources, chunk, slots)
    assert len(plan.chunks) > 2 and {c.slot.data_ptr() for c in plan.chunks} == {s.data_ptr() for s in slots}
    sums = plan.checksums(plan.issue(stream=None))
    assert torch.equal(buffer, direct)
    header = SnapshotHeader(3, 3, 0, 1, 0, ["x0"], [], entries, nbytes, checksums=sums)
    header.checksum_format = word_checksum.FORMAT
    again = SnapshotHeader.from_json(header.to_json())
    assert _reads_back(buffer, again, items)
    buffer[entries[5].offset] ^= 1
    with pytest.raises(
        SnapshotError, match=r"checksum mismatch in master tensor\(s\) w0\.4 \.\. w0\.7 \(iteration 3\)"
    ):
        read_entries(buffer, again)


def test_a_chunk_its_entries_fill_skips_the_zeroing_and_stale_slot_bytes_never_reach_the_buffer():
    """Chunks of 64 KiB entries fill their slot's blocks: the gather writes every byte, so the slot is not
    zeroed first; a chunk with padding is. Slots full of stale bytes, the snapshot verifies and reads back."""
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(16384, generator=g) for _ in range(4)]  # 64 KiB each
    padded = [torch.randn(1000, generator=g) for _ in range(4)]  # 4,000 bytes each, padded to 4 KiB
    items = [("op", f"f{i}", "master", t, t.dtype) for i, t in enumerate(full)]
    items += [("op", f"p{i}", "compute", t, t.dtype) for i, t in enumerate(padded)]
    entries, sources, nbytes = layout_of(items)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    slots = torch.full((2 * (128 << 10),), 0xFF, dtype=torch.uint8).chunk(2)
    plan = DevicePlan.of(buffer, entries, sources, 128 << 10, slots)
    assert [c.zeroed for c in plan.chunks] == [False, False, True]
    header = SnapshotHeader(1, 1, 0, 1, 0, ["op"], [], entries, nbytes, checksums=plan.checksums(plan.issue(None)))
    header.checksum_format = word_checksum.FORMAT
    direct = torch.zeros(nbytes, dtype=torch.uint8)
    copy_entries(direct, entries, sources, Throttle())
    assert torch.equal(buffer, direct)  # padding zero, as a direct copy leaves it
    assert _reads_back(buffer, SnapshotHeader.from_json(header.to_json()), items)


def test_a_staged_snapshot_issued_by_the_buffers_commits_a_header_that_reads_back(staged_buffers):
    """`SnapshotBuffers.issue` (the training thread's path on a GPU), on CPU: the ring sized to the layout,
    the committed header of the device checksum format, read back bit for bit from the buffer."""
    buffers = staged_buffers
    items = _stacked_items()
    entries, sources, nbytes = layout_of(items)
    header = SnapshotHeader(1, 1, 0, 1, 0, ["x0"], [], entries, nbytes)
    buffer = buffers.buffer(0, 0)
    issued = buffers.issue(buffer, header, sources)
    issued.order_step()
    committed = SnapshotHeader.from_json(json.loads(issued.result().with_meta({}).encoded))
    assert committed.checksum_format == word_checksum.FORMAT
    assert buffers.slots[0].numel() == slot_bytes(entries, sources, buffers.chunk_bytes, torch.device("cpu"))
    largest = max(e.nbytes for e in entries)
    assert len(buffers.slots) * buffers.slots[0].numel() < ring_bytes(largest) == 3 * CHUNK_BYTES
    assert ring_bytes(CHUNK_BYTES + 1) == 3 * (CHUNK_BYTES + 65536)  # an entry larger than a chunk
    assert ring_bytes(largest, graphed=True) == 4 * CHUNK_BYTES  # the graphs' pool holds a transient too
    assert _reads_back(buffer.data, committed, items)


def test_staged_chunks_are_as_long_as_the_largest_entry_the_ring_must_hold_anyway(staged_buffers):
    """A layout with an entry longer than a chunk: the ring holds it whole, so every chunk may be as long
    (fewer chunks, each seven launches on a GPU, for no more device memory); the snapshot reads back."""
    buffers = staged_buffers
    buffers.chunk_bytes = 64 << 10
    g = torch.Generator().manual_seed(2)
    sources = [torch.randn(65536, generator=g)] + [torch.randn(4096, generator=g) for _ in range(24)]
    items = [("op", f"t{i}", "master", t, t.dtype) for i, t in enumerate(sources)]  # 256 KiB, then 24 x 16 KiB
    entries, ordered, nbytes = layout_of(items)
    buffer = buffers.buffer(0, 0)
    issued = buffers.issue(buffer, SnapshotHeader(1, 1, 0, 1, 0, ["op"], [], entries, nbytes), ordered)
    issued.order_step()
    committed = SnapshotHeader.from_json(json.loads(issued.result().with_meta({}).encoded))
    assert len(committed.checksums) == 3  # 256 KiB chunks: the large entry, 16 small ones, 8 small ones
    assert len(chunk_ends(entries, buffers.chunk_bytes, ordered, at_most=True)) == 7  # at 64 KiB
    assert buffers.slots[0].numel() == 256 << 10
    assert _reads_back(buffer.data, committed, items)


class _OnDevice:
    """What a layout reads of a slice of a stacked tensor on an accelerator (no accelerator needed)."""

    device = torch.device("cuda", 0)

    def __init__(self, storage: int, index: int, numel: int = 1024):
        self.shape, self._ptr, self._offset = [numel], storage, index * numel

    def numel(self) -> int:
        return self.shape[0]

    def storage_offset(self) -> int:
        return self._offset

    def untyped_storage(self):
        return type("Storage", (), {"data_ptr": lambda _: self._ptr})()


def test_a_gpu_layout_keeps_its_host_step_counters_out_of_its_device_chunks():
    """Stacks on an accelerator, each with its moments, and the optimizer's step counters on the host: the
    counters come last in their role, so the device's bytes are chunked by size (one chunk here), not cut
    at every tensor."""
    experts, stacks = 6, 3
    steps = [torch.tensor(float(s)) for s in range(stacks)]
    items = []
    for e in range(experts):
        for s in range(stacks):
            items.append((f"x{e}", f"w{s}.{e}", "master", _OnDevice(10 * s + 1, e), torch.float32))
            items += [
                (f"x{e}", f"w{s}.{e}.m{k}", "master", _OnDevice(10 * s + 2 + k, e), torch.float32) for k in (0, 1)
            ]
            items.append((f"x{e}", f"w{s}.{e}.step", "master", steps[s], torch.float32))
    items += [(f"x{e}", f"w0.{e}", "compute", _OnDevice(1, e), torch.bfloat16) for e in range(experts)]
    entries, sources, _ = layout_of(items)
    devices = [(e.role, src.device.type) for e, src in zip(entries, sources)]
    assert devices == sorted(devices, key=lambda d: (d[0] != "master", d[1] == "cpu"))
    assert len(chunk_ends(entries, 1 << 30, sources, at_most=True)) == 3  # device bytes, counters, compute


class _SlowHandoff:
    """A hand-off whose older window is still being replicated when the snapshot starts."""

    def __init__(self):
        self.calls: list = []

    def reusable(self, window_index: int) -> bool:
        self.calls.append(("reusable", window_index))
        return False

    def wait_until_reusable(self, window_index: int) -> None:
        self.calls.append(("wait", window_index))

    def commit(self, window_index: int, commit, buffer, last: bool) -> None:
        self.calls.append(("commit", window_index, last))
        self.record = commit


def test_a_gpu_copy_whose_buffer_is_not_yet_free_is_issued_just_before_the_step(staged_buffers):
    """`begin` does not wait on the host: the copy is issued in the step's pre-hook, after waiting for the
    buffer there, and commits a header of the device format that reads back."""
    handoff = _SlowHandoff()
    in_flight = SnapshotInFlight(staged_buffers, handoff, Throttle, {})
    items = _stacked_items()
    entries, sources, nbytes = layout_of(items)
    buffer = staged_buffers.buffer(1, 0)
    in_flight.start(5, SnapshotHeader(5, 5, 0, 1, 0, ["x0"], [], entries, nbytes), sources, buffer)
    assert handoff.calls == [("reusable", 5)] and in_flight.pending.copy.issued is None
    in_flight.wait()
    assert handoff.calls == [("reusable", 5), ("wait", 5)] and in_flight.pending.copy.issued is not None
    in_flight.commit({"loss": 1.0})
    assert handoff.calls[-1] == ("commit", 5, True)
    committed = SnapshotHeader.from_json(json.loads(handoff.record.encoded))
    assert committed.checksum_format == word_checksum.FORMAT and committed.meta["scalars"] == {"loss": 1.0}
    assert _reads_back(buffer.data, committed, items)
