"""What a recovery fetches: snapshots from replica peers, boundary logs from healthy neighbours, and
the scalar log from a survivor.

Every rank calls each function together. Exchanges run in one global order (failed rank, holder;
stage, neighbour, data-parallel rank), so blocking point-to-point calls cannot deadlock. Every
received snapshot is verified against its checksums, and a rejected copy makes the failed rank try
the next peer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.recovery.upstream_log import UpstreamLog
from moevement.storage.host_memory import HostBuffer, read_header
from moevement.storage.private_files import HostMemoryError, encode_json
from moevement.storage.sealed import SealError, seal, unseal
from moevement.storage.snapshot import SnapshotError, SnapshotHeader, verify_entries
from moevement.topology import Topology
from parallelisms import collectives


class RecoveryError(RuntimeError):
    """Recovery is impossible (e.g. no intact copy of a failed rank's checkpoint survives)."""


def fetch_from_replicas(ck: SparseCheckpointer, failed: set[int], window_size: int) -> dict[int, str]:
    """Failed ranks pull their persisted snapshots (`window_size` slots) from replica peers, then get back the
    replicas they held for others (re-protection, so a later failure of those peers is covered too).

    Returns {failed rank: where its snapshots came from}."""
    me, world = dist.get_rank(), dist.get_world_size()
    sources = {}
    intact = torch.tensor([int(me in failed and _local_copy_intact(ck, window_size))])
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    collectives.all_gather(flags, intact)
    for f in sorted(failed):
        holders = ck.replica_holders(f)
        done = bool(flags[f])
        if done and me == f:
            sources[f] = "local (restored earlier in this recovery)"
        for h in holders:
            if me == f:
                collectives.send(torch.tensor([0 if done else 1]), h)
                if not done and _receive(ck, h, window_size, ck.persisted.snapshot_buffer, f"replica on rank {h}"):
                    done, sources[f] = True, f"rank{h}"
            elif me == h:
                request = torch.zeros(1, dtype=torch.int64)
                collectives.recv(request, f)
                if int(request):
                    _send(ck, f, window_size, lambda slot, f=f: ck.persisted.replica_buffer(f, slot))
        if me == f and not done:
            raise RecoveryError(f"rank {f}: no intact replica of its persisted checkpoint on peers {holders}")
    if me in failed:
        ck.persisted.restored()
    _reprotect(ck, failed, window_size)
    return sources


def _reprotect(ck: SparseCheckpointer, failed: set[int], window_size: int) -> None:
    """Every rank holds its own snapshots again: the failed ranks get back the replicas they held for others."""
    me, world = dist.get_rank(), dist.get_world_size()
    for h in sorted(failed):
        for src in (s for s in range(world) if h in ck.replica_holders(s)):
            if me == src:
                _send(ck, h, window_size, ck.persisted.snapshot_buffer)
            elif me == h:
                _receive(
                    ck, src, window_size, lambda slot, src=src: ck.persisted.replica_buffer(src, slot), f"rank {src}"
                )


def _local_copy_intact(ck: SparseCheckpointer, window_size: int) -> bool:
    """Whether this rank's local buffers hold the whole persisted checkpoint with valid checksums."""
    for slot in range(window_size):
        buf = ck.persisted.snapshot_buffer(slot)
        try:
            header = read_header(buf.path)
            if header is None or header["window_start"] != ck.persisted.rollback_point():
                return False
            verify_entries(buf.data, SnapshotHeader.from_json(header), source=str(buf.path))
        except (SnapshotError, HostMemoryError):
            return False
    return True


def send_slot(dst: int, header: dict | None, data: torch.Tensor | None) -> None:
    """One snapshot slot to `dst`: sizes, JSON header, bytes; sizes (0, 0) when the sender has none."""
    if header is None:
        collectives.send(torch.tensor([0, 0]), dst)
        return
    raw = torch.frombuffer(bytearray(seal(encode_json(header))), dtype=torch.uint8)
    collectives.send(torch.tensor([raw.numel(), header["nbytes"]]), dst)
    collectives.send(raw, dst)
    if header["nbytes"]:
        collectives.send(data[: header["nbytes"]].contiguous(), dst)


def recv_slot(src: int, buffer_for: Callable[[int], torch.Tensor]) -> tuple[dict | None, torch.Tensor | None]:
    """The slot `send_slot` sends: (header, `buffer_for(nbytes)` holding its bytes), or (None, None)."""
    sizes = torch.zeros(2, dtype=torch.int64)
    collectives.recv(sizes, src)
    header_len, nbytes = sizes.tolist()
    if header_len == 0:
        return None, None
    raw = torch.empty(header_len, dtype=torch.uint8)
    collectives.recv(raw, src)
    data = buffer_for(nbytes)
    if nbytes:
        collectives.recv(data[:nbytes], src)
    return unseal(raw.numpy().tobytes(), f"the header from rank {src}"), data


def _send(ck: SparseCheckpointer, dst: int, window_size: int, buffer_of: Callable[[int], HostBuffer]) -> None:
    """Send the persisted checkpoint's slots held in `buffer_of(slot)` (none for a missing one)."""
    start = ck.persisted.rollback_point()
    for slot in range(window_size):
        buf = buffer_of(slot)
        header = read_header(buf.path)
        send_slot(dst, header if header is not None and header["window_start"] == start else None, buf.data)


def _receive(
    ck: SparseCheckpointer, src: int, window_size: int, buffer_of: Callable[[int], HostBuffer], source: str
) -> bool:
    """Receive all slots from `src` into `buffer_of(slot)`, verified; False if any is missing or corrupt."""
    ok = True
    for slot in range(window_size):
        buf = buffer_of(slot)

        def into(nbytes: int, buf: HostBuffer = buf) -> torch.Tensor:
            buf.invalidate()
            return buf.ensure(max(nbytes, 1))

        try:
            header, data = recv_slot(src, into)  # the whole slot is received before its header is checked
            if header is None:
                ok = False
                continue
            verify_entries(data, SnapshotHeader.from_json(header), source=source)
        except (SnapshotError, HostMemoryError, SealError) as e:
            print(f"recovery: rejected {e}; trying the next copy", flush=True)
            ok = False
            continue
        buf.commit(header)
    return ok


DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16]


