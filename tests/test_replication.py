"""Snapshot replication between ranks of one node (moevement.storage.replication), in real processes over gloo."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moevement.checkpoint.checkpointer import local_buffer
from moevement.storage.host_memory import HostBuffer
from moevement.storage.private_files import encode_json
from moevement.storage.replication import Outgoing, ReplicaStore, Replicator
from moevement.storage.sealed import seal

NBYTES = 4096


def _payload(rank: int) -> torch.Tensor:
    return (torch.arange(NBYTES, dtype=torch.int64) * (rank + 3) % 251).to(torch.uint8)


def _replicate_one_snapshot_then_drop_it(rank: int, root: str, init: str, slow_copier: int) -> None:
    """Both ranks send snapshot (window 0, slot 1) to each other through shared memory; it is not the
    last of its window, so no all-reduce follows. Rank `slow_copier` links late (an idle-priority
    thread on a busy node). Each rank then does what a failure and the end of a run do to its own
    buffer: scrub it (`SparseCheckpointer.wipe`) and remove its file, and checks the replica it holds
    of the other rank."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        base = Path(root)
        own = HostBuffer(local_buffer(base / f"rank{rank}", 0, 1))
        own.path.parent.mkdir(parents=True, exist_ok=True)
        own.ensure(NBYTES).copy_(_payload(rank))
        header = encode_json({"iteration": 4, "window_start": 3, "slot": 1, "nbytes": NBYTES, "rank": rank})
        own.commit(header)
        store = ReplicaStore(base / f"rank{rank}" / "replicas")
        replicator = Replicator(
            rank,
            [[1], [0]],
            store,
            dist.new_group(backend="gloo"),
            lambda window: None,
            frozenset({1 - rank}),
            lambda src, parity, slot: local_buffer(base / f"rank{src}", parity, slot),
            priority="normal",
        )
        if rank == slow_copier:
            where = replicator.local_buffer

            def late(*args):
                time.sleep(1.0)
                return where(*args)

            replicator.local_buffer = late
        replicator.submit(Outgoing(0, 1, False, header, own.data[:NBYTES]))
        replicator.close()  # every submitted snapshot is replicated: the sender's buffer is free
        own.scrub()
        own.release()
        own.path.with_suffix(".bin").unlink(missing_ok=True)
        replica = store.buffer(1 - rank, 0, 1)
        assert torch.equal(replica.data[:NBYTES], _payload(1 - rank))
        assert replica.header_path.read_bytes() == seal(  # the sender's commit record, byte for byte, sealed
            encode_json({"iteration": 4, "window_start": 3, "slot": 1, "nbytes": NBYTES, "rank": 1 - rank})
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("slow_copier", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_same_node_peer_links_before_the_sender_lets_go_of_its_buffer(tmp_path, slow_copier):
    """A sender's round ends only when its same-node peers hold the bytes, so `close` (or `drain`) may
    be followed at once by removing or wiping the buffer, even in a window that never completes
    (the last one of a run, an aborted one): the late linker gets the right bytes, no missing file."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_replicate_one_snapshot_then_drop_it, args=(str(tmp_path / "shm"), init, slow_copier), nprocs=2)


def _sender_and_replica(root: Path) -> tuple[HostBuffer, HostBuffer]:
    """A sender's committed-size buffer holding `_payload(0)` and a same-node replica linked to it."""
    own = HostBuffer(local_buffer(root / "rank0", 0, 1))
    own.path.parent.mkdir(parents=True, mode=0o700)
    own.ensure(NBYTES).copy_(_payload(0))
    (root / "rank1" / "replicas").mkdir(parents=True, mode=0o700)
    replica = ReplicaStore(root / "rank1" / "replicas").buffer(0, 0, 1)
    replica.link(own.path.with_suffix(".bin"))
    return own, replica


def test_a_linked_replica_outlives_the_senders_wipe_and_never_writes_into_its_file(tmp_path):
    """A same-node replica is the sender's file under a second name: no copy and no memory of its own;
    a failed sender's wipe drops only its own name (the replica keeps the bytes), and a replica that
    receives bytes over the network (`ensure`) writes a file of its own, never the sender's."""
    own, replica = _sender_and_replica(tmp_path)
    assert replica.capacity == 0 and torch.equal(replica.data[:NBYTES], _payload(0))
    own.scrub()
    assert own.data.numel() == 0 and not own.path.with_suffix(".bin").exists()
    assert torch.equal(replica.data[:NBYTES], _payload(0))

    own, replica = _sender_and_replica(tmp_path / "again")
    replica.ensure(NBYTES).fill_(7)
    assert torch.equal(own.data[:NBYTES], _payload(0))
    assert torch.equal(HostBuffer(own.path).ensure(NBYTES), _payload(0))  # the file, read afresh

    own, replica = _sender_and_replica(tmp_path / "holder")
    replica.scrub()  # a failed replica holder: the sender's own snapshot stays intact
    assert torch.equal(own.data[:NBYTES], _payload(0))


def test_a_wipe_zeroes_a_buffer_no_other_rank_names(tmp_path):
    own = HostBuffer(tmp_path / "w0-s0")
    own.ensure(NBYTES).copy_(_payload(0))
    own.scrub()
    assert own.path.with_suffix(".bin").exists() and not own.data.any()
