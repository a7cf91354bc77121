"""MoEvement sparse checkpointing inside the training loop (DESIGN.md §2).

Per iteration t the loop calls `begin(t)` before the forward pass and `end(t, ...)` after the
optimizer step; an optimizer step pre-hook sits in between:

  begin(t)      state_t is current. At a window boundary, plan the window (popularity order,
                Algorithm 1). Start copying SS_t into host memory on the copy thread (CPU) or a
                side CUDA stream (GPU), overlapped with forward/backward.
  pre-hook      wait for the copy: SS_t is complete before the step mutates any of its tensors.
  end(t)        add the iteration's scalar log to SS_t's header, commit it, and hand it to the
                replicator. When every rank's window is replicated the checkpoint is persisted,
                the previous one garbage-collected, and every Nth written to disk.

Buffers: two sets (window parity) of one buffer per slot, grown (at window boundaries) when needed,
so at most one persisted and one in-flight checkpoint exist. A window's copies wait until the
previous window is persisted before overwriting the buffers of the one before it.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from moevement.checkpoint.popularity import PopularityTracker
from moevement.checkpoint.profiler import Profile
from moevement.checkpoint.schedule import (
    WindowPlan,
    byte_slots,
    byte_window_size,
    find_window_size,
    generate_schedule,
    order_operators,
    slot_size_for,
)
from moevement.operators import Operator, build_registry
from moevement.storage.background import enter_background
from moevement.storage.host_memory import (
    HostBuffer,
    HostMemoryError,
    encode_json,
    make_private_dir,
    make_private_dirs,
    read_header,
    write_json_atomic,
)
from moevement.storage.persistence import DiskWriter
from moevement.storage.replication import Outgoing, ReplicaStore, Replicator, peer_map
from moevement.storage.snapshot import SnapshotHeader, copy_entries, layout


class SnapshotPolicy(Protocol):
    """When an interval strategy snapshots, and what (implemented by `baselines.intervals.IntervalPolicy`)."""

    interval: int

    def due(self, iteration: int) -> bool: ...
    def select(self) -> list[str]: ...
    def choose(self, snapshot_bytes: float, bandwidth: float, overlap_s: float) -> int: ...
    def scheduled(self, iteration: int, interval: int) -> None: ...
    def observe_stall(self, seconds: float) -> None: ...


@dataclass
class Topology:
    """Where this rank sits: what replica placement needs to know about every rank."""

    rank: int
    world: int
    stage_of: list[int]  # pipeline stage (pp rank) of every rank
    node_of: list[int]  # node index of every rank

    @classmethod
    def single(cls) -> Topology:
        return cls(0, 1, [0], [0])


@dataclass
class _Pending:
    window_index: int
    slot: int
    header: SnapshotHeader
    buffer: HostBuffer
    copy: Future


class SparseCheckpointer:
    """Takes, replicates and persists sparse snapshots; see the module docstring for the call order.

    `cfg` provides: window, slots, ordering, ema_decay, replicas, bandwidth_gbps, persist_dir,
    persist_every, profile_iters, reprofile_every, keep_host_state, background_priority.
    `rank_dirs(r)` is where rank r keeps its host state: replicas of ranks on this node are then
    copied from their shared memory.

    With a `SnapshotPolicy` (the gemini, checkfreq and moc baselines) a snapshot is taken only at
    the policy's checkpoint iterations, as a window of W = 1 holding the FP32 state of the
    operators the policy selects (all of them, or MoC's partial set), and no compute weights.
    """

    def __init__(
        self,
        cfg,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        compute_dtype: torch.dtype,
        device: torch.device,
        rank_dir: Path,
        topology: Topology,
        job_meta: dict | None = None,
        policy: SnapshotPolicy | None = None,
        disk_keep: int = 2,
        rank_dirs: Callable[[int], Path] | None = None,
    ):
        self.cfg, self.optimizer, self.compute_dtype, self.device = cfg, optimizer, compute_dtype, device
        self.policy = policy
        self.topology, self.job_meta = topology, dict(job_meta or {})
        self.ops: list[Operator] = build_registry(model)
        self.ops_by_name = {op.name: op for op in self.ops}
        self.registry_order = [op.name for op in self.ops]
        self.order = list(self.registry_order)
        self.tracker = PopularityTracker(cfg.ordering, cfg.ema_decay)
        self.rank_dir = make_private_dirs(rank_dir.parent, rank_dir.name)
        self.local_dir = make_private_dir(rank_dir / "local")
        self.profile = Profile(cfg.bandwidth_gbps)
        self.profile.measure_bandwidth(self.rank_dir, device)
        self.buffers: dict[tuple[int, int], HostBuffer] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copier = ThreadPoolExecutor(
            1, thread_name_prefix="moevement-copy", initializer=enter_background, initargs=(cfg.background_priority,)
        )
        self.plan: WindowPlan | None = None
        self.window_index = -1
        self.iterations_seen = 0
        self.pending: _Pending | None = None
        self.latest: tuple[SnapshotHeader, torch.Tensor] | None = None  # newest committed snapshot, its bytes
        self.persisted = -1  # index of the newest persisted window
        self.persisted_window: tuple[int, int] | None = None  # its (first iteration, W)
        self.scalar_log: dict[int, dict] = {}  # iteration -> logged scalars, kept from rollback_point()
        self.replaying = False
        self.persisted_cond = threading.Condition()
        self.window_headers: dict[int, list[dict]] = {}
        self.disk = (
            DiskWriter(Path(cfg.persist_dir), topology.rank, disk_keep, cfg.background_priority)
            if cfg.persist_dir
            else None
        )
        self.replicas = ReplicaStore(rank_dir / "replicas")
        self.replicator = None
        # peers[r]: the ranks holding rank r's replicas (recovery fetches from them)
        self.peers = (
            peer_map(topology.world, cfg.replicas, topology.stage_of, topology.node_of) if topology.world > 1 else [[]]
        )
        if topology.world > 1 and cfg.replicas > 0:
            group = dist.new_group(backend="gloo")
            node = topology.node_of[topology.rank]
            same_node = (
                frozenset(r for r, n in enumerate(topology.node_of) if n == node and r != topology.rank)
                if rank_dirs is not None
                else frozenset()
            )
            self.replicator = Replicator(
                topology.rank,
                self.peers,
                self.replicas,
                group,
                self._on_window_replicated,
                same_node,
                lambda src, parity, slot: local_buffer(rank_dirs(src), parity, slot),
                cfg.background_priority,
            )
        self._begin_time = 0.0
        self.last = {"ckpt_mb": 0.0, "stall_ms": 0.0}
        optimizer.register_step_pre_hook(self._before_optimizer_step)

    # ---- the three calls of the training loop ----------------------------------------------------

    def begin(self, iteration: int) -> None:
        """Iteration `iteration` is about to run on state_iteration: start its snapshot, if any."""
        self._begin_time = time.perf_counter()
        self.iterations_seen += 1
        self.last = {"ckpt_mb": 0.0, "stall_ms": 0.0}
        if self.iterations_seen <= self.cfg.profile_iters:
            return
        if self.policy is not None and not self.policy.due(iteration):
            return
        if self.plan is None or iteration >= self.plan.end:
            self._start_window(iteration)
        slot = self.plan.slot_at(iteration)
        active, frozen = self._slot_operators(slot)
        entries, sources, nbytes = layout(active, frozen, self.optimizer, self.compute_dtype)
        header = SnapshotHeader(
            iteration,
            self.plan.start,
            slot,
            self.plan.window,
            self.topology.rank,
            [op.name for op in active],
            [op.name for op in frozen],
            entries,
            nbytes,
            {**self.job_meta, "data_position": iteration},
        )
        buffer = self._buffer(self.window_index % 2, slot)
        copy = self.copier.submit(self._copy, self.window_index, buffer, header, sources)
        self.pending = _Pending(self.window_index, slot, header, buffer, copy)
        self.last["ckpt_mb"] = nbytes / 1e6

    def _before_optimizer_step(self, _optimizer, _args, _kwargs) -> None:
        if self.replaying:
            return
        self.profile.record(time.perf_counter() - self._begin_time)
        if self.pending is not None:
            start = time.perf_counter()
            self.pending.copy.result()
            self.last["stall_ms"] = (time.perf_counter() - start) * 1e3

    def end(
        self,
        iteration: int,
        scalars: dict[str, float],
        tokens: dict[str, torch.Tensor],
        gate_probs: dict[str, torch.Tensor],
    ) -> None:
        """Iteration `iteration` finished with these logged scalars and router statistics."""
        self.tracker.observe(tokens, gate_probs)
        self.scalar_log[iteration] = dict(scalars)
        for old in [t for t in self.scalar_log if t < self.rollback_point()]:
            del self.scalar_log[old]
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if self.policy is not None:
            self.policy.observe_stall(self.last["stall_ms"] / 1e3)
        pending.copy.result()
        pending.header.meta["scalars"] = dict(scalars)
        header = pending.header.to_json()
        encoded = encode_json(header)  # once: the local commit record and the replicas' are the same bytes
        pending.buffer.commit(encoded)
        self.window_headers.setdefault(pending.window_index, []).append(header)
        self.latest = (pending.header, pending.buffer.data)
        last = pending.slot == self.plan.window - 1
        if self.replicator is not None:
            self.replicator.submit(
                Outgoing(pending.window_index, pending.slot, last, encoded, pending.buffer.data[: header["nbytes"]])
            )
        elif last:
            self._on_window_replicated(pending.window_index)

    def metrics(self) -> dict[str, float]:
        """Per-iteration figures for the log and TensorBoard."""
        interval = {"interval": self.policy.interval} if self.policy else {}
        return {
            **self.last,
            **interval,
            "window": self.plan.window if self.plan else 0,
            "repl_lag": self.replicator.backlog if self.replicator else 0,
            "host_mb": self.host_bytes() / 1e6,
        }

    def host_bytes(self) -> int:
        return sum(b.capacity for b in self.buffers.values()) + self.replicas.nbytes()

    def rollback_point(self) -> int:
        """First iteration of the newest persisted checkpoint (1: none yet, roll back to the initial state)."""
        return self.persisted_window[0] if self.persisted_window else 1

    # ---- recovery support (moevement.recovery.localized) ----------------------------------------------------

    def abort_window(self) -> None:
        """Recovery starts: finish replication, then drop the in-flight window on every rank.

        The newest persisted checkpoint stays; the next `begin` opens a new window."""
        if self.replicator is not None:
            self.replicator.drain()
        self.pending = None
        for index in [i for i in self.window_headers if i > self.persisted]:
            del self.window_headers[index]
        in_flight = (self.persisted + 1) % 2
        for (parity, _), buf in self.buffers.items():
            if parity == in_flight:
                buf.invalidate()
        self.replicas.invalidate(in_flight)
        self.plan, self.window_index = None, self.persisted

    def wipe(self) -> None:
        """This rank failed: overwrite and drop its snapshots, replicas held for peers, and logs."""
        for buf in [*self.buffers.values(), *self.replicas.buffers.values()]:
            buf.invalidate()
            buf.data.zero_()
        (self.rank_dir / "persisted.json").unlink(missing_ok=True)
        self.scalar_log.clear()
        self.reset_popularity()

    def reset_popularity(self) -> None:
        """Forget the popularity history and return to registry order (applied at the next window)."""
        self.tracker = PopularityTracker(self.cfg.ordering, self.cfg.ema_decay)
        self.order = list(self.registry_order)

    def persisted_buffer(self, slot: int) -> HostBuffer:
        """Local buffer of slot `slot` of the newest persisted checkpoint."""
        return self._buffer(self.persisted % 2, slot)

    def replica_buffer(self, src: int, slot: int) -> HostBuffer:
        """Buffer of the replica of rank `src`'s slot `slot` of the newest persisted checkpoint."""
        return self.replicas.buffer(src, self.persisted % 2, slot)

    def restored(self) -> None:
        """Every slot of the persisted checkpoint is back in the local buffers: record it again."""
        start, window = self.persisted_window
        self._write_manifest(self.persisted, start, window)

    def close(self) -> None:
        """Finish copies, replication and disk writes; drop host state unless asked to keep it."""
        if self.pending is not None:
            self.pending.copy.result()
        self.copier.shutdown()
        if self.replicator is not None:
            self.replicator.close()
        if self.disk is not None:
            self.disk.close()
        for buf in [*self.buffers.values(), *self.replicas.buffers.values()]:
            buf.release()
        if not self.cfg.keep_host_state:
            shutil.rmtree(self.rank_dir, ignore_errors=True)

    # ---- planning ----------------------------------------------------------------------------------

    def _start_window(self, iteration: int) -> None:
        """Plan window [iteration, iteration + W): order, Algorithm 1, slots (same W on every rank)."""
        reordered = self.tracker.end_window()
        if reordered:
            self.order = order_operators(
                self.registry_order, [op.kind == "expert" for op in self.ops], self.tracker.popularity()
            )
        self.profile.update()
        every = self.cfg.reprofile_every
        if self.plan is not None and every and (self.window_index + 1) % every == 0:
            self.profile.measure_bandwidth(self.rank_dir, self.device)
        if self.policy is not None:
            slots = self._interval_checkpoint(iteration)
        else:
            slots = self._sparse_slots()
        self.plan = WindowPlan(iteration, slots)
        self.window_index += 1
        self._reserve_buffers()

    def _sparse_slots(self) -> tuple[tuple[str, ...], ...]:
        """Algorithm 1 on this rank's operators in schedule order; W agreed across ranks (or forced)."""
        fp32 = [self.ops_by_name[n].fp32_bytes(self.optimizer) for n in self.order]
        compute = [self.ops_by_name[n].compute_bytes(self.compute_dtype) for n in self.order]
        t, bandwidth = self.profile.iteration_s, self.profile.bandwidth
        if self.cfg.slots == "bytes":
            window = self.cfg.window or self._agree(byte_window_size(fp32, compute, t, bandwidth))
            return byte_slots(self.order, fp32, compute, window)
        window = self.cfg.window or self._agree(find_window_size(fp32, compute, t, bandwidth)[0])
        return generate_schedule(self.order, slot_size_for(len(self.order), window), window)

    def _interval_checkpoint(self, iteration: int) -> tuple[tuple[str, ...]]:
        """An interval baseline's checkpoint at `iteration`: its operators, and when the next one is due."""
        names = tuple(self.policy.select())
        nbytes = sum(self.ops_by_name[n].fp32_bytes(self.optimizer) for n in names)
        interval = self._agree(self.policy.choose(nbytes, self.profile.bandwidth, self.profile.iteration_s))
        self.policy.scheduled(iteration, interval)
        return (names,)

    def _agree(self, window: int) -> int:
        """The largest window (or interval) any rank needs: checkpoints are global so they replicate in lockstep."""
        if self.topology.world == 1:
            return window
        agreed = torch.tensor([window], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return int(agreed)

    # ---- buffers, copying, persistence ----------------------------------------------------------------

    def _buffer(self, parity: int, slot: int) -> HostBuffer:
        key = (parity, slot)
        if key not in self.buffers:
            self.buffers[key] = HostBuffer(local_buffer(self.rank_dir, parity, slot), pin=self.device.type == "cuda")
        return self.buffers[key]

    def _slot_operators(self, slot: int) -> tuple[list[Operator], list[Operator]]:
        """(operators whose FP32 state SS_{start+slot} holds, operators whose compute weights it holds)."""
        return (
            [self.ops_by_name[n] for n in self.plan.slots[slot]],
            [self.ops_by_name[n] for n in self.plan.frozen_after(slot)],
        )

    def _reserve_buffers(self) -> None:
        """Allocate (and fault in) both buffer sets for this window's snapshot sizes, on the training
        thread at the window boundary: a buffer grown by the copy thread faults its pages in at idle
        priority while the copy is due, and the step stalls (a window grows when the profile
        re-plans it). Buffers only grow, so this allocates nothing once the largest window has run."""
        sizes = [
            max(layout(*self._slot_operators(slot), self.optimizer, self.compute_dtype)[2], 1)
            for slot in range(self.plan.window)
        ]
        grow = sum(
            max(0, nbytes - self._buffer(parity, slot).capacity)
            for slot, nbytes in enumerate(sizes)
            for parity in (0, 1)
        )
        free = shutil.disk_usage(self.local_dir).free
        if grow > free:
            raise HostMemoryError(
                f"a window of W={self.plan.window} snapshots needs {grow / 1e9:.2f} GB more host memory in "
                f"{self.local_dir} ({free / 1e9:.2f} GB free): set checkpoint.window lower, raise "
                f"checkpoint.bandwidth_gbps, or train with training.mixed_precision bf16 (smaller compute weights)"
            )
        for slot, nbytes in enumerate(sizes):
            for parity in (0, 1):
                self._buffer(parity, slot).ensure(nbytes)

    def _copy(self, window_index: int, buffer: HostBuffer, header: SnapshotHeader, sources) -> None:
        """Copy thread: wait until the buffer's old window is garbage, then copy SS_t into it."""
        with self.persisted_cond:
            while self.persisted < window_index - 1:
                if self.replicator is not None:
                    self.replicator.raise_if_failed()
                self.persisted_cond.wait(timeout=1.0)
        if self.disk is not None:
            self.disk.wait(window_index % 2)
        buffer.invalidate()
        data = buffer.ensure(max(header.nbytes, 1))
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                copy_entries(data, header.entries, sources, self.profile.throttle(), self.stream)
        else:
            copy_entries(data, header.entries, sources, self.profile.throttle())

    def _on_window_replicated(self, window_index: int) -> None:
        """Window `window_index` is complete on every rank and its replicas: it is persisted."""
        headers = self.window_headers.pop(window_index)
        self.window_headers.pop(window_index - 1, None)
        for (parity, _), buf in list(self.buffers.items()):
            if parity != window_index % 2:
                buf.invalidate()
        self.replicas.invalidate(1 - window_index % 2)
        self._write_manifest(window_index, headers[0]["window_start"], len(headers))
        if self.disk is not None and window_index % self.cfg.persist_every == 0:
            parity = window_index % 2
            self.disk.submit(parity, [(h, self._buffer(parity, h["slot"]).data) for h in headers])
        with self.persisted_cond:
            self.persisted = window_index
            self.persisted_window = (headers[0]["window_start"], len(headers))
            self.persisted_cond.notify_all()

    def _write_manifest(self, window_index: int, start: int, window: int) -> None:
        write_json_atomic(
            self.rank_dir / "persisted.json",
            {
                "window_index": window_index,
                "window_start": start,
                "window": window,
                "rank": self.topology.rank,
                "snapshots": [str(local_buffer(Path(), window_index % 2, slot)) for slot in range(window)],
            },
        )


def local_buffer(rank_dir: Path, parity: int, slot: int) -> Path:
    """Path (no suffix) of a rank's own snapshot buffer for window parity `parity`, slot `slot`."""
    return rank_dir / "local" / f"w{parity}-s{slot}"


def persisted_snapshots(rank_dir: Path) -> list[tuple[dict, Path]]:
    """(header, buffer path) of the persisted checkpoint recorded under a rank directory, in slot order."""
    manifest = read_header(rank_dir / "persisted")
    if manifest is None:
        return []
    out = []
    for rel in manifest["snapshots"]:
        header = read_header(rank_dir / rel)
        if header is None or header["window_start"] != manifest["window_start"]:
            raise FileNotFoundError(f"{rank_dir / rel}: snapshot of the persisted checkpoint is missing")
        out.append((header, rank_dir / rel))
    return out