def fetch_boundary_logs(
    log: UpstreamLog | None, layout: Topology, micro_batches: int, scope: set[int], t0: int, step: int
) -> dict:
    """Boundary tensors of iterations t0..step-1 that the stages in `scope` need, from the upstream logs
    of their healthy neighbours: {(kind, iteration, sending stage, micro-batch): tensor} on the receiver."""
    boundary = {}
    if log is None:
        return boundary
    me = dist.get_rank()
    for s in sorted(scope):
        for kind, nb in (("act", s - 1), ("grad", s + 1)):
            if not 0 <= nb < layout.n_stages or nb in scope:
                continue
            for d in range(layout.dp_size):
                sender = layout.rank_of(layout.owner_pp(nb), d)
                receiver = layout.rank_of(layout.owner_pp(s), d)
                wanted = [(kind, t, nb, m) for t in range(t0, step) for m in range(micro_batches)]
                if me == sender:
                    stacked = torch.stack([log.get(*key) for key in wanted])
                    collectives.send(torch.tensor([*stacked.shape, DTYPE_CODES.index(stacked.dtype)]), receiver)
                    collectives.send(stacked, receiver)
                elif me == receiver:
                    meta = torch.zeros(5, dtype=torch.int64)
                    collectives.recv(meta, sender)
                    stacked = torch.empty(meta[:4].tolist(), dtype=DTYPE_CODES[int(meta[4])])
                    collectives.recv(stacked, sender)
                    boundary.update(zip(wanted, stacked.unbind(0)))
    return boundary


def fetch_scalars(ck: SparseCheckpointer, failed: set[int], t0: int, step: int) -> dict[int, dict]:
    """The scalar log of t0..step-1, from the lowest-numbered surviving rank (kept again by every rank)."""
    source = min(r for r in range(dist.get_world_size()) if r not in failed)
    payload = [ck.persisted.scalars(t0, step) if dist.get_rank() == source else None]
    collectives.broadcast_object_list(payload, src=source)
    ck.persisted.restore_scalars(payload[0])  # a failed rank's log is back: it may serve the next recovery
    return payload[0]
