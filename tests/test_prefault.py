"""Snapshot buffers never grow on the training thread (`checkpoint.prefault`): a window whose buffers are not
yet grown waits while the prefault thread grows them; a plan known before training is reserved at start-up;
a later generation takes back the mappings its predecessor kept; `prefault_rank_dir` (start-up, a standby)
maps what a rank directory holds, once, and nothing that is not the rank's own; a standby keeps those mappings
current while it waits (`PrefaultWatch`)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from moevement.checkpoint.reservation import operator_layout_bytes, slot_bytes
from moevement.storage import host_memory, mappings
from moevement.storage.host_memory import HostBuffer, prefault_rank_dir
from moevement.storage.mappings import KEPT
from moevement.storage.prefault_watch import PrefaultWatch
from moevement.storage.private_files import HostMemoryError, make_private_dirs
from moevement.storage.snapshot_buffers import SnapshotBuffers
from tests.tiny_moe import iteration, tiny_engine


def _growth_threads(monkeypatch) -> list[str]:
    """The name of the thread of every buffer growth from now on."""
    threads: list[str] = []
    grow = HostBuffer._grow

    def recorded(self, nbytes):
        threads.append(threading.current_thread().name)
        return grow(self, nbytes)

    monkeypatch.setattr(HostBuffer, "_grow", recorded)
    return threads


def _train(engine, model, optimizer, steps: int, on_snapshot=None, before_iteration=None) -> list[int]:
    """`steps` iterations of the tiny MoE under `engine` (`before_iteration(t)` called first); the iterations
    that took a snapshot (each checked by `on_snapshot(header, state before its step)`)."""
    data, taken = torch.Generator().manual_seed(1), []
    for t in range(1, steps + 1):
        if before_iteration is not None:
            before_iteration(t)
        before = iteration(engine, model, optimizer, t, data)
        if engine.metrics()["ckpt_mb"]:
            taken.append(t)
            if on_snapshot is not None:
                on_snapshot(engine.latest[0], before)
    return taken


def _exact(engine):
    def check(header, before):
        from moevement.storage.snapshot import read_entries

        for (role, name), value in read_entries(engine.latest[1], header).items():
            want = before[name] if role == "master" else before[name].to(value.dtype)
            assert torch.equal(value, want), (header.iteration, name)

    return check


def _algorithm_1(rank_dir, monkeypatch, **opts):
    """The tiny MoE under Algorithm 1, planned as if an iteration overlapped a microsecond: W = max_window."""
    model, optimizer, engine = tiny_engine(rank_dir, window=0, max_window=4, **opts)
    profile, update = engine.planner.profile, engine.planner.profile.update

    def tiny_budget() -> None:
        update()
        profile.iteration_s = 1e-6

    monkeypatch.setattr(profile, "update", tiny_budget)
    return model, optimizer, engine


def test_windows_of_algorithm_1_wait_for_buffers_grown_off_the_training_thread(tmp_path, monkeypatch):
    """Where Algorithm 1 chooses W, every buffer grows on the prefault thread: the first window (planned for
    iteration 3) waits, its iterations taking no snapshot, until its buffers are grown (here held back until
    iteration 5 is under way), and every snapshot after is the exact state. Without `prefault` they grow on
    the training thread at the window's start."""
    model, optimizer, engine = _algorithm_1(tmp_path / "on", monkeypatch)
    threads = _growth_threads(monkeypatch)  # from the start of training on
    gate, grow = threading.Event(), SnapshotBuffers._grow
    monkeypatch.setattr(SnapshotBuffers, "_grow", staticmethod(lambda held, sizes: gate.wait() and grow(held, sizes)))

    def open_at_5(t: int) -> None:
        if t == 5:
            gate.set()
            engine.buffers.prefaulter.submit(lambda: None).result()  # what was asked is done

    taken = _train(engine, model, optimizer, 12, _exact(engine), open_at_5)
    assert engine.current_window.plan.window_size == 4 and taken == list(range(6, 13)), taken
    assert threads and all(name.startswith("moevement-prefault") for name in threads), threads
    engine.close()

    model, optimizer, engine = _algorithm_1(tmp_path / "off", monkeypatch, prefault=False)
    threads.clear()
    assert _train(engine, model, optimizer, 6)[0] == 3
    assert threads and set(threads) == {threading.current_thread().name}
    engine.close()


def test_a_plan_known_before_training_is_reserved_at_start_up(tmp_path, monkeypatch):
    """A fixed W's buffers, both parities, are grown while the checkpointer is built, to the largest snapshot
    each slot takes in either operator order (predicted before the optimizer has any state): training grows
    none and starts its first window at once."""
    threads = _growth_threads(monkeypatch)
    model, optimizer, engine = tiny_engine(tmp_path / "rank0", window=3)
    built = len(threads)
    sizes = slot_bytes(engine.ops, operator_layout_bytes(engine.ops, optimizer, torch.float32), [3], "count")
    assert built == 2 * 3 + 1 and all(  # both parities' three slots, and the bandwidth probe
        buf.capacity == sizes[s] for (_, s), buf in engine.buffers.buffers.items()
    )
    largest = [0] * 3

    def note(header, _before) -> None:
        largest[header.slot] = max(largest[header.slot], header.nbytes)

    assert _train(engine, model, optimizer, 11, note) == list(range(3, 12))
    assert len(threads) == built, "no buffer grew once training started"
    assert all(0 < n <= most for n, most in zip(largest, sizes)), "the prediction bounds every snapshot"
    engine.close()


