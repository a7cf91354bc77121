"""Sparse-to-dense conversion by replay with frozen and active operators (docs/design.md §3).

`Conversion.replay(t0, end, W, scope, ...)` re-runs iterations t0..end-1 of the stages in `scope`. At
t0+i (i < W) it loads SS_{t0+i}: slot i becomes *active* (FP32 master weights and optimizer state
restored; it trains normally) and the operators of later slots get the snapshot's compute weights and
are *frozen* (forward and input gradient only, no weight gradient, no optimizer update). After t0+W-1
every operator is active and the remaining iterations catch up. Each replayed iteration uses the logged
learning rate and clip coefficient, so the result equals the fault-free state bit for bit.

Training thread only; the checkpointer is paused while iterations replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.recovery.fetch import RecoveryError
from moevement.recovery.replay import frozen_slices_kept, load_compute, load_master, reset_to_initial, set_frozen
from moevement.recovery.replay_threads import intra_op_threads, replay_threads
from moevement.recovery.upstream_log import UpstreamLog
from moevement.storage.snapshot import SnapshotHeader
from moevement.topology import Topology


@dataclass
class TrainerHooks:
    """What recovery needs from the training loop, independent of model classes."""

    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # this rank's (inputs, labels) of iteration t
    begin_iteration: Callable[[int], None]  # re-seed dropout etc. before iteration t runs
    # (t, scope, x, y, boundary) -> seconds by phase (forward, backward, ...) or None
    forward_backward: Callable[[int, set, torch.Tensor, torch.Tensor, Mapping], dict[str, float] | None]
    optimizer_step: Callable[[dict], None]  # clip with the logged coefficient, logged lr, step, zero grads
    initial_parameters: Callable[[], dict[str, torch.Tensor]]  # full initial value of every local parameter
    line: Callable[[str], None]  # rank 0's console line


@dataclass
class ReplayStats:
    fetch: float = 0.0
    convert: float = 0.0
    catchup: float = 0.0
    replayed: int = 0
    threads: int = 0  # intra-op threads this rank replayed with (0: it did not replay)
    sources: dict = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # this rank's replay seconds: load, forward, ...

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds


class Conversion:
    def __init__(
        self,
        checkpointer: SparseCheckpointer,
        optimizer: torch.optim.Optimizer,
        layout: Topology,
        hooks: TrainerHooks,
        log: UpstreamLog | None,
        device: torch.device,
        threads: int = 0,
    ):
        self.ck, self.optimizer, self.layout, self.hooks, self.log = checkpointer, optimizer, layout, hooks, log
        self.device = device
        self.threads = threads  # intra-op threads of a replaying rank (0: auto, see replay_threads)
        self.training_threads = torch.get_num_threads()

    def replay(
        self,
        t0: int,
        end: int,
        window: int,
        scope: set[int],
        slot_snapshot: Callable[[int], tuple[SnapshotHeader, dict]],
        scalars: dict,
        boundary: Mapping,
        stats: ReplayStats,
        stop_after: int | None = None,
    ) -> bool:
        """Replay iterations t0..end-1 of the stages in `scope`, activating slot i at t0+i (i < window).

        `slot_snapshot(i)` gives (header, tensors) of SS_{t0+i}; `scalars[t]` the scalar log of t.
        Returns False when stopped early after `stop_after` iterations (a failure during recovery)."""
        stats.threads = self._threads(scope)
        try:
            with self.ck.paused(), intra_op_threads(stats.threads):
                for t in range(t0, end):
                    start = time.perf_counter()
                    if t < t0 + window:
                        self._activate_slot(*slot_snapshot(t - t0))
                    self.hooks.begin_iteration(t)
                    if self.log is not None:
                        self.log.begin(t)
                    computed = time.perf_counter()
                    stats.add("load", computed - start)
                    phases = self.hooks.forward_backward(t, scope, *self.hooks.batch(t), boundary)
                    for phase, seconds in (phases or {"forward_backward": time.perf_counter() - computed}).items():
                        stats.add(phase, seconds)
                    stepped = time.perf_counter()
                    with frozen_slices_kept(self.ck.ops, self.optimizer):
                        self.hooks.optimizer_step(scalars[t])
                    stats.add("optimizer", time.perf_counter() - stepped)
                    elapsed = time.perf_counter() - start
                    if t < t0 + window:
                        stats.convert += elapsed
                    else:
                        stats.catchup += elapsed
                    stats.replayed += 1
                    if stop_after is not None and stats.replayed >= stop_after and t + 1 < end:
                        return False
        finally:
            set_frozen(self.ck.ops, False)
        return True

    def load_initial_state(self) -> None:
        """No checkpoint persisted yet: every operator restarts from the seed-derived initial state."""
        reset_to_initial(self.ck.ops, self.optimizer, self.hooks.initial_parameters())

    def _threads(self, scope: set[int]) -> int:
        """Threads for this rank's replay of `scope`: the idle cores of its node (replay_threads)."""
        layout = self.layout
        replaying = [r for r, p in enumerate(layout.pp_of) if set(layout.stages_of_pp[p]) & scope]
        me = dist.get_rank()
        return replay_threads(replaying, layout.node_of, me, self.threads, self.training_threads, self.device)

    def _activate_slot(self, header: SnapshotHeader, tensors: dict) -> None:
        """Load a snapshot: its slot's FP32 state (active) and later slots' compute weights (frozen)."""
        by_name = self.ck.ops_by_name
        missing = [name for name in [*header.active, *header.frozen] if name not in by_name]
        if missing:
            raise RecoveryError(
                f"snapshot of iteration {header.iteration} names operators this model does not "
                f"have ({', '.join(missing[:3])}): it belongs to another model or layout"
            )
        for name in header.active:
            load_master(by_name[name], tensors, self.optimizer)
            set_frozen([by_name[name]], False)
        for name in header.frozen:
            load_compute(by_name[name], tensors)
            set_frozen([by_name[name]], True)
