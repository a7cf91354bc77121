"""The sparse checkpointing engine in a real training loop: snapshot contents, no torn copies,
garbage collection, shared-memory survival, disk persistence."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch

from moevement.checkpoint.checkpointer import persisted_snapshots
from moevement.operators import optimizer_tensors
from moevement.storage.host_memory import map_bytes, read_header
from moevement.storage.persistence import read_window, window_dir
from moevement.storage.snapshot import SnapshotError, SnapshotHeader, read_entries
from parallelisms.pipeline import lm_loss
from tests.tiny_moe import full_state, tiny_engine
from trainer.step import take_expert_load


def train(
    rank_dir: Path, steps: int, compute_dtype=torch.float32, on_snapshot=None, prepare=None, skip_steps=(), **opts
):
    """Train a tiny MoE for `steps` iterations with the engine on; call `on_snapshot(header, before)` after
    each iteration that took a snapshot, with the state copied synchronously before its optimizer step
    (and `prepare(engine)` before the first iteration). The iterations in `skip_steps` skip the optimizer
    step, as a loss scaler does on overflow."""
    model, optimizer, engine = tiny_engine(rank_dir, compute_dtype, **opts)
    if prepare is not None:
        prepare(engine)
    data = torch.Generator().manual_seed(1)
    for t in range(1, steps + 1):
        engine.begin(t)
        before = full_state(model, optimizer)
        x = torch.randint(0, 64, (4, 16), generator=data)
        loss = lm_loss(model(x), x.roll(-1, 1))
        loss.backward()
        if t not in skip_steps:
            optimizer.step()
        optimizer.zero_grad()
        engine.end(t, {"loss": loss.item(), "clip_coef": 1.0}, *take_expert_load(model))
        if engine.metrics()["ckpt_mb"] and on_snapshot is not None:
            assert engine.latest[0].iteration == t
            on_snapshot(engine.latest[0], before, engine)
    engine.close()
    return engine


def check_snapshot(header: SnapshotHeader, before: dict, engine, compute_dtype) -> None:
    tensors = read_entries(engine.latest[1], header)
    masters = {name for (role, name) in tensors if role == "master"}
    ops = engine.ops_by_name
    assert masters == {name for op in header.active for name, _ in ops[op].master_tensors(engine.optimizer)}
    for (role, name), value in tensors.items():
        expected = before[name] if role == "master" else before[name].to(compute_dtype)
        assert value.dtype == expected.dtype and torch.equal(value, expected), (header.iteration, role, name)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
@pytest.mark.parametrize("priority, policy", [("idle", "SCHED_IDLE"), ("normal", "SCHED_OTHER")])
def test_copy_thread_gives_way_to_compute(tmp_path, priority, policy):
    """The copy thread runs with one OpenMP thread and, at `idle` priority, under SCHED_IDLE."""
    _, _, engine = tiny_engine(tmp_path, background_priority=priority)
    seen = engine.buffers.submit(lambda: (os.sched_getscheduler(0), torch.get_num_threads())).result()
    engine.close()
    assert seen == (getattr(os, policy), 1)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the training thread keeps its priority


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_window_reassembles_exact_state_at_each_snapshot_iteration(tmp_path, compute_dtype):
    seen: dict[int, list] = {}

    def on_snapshot(header, before, engine):
        check_snapshot(header, before, engine, compute_dtype)
        seen.setdefault(header.window_start, []).append(header)
        assert header.meta["data_position"] == header.iteration and header.meta["scalars"]["clip_coef"] == 1.0

    engine = train(tmp_path / "rank0", 11, compute_dtype, on_snapshot)
    all_ops = sorted(engine.ops_by_name)
    assert sorted(seen) == [3, 6, 9]
    for start, headers in seen.items():
        assert [h.iteration for h in headers] == list(range(start, start + len(headers)))
        if len(headers) == 3:  # every operator in exactly one slot of a complete window
            assert sorted(op for h in headers for op in h.active) == all_ops
        for h in headers:  # compute weights are exactly the later slots' operators
            later = [op for g in headers[h.slot + 1 :] for op in g.active]
            assert len(headers) < 3 or h.frozen == later


def test_windows_of_one_slot_reuse_their_layout_and_stay_exact(tmp_path):
    """At W=1 every iteration opens a window with the same slot: its layout is resolved once and reused,
    every snapshot is still the exact pre-step state with checksums of its own, and after a recovery
    (`forget_layouts`) the next window lays out afresh."""
    layouts, sums = [], []

    def on_snapshot(header, before, engine):
        check_snapshot(header, before, engine, torch.float32)
        layouts.append(engine.current_window.layouts)
        sums.append(header.checksums)
        assert header.checksums[-1][1] == len(header.entries), "its checksums cover every entry"

    engine = train(tmp_path / "rank0", 8, on_snapshot=on_snapshot, window=1, chunk_mb=1)
    assert engine.buffers.chunk_bytes == 1 << 20  # checkpoint.chunk_mb
    assert len(layouts) == 6 and all(layout is layouts[0] for layout in layouts)
    assert all(a != b for a, b in zip(sums, sums[1:])), "each snapshot's header has the checksums of its bytes"
    engine.planner.forget_layouts()
    assert engine.planner.layouts(engine.current_window.plan, optimizer_tensors(engine.optimizer)) is not layouts[0]


def test_a_first_optimizer_step_inside_a_window_lays_its_snapshots_out_again(tmp_path):
    """A window's snapshots are laid out at its start; when the optimizer's state appears inside the window
    (the steps before were skipped), the later snapshots hold it all the same."""
    with_state = []

    def on_snapshot(header, before, engine):
        tensors = read_entries(engine.latest[1], header)
        ops = engine.ops_by_name
        held = {name for op in header.active for name, _ in ops[op].master_tensors(engine.optimizer)}
        assert {name for role, name in tensors if role == "master"} == held & before.keys()  # all of state_t
        assert all(torch.equal(value, before[name]) for (_, name), value in tensors.items())
        with_state.append(any(e.name.startswith("optim.") for e in header.entries))

    train(tmp_path / "rank0", 5, on_snapshot=on_snapshot, skip_steps=(1, 2), profile_iters=1)
    assert with_state == [False, False, True, True], with_state  # the first step comes after begin(3)


def test_the_commit_record_is_the_headers_json_byte_for_byte():
    """The copy thread encodes a header but for `meta`, its layout's entries encoded once and its own chunk
    checksums in; with the iteration's `meta` added it is exactly the encoding of the whole header."""
    from moevement.storage.private_files import encode_json
    from moevement.storage.snapshot import Entry, encode_entries

    layout = [Entry("op", f"t{i}", "master", "float32", [i, 2], 1024 * i, 8 * i) for i in range(5)]
    encoded_layout = encode_entries(layout)
    for round_ in range(2):  # one layout, two snapshots of it
        header = SnapshotHeader(7, 5, 2, 4, 1, ["op"], ["b", "c"], layout, 5120, {"seed": 0, "run": {"job": "x"}})
        header.checksums = [[0, 3, f"{round_}{0:015x}"], [3, 5, f"{round_}{1:015x}"]]
        prepared = header.encode_without_meta(encoded_layout)
        header.meta["scalars"] = {"loss": 1.25, "clip_coef": 0.5}
        commit = prepared.with_meta(header.meta)
        assert commit.encoded == encode_json(header.to_json()) == header.commit_record().encoded
        assert any(part is encoded_layout for part in commit.parts)  # the layout's bytes, not a copy of them
        assert (commit.slot, commit.window_start, commit.nbytes) == (2, 5, 5120)
        assert SnapshotHeader.from_json(header.to_json()) == header