def test_a_later_generation_takes_back_the_mappings_its_predecessor_kept(tmp_path, monkeypatch):
    """A checkpointer abandoned for the next generation (a survivor of a peer's death) keeps its buffers'
    mappings in the process; the next checkpointer over the same directory maps nothing anew, and its buffers
    are the very same pages. Closing it drops them with the directory."""
    rank_dir = tmp_path / "rank0"
    model, optimizer, engine = tiny_engine(rank_dir, window=3, keep_host_state=False)
    _train(engine, model, optimizer, 5)
    pointers = {key: buf.data.data_ptr() for key, buf in engine.buffers.buffers.items()}
    engine.abandon()
    mapped = []
    map_fd = mappings.map_fd
    monkeypatch.setattr(host_memory, "map_fd", lambda fd, size: mapped.append(size) or map_fd(fd, size))
    later = tiny_engine(rank_dir, window=3, keep_host_state=False)[2]
    assert mapped == [] and {k: later.buffers.buffer(*k).data.data_ptr() for k in pointers} == pointers
    later.close()
    assert not rank_dir.exists() and KEPT.nbytes(rank_dir) == 0


def test_prefault_rank_dir_maps_the_ranks_own_buffers_once_and_nothing_else(tmp_path):
    """Own snapshot buffers and network replicas are mapped once (a second call maps nothing); a file with two
    names (a same-node replica link) or one not owner-only is never mapped; a file replaced since is mapped
    again; a buffer built afterwards holds the kept mapping; a symlinked directory is never followed (a rank directory
    that is one is refused)."""
    rank_dir = tmp_path / "rank0"
    local, replicas = make_private_dirs(rank_dir, "local"), make_private_dirs(rank_dir, "replicas", "from1")
    own, replica, linked = local / "w0-s0.bin", replicas / "w0-s0.bin", local / "w1-s0.bin"
    for path in (own, replica, linked):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 1 << 20)
        os.close(fd)
    os.link(linked, tmp_path / "peer-name.bin")
    foreign = local / "w1-s1.bin"
    fd = os.open(foreign, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 1 << 20)
    os.close(fd)
    try:
        assert prefault_rank_dir(rank_dir) == 2 << 20
        assert prefault_rank_dir(rank_dir) == 0
        own.unlink()
        fd = os.open(own, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 3 << 20)
        os.close(fd)
        assert prefault_rank_dir(rank_dir) == 3 << 20
        buffer = HostBuffer(own.with_suffix(""))
        assert buffer.capacity == 3 << 20 and not KEPT.valid(own)  # taken by the buffer, no longer kept
        buffer.release()
        elsewhere = make_private_dirs(tmp_path, "elsewhere")
        fd = os.open(elsewhere / "w0-s0.bin", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 1 << 20)
        os.close(fd)
        (rank_dir / "replicas" / "from2").symlink_to(elsewhere)
        prefault_rank_dir(rank_dir)
        assert not KEPT.valid(rank_dir / "replicas" / "from2" / "w0-s0.bin"), "a symlinked directory: never followed"
        (tmp_path / "linked-rank").symlink_to(rank_dir)
        with pytest.raises(HostMemoryError, match="linked-rank: is a symlink"):
            prefault_rank_dir(tmp_path / "linked-rank")
    finally:
        KEPT.drop_under(tmp_path)
    assert KEPT.nbytes(tmp_path) == 0


def _buffer_file(path, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, nbytes)
    os.close(fd)


def _until(condition, what: str, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        time.sleep(0.01)


def test_a_standby_keeps_its_rank_directory_mapped_while_it_waits(tmp_path):
    """A standby's watch maps a buffer file the trainer writes, maps it again once replaced, and releases the
    mapping of a removed file (which would keep its pages alive); stopped at the activation, it leaves the
    checkpointer's own `prefault_rank_dir` nothing to map."""
    rank_dir = tmp_path / "rank0"
    local = make_private_dirs(rank_dir, "local")
    own, other = local / "w0-s0.bin", local / "w0-s1.bin"
    watch = PrefaultWatch(rank_dir, "normal", every_s=0.01)
    try:
        _buffer_file(own, 1 << 20)
        _until(lambda: KEPT.nbytes(rank_dir) == 1 << 20, "a new buffer file mapped")
        own.unlink()
        _buffer_file(own, 3 << 20)
        _until(lambda: KEPT.nbytes(rank_dir) == 3 << 20, "a replaced buffer file mapped again, the old released")
        own.unlink()
        _until(lambda: KEPT.nbytes(rank_dir) == 0, "a removed buffer file's mapping released")
        _buffer_file(other, 2 << 20)
        _until(lambda: KEPT.nbytes(rank_dir) == 2 << 20, "a second buffer file mapped")
    finally:
        watch.stop()
    try:
        assert watch.mapped == 6 << 20 and watch.looks > 1
        assert prefault_rank_dir(rank_dir) == 0
    finally:
        KEPT.drop_under(tmp_path)
