"""MoEvement sparse checkpointing inside the training loop (docs/design/state-and-snapshots.md).

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

With `checkpoint.overlap = iteration` (the default) the copy of SS_{t+1} starts at the end of `end(t)`
instead of in `begin(t+1)` (`IterationSnapshots`): state_{t+1} is complete once the step of t is done.

Buffers (`SnapshotBuffers`): two sets (window parity) of one buffer per slot, so at most one
persisted and one in-flight checkpoint exist. A window's copies wait until the previous window is
persisted before overwriting the buffers of the one before it.

The parts: `IterationSnapshots` (iteration_snapshots.py) starts each iteration's snapshot and times
it; `CurrentWindow` (window.py) plans and lays out the open window and has its buffers grown off the
training thread; `SnapshotInFlight` (in_flight.py) copies the running iteration's snapshot and commits
it; `SnapshotHandoff` (handoff.py) takes a committed snapshot through replication, persistence and the
disk; restarted.py holds what a restarted rank does with the state it finds (`adopt`, `drop_leftovers`).

Threads: the training thread runs `begin`, `end`, the pre-hook, planning and every recovery call;
the prefault thread grows buffers (`SnapshotBuffers.reserve_ahead`); the copy thread runs
`SnapshotInFlight._copy` (it reads only the persisted index, under `PersistedCheckpoint.cond`); the
replication thread runs `SnapshotHandoff._on_window_replicated` (buffer invalidation under
`SnapshotBuffers.lock`, persistence under `PersistedCheckpoint.cond`); the disk thread writes the
persisted windows it is handed. Recovery calls `abort_window` first, which drains replication, so
recovery then runs alone; `adopt` (training thread, before training) commits and drains like `end` does.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from moevement.checkpoint.binding import CheckpointedModel, CheckpointerPlace
from moevement.checkpoint.handoff import SnapshotHandoff
from moevement.checkpoint.in_flight import SnapshotInFlight
from moevement.checkpoint.iteration_snapshots import IterationSnapshots
from moevement.checkpoint.options import SparseOptions
from moevement.checkpoint.persisted import PersistedCheckpoint
from moevement.checkpoint.planner import SnapshotPolicy, WindowPlanner
from moevement.checkpoint.restarted import adopt_window, drop_leftovers
from moevement.checkpoint.window import CurrentWindow
from moevement.operators import Operator, build_registry
from moevement.storage.cpu_cost import measure
from moevement.storage.host_memory import HostBuffer, read_header, remove_tree
from moevement.storage.mappings import KEPT
from moevement.storage.private_files import make_private_dirs
from moevement.storage.replication import ReplicaStore
from moevement.storage.snapshot import SnapshotHeader
from moevement.storage.snapshot_buffers import SnapshotBuffers, local_buffer
from moevement.topology import Topology

__all__ = ["SnapshotPolicy", "SparseCheckpointer", "Topology", "local_buffer", "persisted_snapshots"]


class SparseCheckpointer:
    """Takes, replicates and persists sparse snapshots; see the module docstring for the call order.

    `cfg`: the configuration's sparse checkpointing keys; `state`: what the snapshots hold; `place`: the rank's
    place in the job (its host directory, the topology, the replication group's reach and bound).
    With a `SnapshotPolicy` (the interval baselines) a snapshot is a window of W = 1 taken at the
    policy's iterations: the FP32 state of the operators it selects, no compute weights; `disk_keep`: how many
    windows persisted to disk are kept.
    Recovery reads `persisted` and `replica_holders`, and calls `abort_window`, `wipe`, `paused` and
    `reset_popularity`; a restarted job calls `adopt` and, once it trains on, `drop_leftovers`.
    """

    def __init__(
        self,
        cfg: SparseOptions,
        state: CheckpointedModel,
        place: CheckpointerPlace,
        *,
        policy: SnapshotPolicy | None = None,
        disk_keep: int = 2,
    ):
        topology, rank_dir = place.topology, place.rank_dir
        self.cfg, self.topology = cfg, topology
        self.job_meta = copy.deepcopy(dict(place.job_meta or {}))  # never changed
        self.planner = WindowPlanner(
            cfg,
            build_registry(state.model, state.stacked),
            state.optimizer,
            state.compute_dtype,
            state.device,
            topology.world,
            policy,
        )
        self.rank_dir = make_private_dirs(rank_dir.parent, rank_dir.name)
        self.buffers = SnapshotBuffers(
            self.rank_dir, state.device, cfg.background_priority, graphed=cfg.copy_graph, chunk_bytes=cfg.chunk_bytes
        )
        self.replicas = ReplicaStore(rank_dir / "replicas")
        self.persisted = PersistedCheckpoint(self.rank_dir, topology.rank, self.buffers, self.replicas)
        self.handoff = SnapshotHandoff(
            cfg, topology, self.persisted, self.replicas, place.rank_dirs, place.group_timeout_s, disk_keep
        )
        self.current_window = CurrentWindow(
            self.planner, self.buffers, self.rank_dir, topology.rank, self.job_meta, prefault=cfg.prefault
        )
        profile = self.planner.profile
        self.in_flight = SnapshotInFlight(
            self.buffers, self.handoff, profile.throttle, self.job_meta, profile.record_copy
        )
        self.stats = IterationSnapshots(cfg, self.planner, self.current_window, self.in_flight)
        if cfg.prefault:
            self.current_window.reserve_at_start_up()
        state.optimizer.register_step_pre_hook(lambda _optimizer, _args, _kwargs: self.stats.before_step())

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
        """Iteration `iteration` is about to run on state_iteration: start its snapshot, if any (unless `end` of
        the iteration before started it already)."""
        self.stats.begin(iteration)

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
            if self.in_flight.pending is not None:
                if self.planner.policy is not None:
                    self.planner.policy.observe_stall(self.stats.last["stall_ms"] / 1e3)
                self.in_flight.commit(scalars)
        self.stats.after_end(iteration)

    def snapshot_meta(self) -> dict | None:
        """The header metadata of the snapshot the current iteration takes (None: it takes none); a
        strategy may add to it between `begin` and `end`, which commits the header."""
        return self.in_flight.meta

    @property
    def latest(self) -> tuple[SnapshotHeader, torch.Tensor] | None:
        """The newest committed snapshot: its header as committed, and its bytes."""
        return self.in_flight.latest

    def metrics(self) -> dict[str, float]:
        """Per-iteration figures for the log and TensorBoard."""
        policy = self.planner.policy
        return {
            **self.stats.last,
            **({"interval": policy.interval} if policy else {}),
            "window": self.stats.window_size,
            "repl_lag": self.handoff.backlog,
            "host_mb": (self.buffers.nbytes() + self.replicas.nbytes()) / 1e6,
        }

    # ---- recovery support (moevement.recovery, baselines.global_rollback) ------------------------

    def abort_window(self) -> None:
        """Recovery starts: finish replication, then drop the in-flight window on every rank.

        The newest persisted checkpoint stays; the next `begin` opens a new window."""
        self.handoff.drain()
        self.in_flight.drop()
        self.stats.recovering()
        persisted = self.persisted.abort_in_flight()
        in_flight = (persisted + 1) % 2
        self.buffers.invalidate(in_flight)
        self.replicas.invalidate(in_flight)
        self.current_window.abort(persisted)

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

    def paused(self) -> AbstractContextManager[None]:
        """Iterations replayed inside this block take no snapshot and are not profiled."""
        return self.stats.pausing()

    def replica_holders(self, rank: int) -> list[int]:
        """The ranks holding replicas of `rank`'s snapshots, in fetch order."""
        return self.topology.replica_holders(rank, self.cfg.replicas)

    def flush_disk(self) -> None:
        """Every disk write that was going to land has landed."""
        self.handoff.flush_disk()

    def close(self) -> None:
        """Finish copies, replication and disk writes; drop host state unless asked to keep it."""
        self.stats.drop_prepared()
        self.in_flight.finish()
        self.buffers.close()
        self.handoff.close()
        for buf in self._held():
            buf.release()
        KEPT.drop_under(self.rank_dir)  # the bandwidth probe's, and any no buffer took back
        if not self.cfg.keep_host_state:
            remove_tree(self.rank_dir, self.rank_dir.parent)

    def abandon(self) -> None:
        """This rank leaves its generation (a peer died; docs/design/lifecycle/survival.md) and its next generation
        builds a new checkpointer over the same directory: the in-flight copy and disk writes finish, replication
        ends after the rounds already submitted, committed files stay. Errors met here are the dead peer's."""
        self.in_flight.abandon()
        self.buffers.close()
        self.handoff.abandon(self.topology.rank)
        for buf in self._held():
            buf.release(keep=True)  # the next generation's buffers take the mappings back (`mappings.KEPT`)

    def adopt(self, window_index: int, snapshots: list[tuple[SnapshotHeader, dict]]) -> None:
        """A restarted job keeps the window it restarted from as its persisted checkpoint (collective): every
        rank writes its snapshots into its buffers as window `window_index` and replicates them like a window
        just taken; on return the window is persisted everywhere (it is not written to disk again)."""
        self.current_window.index = window_index
        adopt_window(self.buffers, self.handoff, window_index, snapshots)

    def drop_leftovers(self) -> None:
        """Remove what earlier processes of this rank left and this process does not hold (`drop_leftovers` of
        restarted.py; their buffers' bytes stay as spare pages). Called once training goes on."""
        drop_leftovers(self.rank_dir, self._held(), self.persisted.index >= 0)

    def _held(self) -> list[HostBuffer]:
        return [*self.buffers.all(), *self.replicas.buffers.values()]


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