def test_a_meta_beginning_with_the_jobs_items_is_encoded_splicing_the_jobs_encoding(monkeypatch):
    """`MetaEncoder` encodes every `meta` as `encode_json` does; the job's part is encoded once, and only a meta
    that begins with the job's very keys and values is spliced (an equal but other value, even 0 for False, is not)."""
    import moevement.storage.snapshot as snapshot
    from moevement.storage.private_files import encode_json

    job = {"seed": 0, "run": {"job": "x", "fields": {"a": 1, "b": True}}, "rank": 3}
    encode = snapshot.MetaEncoder(job).encode
    encoded = []
    monkeypatch.setattr(snapshot, "encode_json", lambda payload: encoded.append(payload) or encode_json(payload))
    spliced = {**job, "data_position": 9, "scalars": {"loss": 1.25}, "moc": [1, 2]}
    assert encode(spliced) == encode_json(spliced)
    assert encoded == [{"data_position": 9, "scalars": {"loss": 1.25}, "moc": [1, 2]}]  # the job's part not again
    others = [
        dict(job),
        {"data_position": 9, **job},
        {**job, "run": {"job": "x", "fields": {"a": 1, "b": True}}, "data_position": 9},
        {**job, "seed": False, "data_position": 9},
        {"seed": 0, "rank": 3, "run": job["run"], "data_position": 9},
        {},
    ]
    for meta in others:
        encoded.clear()
        assert encode(meta) == encode_json(meta)
        assert encoded == [meta], "encoded whole"
    assert snapshot.MetaEncoder({}).encode({"a": 1}) == encode_json({"a": 1})


