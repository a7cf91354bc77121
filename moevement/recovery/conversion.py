"""Sparse-to-dense conversion by replay with frozen and active operators (docs/design/replay.md).

`Conversion.replay(plan, stats)` re-runs iterations t0..end-1 of the stages in `plan.scope`. At
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


@dataclass(frozen=True)
class ReplayPlan:
    """What a replay re-runs: iterations `start..end-1` of the pipeline stages in `scope`; while converting
    (`start + i`, i < `window_size`) it first activates slot i of the persisted window."""

    start: int  # t0, the first iteration of the window (1 and `window_size` 0: from the initial state)
    end: int  # the first iteration not replayed
    window_size: int  # W, the window's slots (0: nothing to convert, every iteration catches up)
    scope: set[int]  # the stages that replay (this rank replays those of them it runs)
    slot_snapshot: Callable[[int], tuple[SnapshotHeader, dict]] | None  # i -> SS_{start+i}; None when W is 0
    scalars: Mapping[int, dict]  # the scalar log (learning rate, clip coefficient) of every iteration replayed
    boundary: Mapping  # the boundary logs from outside the scope (`PipelineReplay.forward_backward`)
    stop_after: int | None = None  # stop once this many iterations replayed (a later failure is waiting)

    def converts(self, t: int) -> bool:
        """Whether iteration `t` is one of the window's (it activates a slot) rather than a catch-up."""
        return t < self.start + self.window_size


@dataclass
class ReplayStats:
    """What one rank's recovery measured (seconds) and where its snapshots came from; the training thread
    fills it in during a recovery."""

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
    """Converts a persisted sparse window into this rank's dense state by replay (see the module docstring)."""

    def __init__(
        self,
        checkpointer: SparseCheckpointer,
        optimizer: torch.optim.Optimizer,
        layout: Topology,
        hooks: TrainerHooks,
        log: UpstreamLog | None,
        device: torch.device,
        threads: int = 0,
        frozen_weight_grad: bool = False,
    ):
        self.ck, self.optimizer, self.layout, self.hooks, self.log = checkpointer, optimizer, layout, hooks, log
        self.device = device
        self.threads = threads  # intra-op threads of a replaying rank (0: auto, see replay_threads)
        self.frozen_weight_grad = frozen_weight_grad  # frozen operators compute (and drop) weight gradients
        self.training_threads = torch.get_num_threads()

    def replay(self, plan: ReplayPlan, stats: ReplayStats) -> bool:
        """Replay `plan` on this rank (its stages in `plan.scope`), adding the seconds of each phase to `stats`.

        Returns False when stopped early after `plan.stop_after` iterations (a failure during recovery).
        Whatever happens, every operator is left unfrozen."""
        stats.threads = self._threads(plan.scope)
        try:
            with self.ck.paused(), intra_op_threads(stats.threads):
                for t in range(plan.start, plan.end):
                    elapsed = self._iteration(plan, t, stats)
                    if plan.converts(t):
                        stats.convert += elapsed
                    else:
                        stats.catchup += elapsed
                    stats.replayed += 1
                    if plan.stop_after is not None and stats.replayed >= plan.stop_after and t + 1 < plan.end:
                        return False
        finally:
            set_frozen(self.ck.ops, False)
        return True

    def _iteration(self, plan: ReplayPlan, t: int, stats: ReplayStats) -> float:
        """Replay iteration `t` of `plan` (activating its slot first while converting); returns its seconds."""
        start = time.perf_counter()
        if plan.converts(t):
            self.activate_slot(*plan.slot_snapshot(t - plan.start))
        self.hooks.begin_iteration(t)
        if self.log is not None:
            self.log.begin(t)
        computed = time.perf_counter()
        stats.add("load", computed - start)
        phases = self.hooks.forward_backward(t, plan.scope, *self.hooks.batch(t), plan.boundary)
        for phase, seconds in (phases or {"forward_backward": time.perf_counter() - computed}).items():
            stats.add(phase, seconds)
        stepped = time.perf_counter()
        with frozen_slices_kept(self.ck.ops, self.optimizer):
            self.hooks.optimizer_step(plan.scalars[t])
        stats.add("optimizer", time.perf_counter() - stepped)
        return time.perf_counter() - start

    def load_initial_state(self) -> None:
        """No checkpoint persisted yet: every operator restarts from the seed-derived initial state."""
        reset_to_initial(self.ck.ops, self.optimizer, self.hooks.initial_parameters())

    def _threads(self, scope: set[int]) -> int:
        """Threads for this rank's replay of `scope`: the idle cores of its node (replay_threads)."""
        layout = self.layout
        replaying = [r for r, p in enumerate(layout.pp_of) if set(layout.stages_of_pp[p]) & scope]
        me = dist.get_rank()
        return replay_threads(replaying, layout.node_of, me, self.threads, self.training_threads, self.device)

    def activate_slot(self, header: SnapshotHeader, tensors: dict) -> None:
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
            set_frozen([by_name[name]], True, self.frozen_weight_grad)
