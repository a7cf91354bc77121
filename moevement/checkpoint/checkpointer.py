"""MoEvement sparse checkpointing inside the training loop (docs/design.md §2).

Per iteration t the loop calls `begin(t)` before the forward pass and `end(t, ...)` after the
optimizer step; an optimizer step pre-hook sits in between:

  begin(t)      state_t is current. At a window boundary, plan the window (`WindowPlanner`:
                popularity order, Algorithm 1). Start copying SS_t into host memory on the copy
                thread (CPU) or a side CUDA stream (GPU), overlapped with forward/backward.
  pre-hook      wait for the copy: SS_t is complete before the step mutates any of its tensors.
  end(t)        add the iteration's scalar log to SS_t's header, commit it, and hand it to the
                replicator. When every rank's window is replicated the checkpoint is persisted
                (`PersistedCheckpoint`), the previous one garbage-collected, and every Nth written
                to disk.

Buffers (`SnapshotBuffers`): two sets (window parity) of one buffer per slot, so at most one
persisted and one in-flight checkpoint exist. A window's copies wait until the previous window is
persisted before overwriting the buffers of the one before it.

Threads: the training thread runs `begin`, `end`, the pre-hook, planning and every recovery call;
the copy thread runs `_copy` (it reads only the persisted index, under `PersistedCheckpoint.cond`);
the replication thread runs `_on_window_replicated` (buffer invalidation under `SnapshotBuffers.lock`,
persistence under `PersistedCheckpoint.cond`); the disk thread writes the persisted windows it is
handed. Recovery calls `abort_window` first, which drains replication, so recovery then runs alone;
`adopt` (training thread, before training) commits and drains like `end` does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from moevement.checkpoint.persisted import MANIFEST, PersistedCheckpoint
from moevement.checkpoint.planner import SnapshotPolicy, WindowLayouts, WindowPlanner
from moevement.checkpoint.schedule import WindowPlan
from moevement.operators import Operator, Stacked, build_registry
from moevement.storage.cpu_cost import measure
from moevement.storage.host_memory import HostBuffer, make_private_dirs, read_header, remove_tree
from moevement.storage.persistence import DiskWriter
from moevement.storage.replication import Outgoing, ReplicaStore, start_replication
from moevement.storage.snapshot import (
    CommitRecord,
    EncodedHeader,
    SnapshotHeader,
    Throttle,
    copy_entries,
    with_checksums,
)
from moevement.storage.snapshot_buffers import SnapshotBuffers, local_buffer
from moevement.topology import Topology

__all__ = ["SnapshotPolicy", "SparseCheckpointer", "Topology", "local_buffer", "persisted_snapshots"]


@dataclass
class _Pending:
    window_index: int
    slot: int
    header: SnapshotHeader
    buffer: HostBuffer
    copy: Future


class SparseCheckpointer:
    """Takes, replicates and persists sparse snapshots; see the module docstring for the call order.

    `cfg`: a CheckpointConfig. `stacked`: the model's parameters that stack several operators' tensors
    (`moevement.operators.Stacked`, by parameter name). `rank_dirs(r)`: where rank r keeps its host
    state (same-node replicas link their files there). `group_timeout_s`: the replication group's bound
    on an operation without progress (a hung peer fails the replication). With a `SnapshotPolicy` (the
    interval baselines) a snapshot is a window of W = 1 taken at the policy's iterations: the FP32 state
    of the operators it selects, no compute weights.
    Recovery reads `persisted` and `replica_holders`, and calls `abort_window`, `wipe`, `paused` and
    `reset_popularity`; a restarted job calls `adopt` and, once it trains on, `drop_leftovers`.
    """

    def __init__(
        self,
        cfg,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        stacked: Mapping[str, Stacked] | None = None,
        compute_dtype: torch.dtype,
        device: torch.device,
        rank_dir: Path,
        topology: Topology,
        job_meta: dict | None = None,
        policy: SnapshotPolicy | None = None,
        disk_keep: int = 2,
        rank_dirs: Callable[[int], Path] | None = None,
        group_timeout_s: float | None = None,
    ):
        self.cfg, self.topology, self.job_meta = cfg, topology, dict(job_meta or {})
        self.group_timeout_s = group_timeout_s
        self.planner = WindowPlanner(
            cfg, build_registry(model, stacked), optimizer, compute_dtype, device, topology.world, policy
        )
        self.rank_dir = make_private_dirs(rank_dir.parent, rank_dir.name)
        self.buffers = SnapshotBuffers(self.rank_dir, device, cfg.background_priority)
        self.planner.profile.measure_bandwidth(self.rank_dir, device)
        self.replicas = ReplicaStore(rank_dir / "replicas")
        self.persisted = PersistedCheckpoint(self.rank_dir, topology.rank, self.buffers, self.replicas)
        self.disk = None
        if cfg.persist_dir:
            self.disk = DiskWriter(Path(cfg.persist_dir), topology.rank, disk_keep, cfg.background_priority)
        self.replicator = start_replication(
            topology,
            cfg.replicas,
            self.replicas,
            self._on_window_replicated,
            rank_dirs,
            cfg.background_priority,
            group_timeout_s,
        )
        self.plan: WindowPlan | None = None
        self.layouts: WindowLayouts | None = None  # the plan's snapshot layouts
        self.window_index = -1
        self.adopted = -1  # index of the window a restarted job kept (`adopt`; -1: none)
        self.pending: _Pending | None = None
        self.latest_buffer: HostBuffer | None = None  # the newest committed snapshot's
        self.stats = _LoopState()
        optimizer.register_step_pre_hook(self._before_optimizer_step)

    @property
    def ops(self) -> list[Operator]:
        return self.planner.ops

    @property
    def ops_by_name(self) -> dict[str, Operator]:
        return self.planner.ops_by_name

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.planner.optimizer

    # ---- the three calls of the training loop ----------------------------------------------------

    def begin(self, iteration: int) -> None:
        """Iteration `iteration` is about to run on state_iteration: start its snapshot, if any."""
        self.stats.begin()
        if self.stats.iterations <= self.cfg.profile_iters or not self.planner.due(iteration):
            return
        if self.plan is None or iteration >= self.plan.end:
            with measure("window"):
                self._start_window(iteration)
        with measure("checkpointer"):
            self._begin_snapshot(iteration)

    def _begin_snapshot(self, iteration: int) -> None:
        if not self.layouts.current(self.optimizer):
            self.layouts = self.planner.layouts(self.plan)
        slot = self.plan.slot_at(iteration)
        layout = self.layouts.slots[slot]
        header, sources = _snapshot_header(self.plan, iteration, self.topology.rank, layout, self.job_meta)
        buffer = self.buffers.buffer(self.window_index % 2, slot)
        copy = self.buffers.submit(self._copy, self.window_index, buffer, header, sources)
        self.pending = _Pending(self.window_index, slot, header, buffer, copy)
        self.stats.last["ckpt_mb"] = header.nbytes / 1e6

    def _before_optimizer_step(self, _optimizer, _args, _kwargs) -> None:
        if self.stats.paused:
            return
        self.planner.profile.record(self.stats.elapsed())
        if self.pending is not None:
            start = time.perf_counter()
            self.pending.copy.result()
            self.stats.last["stall_ms"] = (time.perf_counter() - start) * 1e3

    def end(
        self,
        iteration: int,
        scalars: dict[str, float],
        tokens: dict[str, torch.Tensor],
        gate_probs: dict[str, torch.Tensor],
    ) -> None:
        """Iteration `iteration` finished with these logged scalars and router statistics."""
        with measure("checkpointer"):
            self.planner.observe(tokens, gate_probs)
            self.persisted.log_scalars(iteration, scalars)
            pending, self.pending = self.pending, None
            if pending is None:
                return
            if self.planner.policy is not None:
                self.planner.policy.observe_stall(self.stats.last["stall_ms"] / 1e3)
            pending.header.meta["scalars"] = dict(scalars)
            commit = pending.copy.result().with_meta(pending.header.meta)
            self._commit(pending.window_index, commit, pending.buffer, pending.slot == self.plan.window - 1)
            self.latest_buffer = pending.buffer

    def snapshot_meta(self) -> dict | None:
        """The header metadata of the snapshot the current iteration takes (None: it takes none); a
        strategy may add to it between `begin` and `end`, which commits the header."""
        return self.pending.header.meta if self.pending is not None else None

    @property
    def latest(self) -> tuple[SnapshotHeader, torch.Tensor] | None:
        """The newest committed snapshot: its header as committed, and its bytes."""
        if self.latest_buffer is None:
            return None
        return SnapshotHeader.from_json(read_header(self.latest_buffer.path)), self.latest_buffer.data

    def metrics(self) -> dict[str, float]:
        """Per-iteration figures for the log and TensorBoard."""
        policy = self.planner.policy
        return {
            **self.stats.last,
            **({"interval": policy.interval} if policy else {}),
            "window": self.plan.window if self.plan else 0,
            "repl_lag": self.replicator.backlog if self.replicator else 0,
            "host_mb": (self.buffers.nbytes() + self.replicas.nbytes()) / 1e6,
        }

    # ---- recovery support (moevement.recovery, baselines.global_rollback) ------------------------

    def abort_window(self) -> None:
        """Recovery starts: finish replication, then drop the in-flight window on every rank.

        The newest persisted checkpoint stays; the next `begin` opens a new window."""
        if self.replicator is not None:
            self.replicator.drain()
        self.pending = None
        persisted = self.persisted.abort_in_flight()
        in_flight = (persisted + 1) % 2
        self.buffers.invalidate(in_flight)
        self.replicas.invalidate(in_flight)
        self.plan, self.window_index = None, persisted
        self.planner.forget_layouts()

    def wipe(self) -> None:
        """This rank failed: its snapshots and the replicas it holds for peers become unreadable to it (zeroed,
        or, for a file a same-node peer also names, unlinked: `HostBuffer.scrub`), and its record goes."""
        for buf in self._held():
            buf.invalidate()
            buf.scrub()
        self.persisted.forget()
        self.reset_popularity()

    def reset_popularity(self) -> None:
        """Forget the popularity history and return to registry order (applied at the next window)."""
        self.planner.reset_popularity()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Iterations replayed inside this block take no snapshot and are not profiled."""
        self.stats.paused = True
        try:
            yield
        finally:
            self.stats.paused = False

    def replica_holders(self, rank: int) -> list[int]:
        """The ranks holding replicas of `rank`'s snapshots, in fetch order."""
        return self.topology.replica_holders(rank, self.cfg.replicas)

    def flush_disk(self) -> None:
        """Every disk write that was going to land has landed."""
        if self.disk is not None:
            self.disk.close()

    def close(self) -> None:
        """Finish copies, replication and disk writes; drop host state unless asked to keep it."""
        if self.pending is not None:
            self.pending.copy.result()
        self.buffers.close()
        if self.replicator is not None:
            self.replicator.close()
        self.flush_disk()
        for buf in self._held():
            buf.release()
        if not self.cfg.keep_host_state:
            remove_tree(self.rank_dir, self.rank_dir.parent)

    def abandon(self) -> None:
        """This rank leaves its generation (a peer died; docs/design.md §4) and its next generation builds a
        new checkpointer over the same directory: the in-flight copy and disk writes finish, replication
        ends after the rounds already submitted, committed files stay. Errors met here are the dead peer's."""
        if self.pending is not None:
            self.pending.copy.exception()
        self.buffers.close()
        if self.replicator is not None:
            self.replicator.stop(self.group_timeout_s or 60.0)
        try:
            self.flush_disk()
        except (OSError, RuntimeError) as e:  # the new generation writes the next window again
            print(f"restart: rank {self.topology.rank}: an in-flight disk write was dropped ({e})", flush=True)
        for buf in self._held():
            buf.release()

    def adopt(self, window_index: int, snapshots: list[tuple[SnapshotHeader, dict]]) -> None:
        """A restarted job keeps the window it restarted from as its persisted checkpoint (collective): every
        rank writes its snapshots into its buffers as window `window_index` and replicates them like a window
        just taken; on return the window is persisted everywhere (it is not written to disk again)."""
        self.window_index = self.adopted = window_index
        for header, tensors in snapshots:
            buffer = self.buffers.buffer(window_index % 2, header.slot)
            buffer.invalidate()
            data = buffer.ensure(max(header.nbytes, 1))
            sums = copy_entries(data, header.entries, [tensors[(e.role, e.name)] for e in header.entries], Throttle())
            header.entries = with_checksums(header.entries, sums)
            self._commit(window_index, header.commit_record(), buffer, header.slot == len(snapshots) - 1)
        if self.replicator is not None:
            self.replicator.drain()

    def drop_leftovers(self) -> None:
        """Remove what earlier processes of this rank left and this process does not hold: commit
        records (a live state, snapshots, replicas) and temporary files. Called once training goes on.

        Their buffers' bytes (`.bin`) stay as spare pages: a buffer of the same name reuses them
        (`HostBuffer.ensure`), which spares a restarted process faulting in gigabytes of fresh memory;
        without a commit record nothing reads them, and `close` removes them with the directory."""
        held = {buf.header_path for buf in self._held()}
        if self.persisted.index >= 0:
            held.add(self.rank_dir / MANIFEST)
        for directory, _, files in os.walk(self.rank_dir):
            for name in files:
                path = Path(directory, name)
                if path not in held and path.suffix != ".bin":
                    path.unlink(missing_ok=True)

    # ---- windows, copies, persistence -----------------------------------------------------------

    def _start_window(self, iteration: int) -> None:
        """Plan window [iteration, iteration + W), lay out its snapshots and size its buffers (same W on every rank)."""
        follows = self.plan is not None
        self.window_index += 1
        self.plan = self.planner.plan(iteration, self.window_index, follows, self.rank_dir)
        self.layouts = self.planner.layouts(self.plan)
        # Buffers grow on the training thread at the window boundary: grown by the copy thread, their
        # pages would fault in at idle priority while the copy is due, and the step would stall.
        self.buffers.reserve(self.window_index % 2, [max(nbytes, 1) for _, _, nbytes in self.layouts.slots])

    def _copy(self, window_index: int, buffer: HostBuffer, header: SnapshotHeader, sources) -> EncodedHeader:
        """Copy thread: wait until the buffer's old window is garbage, copy SS_t into it, and encode its
        header but for the iteration's `meta` (which `end` adds)."""
        check = self.replicator.raise_if_failed if self.replicator is not None else (lambda: None)
        self.persisted.wait_until_persisted(window_index - 1, check)
        if self.disk is not None:
            self.disk.wait(window_index % 2)
        return self.buffers.copy(buffer, header, sources, self.planner.profile.throttle())

    def _commit(self, window_index: int, commit: CommitRecord, buffer: HostBuffer, last: bool) -> None:
        """A snapshot's bytes are complete in `buffer`: record it (the local commit record and the replicas'
        are the same bytes) and hand it to the replicator."""
        buffer.commit(commit.encoded)
        self.persisted.committed(window_index, commit)
        if self.replicator is not None:
            payload = buffer.data[: commit.nbytes]
            self.replicator.submit(Outgoing(window_index, commit.slot, last, commit.encoded, payload))
        elif last:
            self._on_window_replicated(window_index)

    def _on_window_replicated(self, window_index: int) -> None:
        """Window `window_index` is complete on every rank and its replicas: it is persisted."""
        due = window_index % self.cfg.persist_every == 0 and window_index != self.adopted
        self.persisted.window_replicated(window_index, self.disk if due else None)

    def _held(self) -> list[HostBuffer]:
        return [*self.buffers.all(), *self.replicas.buffers.values()]


class _LoopState:
    """Training-thread bookkeeping: iterations seen, the current one's start time and checkpointing
    figures (`ckpt_mb`, `stall_ms`), and whether a recovery is replaying (no snapshots, no profile)."""

    def __init__(self) -> None:
        self.iterations, self.started, self.paused = 0, 0.0, False
        self.last = {"ckpt_mb": 0.0, "stall_ms": 0.0}

    def begin(self) -> None:
        self.iterations += 1
        self.started = time.perf_counter()
        self.last = {"ckpt_mb": 0.0, "stall_ms": 0.0}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


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


def _snapshot_header(plan: WindowPlan, iteration: int, rank: int, entry_layout, job_meta: dict):
    """(header, source tensors) of SS_iteration; `entry_layout`: (entries, sources, bytes) of its slot."""
    entries, sources, nbytes = entry_layout
    slot = plan.slot_at(iteration)
    active, frozen = list(plan.slots[slot]), list(plan.frozen_after(slot))
    meta = {**job_meta, "data_position": iteration}
    return SnapshotHeader(
        iteration, plan.start, slot, plan.window, rank, active, frozen, entries, nbytes, meta
    ), sources
