"""Snapshot replication between ranks of one node (moevement.storage.replication), in real processes over gloo."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moevement.checkpoint.checkpointer import local_buffer
from moevement.storage.host_memory import HostBuffer, encode_json
from moevement.storage.replication import Outgoing, ReplicaStore, Replicator
from moevement.storage.sealed import seal

NBYTES = 4096


def _payload(rank: int) -> torch.Tensor:
    return (torch.arange(NBYTES, dtype=torch.int64) * (rank + 3) % 251).to(torch.uint8)


def _replicate_one_snapshot_then_drop_it(rank: int, root: str, init: str, slow_copier: int) -> None:
    """Both ranks send snapshot (window 0, slot 1) to each other through shared memory; it is not the
    last of its window, so no all-reduce follows. Rank `slow_copier` copies late (an idle-priority
    thread on a busy node). Each rank then does what the end of a run (or a failure) does to its own
    buffer: overwrite it and remove its file, and checks the replica it holds of the other rank."""
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
            shared_bytes = replicator._shared_bytes

            def late(*args):
                time.sleep(1.0)
                return shared_bytes(*args)

            replicator._shared_bytes = late
        replicator.submit(Outgoing(0, 1, False, header, own.data[:NBYTES]))
        replicator.close()  # every submitted snapshot is replicated: the sender's buffer is free
        own.data.zero_()
        own.release()
        own.path.with_suffix(".bin").unlink()
        replica = store.buffer(1 - rank, 0, 1)
        assert torch.equal(replica.data[:NBYTES], _payload(1 - rank))
        assert replica.header_path.read_bytes() == seal(  # the sender's commit record, byte for byte, sealed
            encode_json({"iteration": 4, "window_start": 3, "slot": 1, "nbytes": NBYTES, "rank": 1 - rank})
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("slow_copier", [0, 1])
def test_a_same_node_peer_copies_before_the_sender_lets_go_of_its_buffer(tmp_path, slow_copier):
    """A sender's round ends only when its same-node peers hold the bytes, so `close` (or `drain`) may
    be followed at once by removing or wiping the buffer, even in a window that never completes
    (the last one of a run, an aborted one): the late copier gets the right bytes, no missing file."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_replicate_one_snapshot_then_drop_it, args=(str(tmp_path / "shm"), init, slow_copier), nprocs=2)