def test_a_header_of_the_older_format_is_refused_in_one_line():
    """A header with a checksum per entry (written before chunk checksums) is refused, not misread."""
    from moevement.storage.snapshot import Entry

    header = SnapshotHeader(7, 5, 2, 4, 1, ["op"], [], [Entry("op", "t", "master", "float32", [2], 0, 8)], 1024)
    old = header.to_json()
    del old["checksums"], old["checksum_format"]
    old["entries"][0]["checksum"] = "0123456789abcdef"
    with pytest.raises(SnapshotError, match=r"^snapshot header of an older format \(a checksum per tensor"):
        SnapshotHeader.from_json(old)


def _buffers(directory: Path) -> list[Path]:
    return [p.with_suffix("") for p in sorted(directory.glob("*.bin"))]


def test_disk_persistence_round_trips_and_rejects_corruption(tmp_path):
    rank_dir, disk = tmp_path / "rank0", tmp_path / "disk"
    train(rank_dir, 2 + 3 * 3, persist_dir=str(disk))
    on_disk = read_window(window_dir(disk, 9) / "rank00000")
    in_memory = [(SnapshotHeader.from_json(h), path) for h, path in persisted_snapshots(rank_dir)]
    assert [h.iteration for h, _ in on_disk] == [9, 10, 11]
    for (disk_header, tensors), (header, path) in zip(on_disk, in_memory, strict=True):
        assert disk_header == header
        expected = read_entries(map_bytes(path), header)
        assert tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in tensors)
    assert sorted(p.name for p in disk.iterdir()) == ["window-00000006", "window-00000009"]  # two newest kept
    victim = window_dir(disk, 9) / "rank00000" / "s1.bin"
    raw = bytearray(victim.read_bytes())
    raw[100] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(SnapshotError, match="s1.bin: checksum mismatch"):
        read_window(window_dir(disk, 9) / "rank00000")


def _train_and_die(rank_dir: str, expected_file: str) -> None:
    """Child process: train until a checkpoint is persisted, save what it must contain, then be killed."""
    torch.set_num_threads(1)
    expected = {}

    def on_snapshot(header, before, engine):
        if header.window_start == 3:
            expected[header.iteration] = before
        if header.iteration == 5:
            torch.save(expected, expected_file)
            os.kill(os.getpid(), signal.SIGKILL)

    train(Path(rank_dir), 20, torch.bfloat16, on_snapshot, keep_host_state=False)


def test_shared_memory_snapshots_survive_the_death_of_their_process(tmp_path):
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    rank_dir = shm / f"moevement-test-{os.getpid()}" / "rank0"
    try:
        child = mp.get_context("spawn").Process(target=_train_and_die, args=(str(rank_dir), str(tmp_path / "exp.pt")))
        child.start()
        child.join(120)
        assert child.exitcode == -signal.SIGKILL
        expected = torch.load(tmp_path / "exp.pt", weights_only=True)
        snapshots = persisted_snapshots(rank_dir)
        assert [h["iteration"] for h, _ in snapshots] == [3, 4, 5]
        for raw_header, path in snapshots:
            header = SnapshotHeader.from_json(raw_header)
            for (role, name), value in read_entries(map_bytes(path), header).items():
                want = expected[header.iteration][name]
                assert torch.equal(value, want if role == "master" else want.to(torch.bfloat16))
    finally:
        import shutil

        shutil.rmtree(rank_dir.parent, ignore_errors=True)


def test_snapshot_checksums_are_xxh3_of_each_chunk():
    """copy_entries copies chunk by chunk and hashes each chunk once: each checksum is the XXH3-64 of exactly
    its entries' bytes with their padding, zeroed whatever the stale buffer held; a large entry ends a chunk;
    `verify_entries` accepts the result, and refuses a flipped byte, a dropped chunk or a shifted one."""
    import xxhash

    from moevement.storage.snapshot import BLOCK, Entry, verify_entries
    from moevement.storage.snapshot_copy import CopyPlan, Throttle, copy_entries

    g = torch.Generator().manual_seed(0)
    sizes = (1, 300, 0, 1000, (1 << 20) + 3, 7, 4096)  # the large one (float32) ends a chunk of 4 MiB
    sources = [torch.randn(n, generator=g) * 1e30 for n in sizes] + [torch.tensor(5.0)]
    entries, offset = [], 0
    for i, src in enumerate(sources):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        nbytes = src.numel() * dtype.itemsize
        entries.append(
            Entry("op", f"t{i}", "master", str(dtype).removeprefix("torch."), list(src.shape), offset, nbytes)
        )
        offset += -(-nbytes // BLOCK) * BLOCK
    buffer = torch.full((offset,), 255, dtype=torch.uint8)  # stale bytes where the padding goes
    plan = CopyPlan.of(buffer, entries, sources, chunk_bytes=4 << 20)
    sums = copy_entries(buffer, entries, sources, Throttle(0), plan=plan)
    assert [(start, stop) for start, stop, _ in sums] == [(0, 5), (5, 8)], sums
    for entry, src in zip(entries, sources):
        raw = buffer[entry.offset : entry.offset + entry.nbytes]
        assert torch.equal(raw.view(getattr(torch, entry.dtype)).view(entry.shape), src.to(getattr(torch, entry.dtype)))
        assert not buffer[entry.offset + entry.nbytes : entry.offset + -(-entry.nbytes // BLOCK) * BLOCK].any()
    for start, stop, value in sums:
        lo, hi = entries[start].offset, (entries[stop].offset if stop < len(entries) else offset)
        assert value == xxhash.xxh3_64_hexdigest(buffer[lo:hi].numpy().tobytes())
    header = SnapshotHeader(1, 1, 0, 1, 0, ["op"], [], entries, offset, checksums=sums)
    verify_entries(buffer, header)
    flipped = buffer.clone()
    flipped[entries[6].offset] ^= 1
    with pytest.raises(SnapshotError, match=r"checksum mismatch in master tensor\(s\) t5 \.\. t7 \(iteration 1\)"):
        verify_entries(flipped, header)
    with pytest.raises(SnapshotError, match="its checksums cover 5 of its 8 tensors"):
        verify_entries(buffer, SnapshotHeader(1, 1, 0, 1, 0, ["op"], [], entries, offset, checksums=sums[:1]))
    with pytest.raises(SnapshotError, match="malformed checksum list at tensor 0"):
        verify_entries(buffer, SnapshotHeader(1, 1, 0, 1, 0, ["op"], [], entries, offset, checksums=sums[1:]))


def test_checksum_detects_every_corruption_a_sum_misses():
    """Compensating flips within one 1 KiB block, two swapped 8-byte words, moved blocks, a flip in the tail
    and a shorter length all change the hash (the block sums it replaced let the first two pass)."""
    from moevement.storage.snapshot import checksum as hash_bytes

    def checksum(t: torch.Tensor) -> str:
        return hash_bytes(memoryview(t.numpy()))

    raw = torch.randint(0, 256, (3 * 4096 + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    base = checksum(raw)
    assert checksum(raw.clone()) == base
    words = raw[:4096].clone().view(torch.int64)
    compensating = raw.clone()
    compensating[:4096].view(torch.int64)[:2] = torch.stack([words[0] + 1, words[1] - 1])  # same sum of the block
    swapped = raw.clone()
    swapped[:4096].view(torch.int64)[:2] = words[:2].flip(0)  # same sum, same block
    flipped = raw.clone()
    flipped[-1] ^= 1  # in the unaligned tail
    moved = raw.clone()
    moved[:4096], moved[4096:8192] = raw[4096:8192], raw[:4096]
    variants = [compensating, swapped, flipped, moved, raw[:-1]]
    assert not any(torch.equal(v[: raw.numel()], raw) for v in variants[:4])
    assert len({base, *map(checksum, variants)}) == 6
    assert checksum(torch.zeros(8, dtype=torch.uint8)) != checksum(torch.zeros(16, dtype=torch.uint8))


def test_a_restarted_process_reuses_the_pages_of_its_predecessors_buffers(tmp_path):
    """A buffer file an earlier process left (its commit record dropped) backs the new process's buffer
    of the same name with the same pages: nothing is allocated again, and it never shrinks."""
    from moevement.storage.host_memory import HostBuffer
    from moevement.storage.private_files import make_private_dir

    path = make_private_dir(tmp_path / "rank0") / "w0-s0"
    earlier = HostBuffer(path)
    earlier.ensure(1 << 20).copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    earlier.commit({"slot": 0})
    inode = os.stat(path.with_suffix(".bin")).st_ino
    earlier.release()
    path.with_suffix(".json").unlink()  # what drop_leftovers does
    later = HostBuffer(path)
    assert later.reserved() == 1 << 20 and later.capacity == 0
    data = later.ensure(4096)
    assert later.capacity == 1 << 20 and os.stat(path.with_suffix(".bin")).st_ino == inode
    assert torch.equal(data, torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))  # the very same pages
    assert read_header(path) is None  # without its record nothing reads the old bytes as a snapshot
    later.ensure(2 << 20)
    assert later.capacity == 2 << 20 and map_bytes(path).numel() == 2 << 20


def test_a_rejoin_may_roll_back_to_a_complete_window_not_yet_marked_persisted(tmp_path):
    """Windows 9-11 and 12-14 are complete in host memory, but the manifest records only 9 as persisted
    (a death kept the all-reduce of 12 from running). A whole-job restart takes 9; a rejoin whose
    survivors resume at 15 takes 12 (a window less to replay); one resuming at 14 cannot use 12."""
    import torch.distributed as dist

    from moevement.recovery.restart import find_restart_checkpoint
    from moevement.storage.private_files import write_json_atomic

    rank_dir = tmp_path / "rank00000"
    kept = {}

    def keep_window_9(header, before, engine):  # persisting 12 retires 9: keep its files as they were
        if header.iteration == 13:
            for path in (rank_dir / "local").glob("w*-s*.json"):
                if read_header(path.with_suffix(""))["window_start"] == 9:
                    kept.update({p: p.read_bytes() for p in (path, path.with_suffix(".bin"))})

    train(rank_dir, 14, on_snapshot=keep_window_9)
    assert len(kept) == 6
    for path, raw in kept.items():
        path.write_bytes(raw)
    manifest = read_header(rank_dir / "persisted")
    assert (manifest["window_start"], manifest["window"]) == (12, 3)
    write_json_atomic(rank_dir / "persisted.json", {**manifest, "window_start": 9, "window_index": 2})
    if dist.is_initialized():
        pytest.skip("needs its own one-rank process group")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        lines = []
        found = {
            resume_at: find_restart_checkpoint(
                tmp_path, None, lambda header, source: None, lines.append, True, resume_at
            )
            for resume_at in (0, 14, 15)
        }
    finally:
        dist.destroy_process_group()
    assert {k: (f.window_start, f.window_size, f.sources) for k, f in found.items()} == {
        0: (9, 3, ["local shared memory"]),
        14: (9, 3, ["local shared memory"]),
        15: (12, 3, ["local shared memory"]),
    }
    assert [h.iteration for h, _ in found[15].snapshots] == [12, 13, 14] and lines == []
