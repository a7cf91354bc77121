"""Localized recovery (DESIGN.md §4): roll back only the failed stages' data-parallel groups.

At the start of iteration T every rank runs `Recovery.recover(T, events)` (failures are detected
at iteration boundaries; injected ones are known to all ranks):

  1. Replication is drained and the in-flight sparse checkpoint dropped everywhere; the newest
     persisted one (first iteration t0, window W) is the rollback target (none yet: the initial
     state, t0 = 1, W = 0).
  2. Failed ranks lose everything (`wipe`) and fetch their snapshots from replica peers, trying
     the next peer when a checksum fails (fetch).
  3. The scope's boundary logs for t0..T-1 are sent by the healthy neighbouring stages, and the
     scalar log by a survivor.
  4. Every rank of the failed stages converts (replays t0..t0+W-1, activating slot i at t0+i)
     and catches up (replays t0+W..T-1): at most 2W iterations (convert, catchup). Healthy stages
     only serve logs and wait, so the replaying ranks take over their idle cores
     (`moevement.recovery.replay_threads`: same bits at any thread count).
A second failure during a recovery (a later event of the same iteration) fires after the first
replayed iteration, widens the failed set and restarts the joint recovery.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.failures import FaultEvent
from moevement.operators import Operator
from moevement.recovery.fetch import RecoveryError, fetch_from_replicas, persisted_header
from moevement.recovery.replay import load_compute, load_master, reset_to_initial, set_frozen, wipe_operators
from moevement.recovery.replay_threads import intra_op_threads, replay_threads
from moevement.recovery.restart import Found
from moevement.recovery.upstream_log import UpstreamLog
from moevement.storage.snapshot import SnapshotHeader, read_entries

DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass
class Layout:
    """Where every rank sits: pipeline rank and data-parallel rank; which stages each pipeline rank runs."""

    pp_of: list[int]
    dp_of: list[int]
    stages_of_pp: list[list[int]]

    def rank_of(self, pp_rank: int, dp_rank: int) -> int:
        return next(r for r, (p, d) in enumerate(zip(self.pp_of, self.dp_of)) if p == pp_rank and d == dp_rank)

    def owner_pp(self, stage: int) -> int:
        return next(p for p, stages in enumerate(self.stages_of_pp) if stage in stages)


@dataclass
class TrainerHooks:
    """What recovery needs from the training loop, independent of model classes."""

    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # this rank's (inputs, labels) of iteration t
    begin_iteration: Callable[[int], None]  # re-seed dropout etc. before iteration t runs
    forward_backward: Callable[[int, set, torch.Tensor, torch.Tensor, Callable], None]  # (t, scope, x, y, boundary)
    optimizer_step: Callable[[dict], None]  # clip with the logged coefficient, logged lr, step, zero grads
    initial_parameters: Callable[[], dict[str, torch.Tensor]]  # full initial value of every local parameter
    line: Callable[[str], None]  # rank 0's console line


@dataclass
class _Stats:
    fetch: float = 0.0
    convert: float = 0.0
    catchup: float = 0.0
    replayed: int = 0
    threads: int = 0  # intra-op threads this rank replayed with (0: it did not replay)
    sources: dict = field(default_factory=dict)


class Recovery:
    def __init__(
        self,
        checkpointer: SparseCheckpointer,
        log: UpstreamLog | None,
        optimizer,
        layout: Layout,
        n_stages: int,
        micro_batches: int,
        hooks: TrainerHooks,
        global_rollback: bool = False,
        threads: int = 0,
    ):
        self.ck, self.log, self.optimizer, self.layout = checkpointer, log, optimizer, layout
        self.global_rollback = global_rollback  # every stage rolls back and replays (the baseline to compare with)
        self.threads = threads  # intra-op threads of a replaying rank (0: auto, see moevement.recovery.replay_threads)
        self.training_threads = torch.get_num_threads()
        self.n_stages, self.micro, self.hooks = n_stages, micro_batches, hooks
        self.me, self.world = dist.get_rank(), dist.get_world_size()
        self.ops: list[Operator] = checkpointer.ops

    def recover(self, step: int, events: list[FaultEvent]) -> None:
        started = time.perf_counter()
        work_before = self.log.work() if self.log else (0, 0)
        self.ck.abort_window()
        failed: set[int] = set()
        queue = list(events)
        while queue:
            event = queue.pop(0)
            failed |= set(event.ranks)
            if self.me in event.ranks:
                self._wipe()
            stats = self._run(step, failed, stop_after=1 if queue else None)  # a later event cuts it short
        dist.barrier()
        totals = torch.tensor([stats.fetch, stats.convert, stats.catchup], dtype=torch.float64)
        dist.all_reduce(totals, op=dist.ReduceOp.MAX)
        seconds = time.perf_counter() - started
        pps = sorted(self._rolled_back(failed))
        scope = sorted(s for p in pps for s in self.layout.stages_of_pp[p])
        t0 = self.ck.rollback_point()
        self.hooks.line(
            f"recovery step={step} ranks={'+'.join(map(str, sorted(failed)))} scope={_ranges(scope)} "
            f"rollback_to={t0} replayed={step - t0} seconds={seconds:.3f} "
            f"(fetch={totals[0]:.3f} convert={totals[1]:.3f} catchup={totals[2]:.3f})"
        )
        forwards, backwards = (a - b for a, b in zip(self.log.work() if self.log else (0, 0), work_before))
        role = "failed" if self.me in failed else ("rolled-back" if self.layout.pp_of[self.me] in pps else "healthy")
        source = f" snapshots_from={stats.sources[self.me]}" if self.me in stats.sources else ""
        threads = f" threads={stats.threads}" if stats.threads else ""
        work = [None] * self.world if self.me == 0 else None
        dist.gather_object(
            f"recovery work rank={self.me} role={role} forwards={forwards} backwards={backwards}{threads}{source}",
            work,
            dst=0,
        )
        for text in work or []:
            self.hooks.line(text)

    def _rolled_back(self, failed: set[int]) -> set[int]:
        """Pipeline ranks that roll back: those of the failed ranks (localized), or all (global)."""
        if self.global_rollback:
            return set(range(len(self.layout.stages_of_pp)))
        return {self.layout.pp_of[r] for r in failed}

    def restart(self, found: Found) -> int:
        """Whole-job restart: every stage converts `found` by a full-pipeline replay (global rollback).

        Returns the first iteration to train next (t0 + W); the logged scalars come from the headers."""
        started = time.perf_counter()
        t0, window = found.window_start, found.window
        stats = _Stats(fetch=found.seconds)
        scalars = {header.iteration: header.meta["scalars"] for header, _ in found.snapshots}
        self.replay(
            t0,
            t0 + window,
            window,
            set(range(self.n_stages)),
            lambda i: found.snapshots[i],
            scalars,
            _no_boundary,
            stats,
        )
        dist.barrier()
        totals = torch.tensor([stats.fetch, stats.convert], dtype=torch.float64)
        dist.all_reduce(totals, op=dist.ReduceOp.MAX)
        self.hooks.line(
            f"recovery step={found.last_iteration + 1} ranks={'+'.join(map(str, range(self.world)))} "
            f"scope={_ranges(list(range(self.n_stages)))} rollback_to={t0} replayed={window} "
            f"seconds={time.perf_counter() - started + found.seconds:.3f} "
            f"(fetch={totals[0]:.3f} convert={totals[1]:.3f} catchup=0.000) restart=global "
            f'snapshots_from="{"; ".join(f"rank{r}: {src}" for r, src in enumerate(found.sources))}"'
        )
        return t0 + window

    # ---- one (possibly widened) recovery -----------------------------------------------------------

    def _run(self, step: int, failed: set[int], stop_after: int | None) -> _Stats:
        stats = _Stats()
        pps = self._rolled_back(failed)
        scope = {s for p in pps for s in self.layout.stages_of_pp[p]}
        in_unit = self.layout.pp_of[self.me] in pps
        t0 = self.ck.rollback_point()
        window = self.ck.persisted_window[1] if self.ck.persisted_window else 0
        start = time.perf_counter()
        if window:
            stats.sources = fetch_from_replicas(self.ck, failed, window)
        boundary = self._fetch_logs(scope, t0, step)
        scalars = self._share_scalars(failed, t0, step)
        stats.fetch = time.perf_counter() - start
        if not in_unit:
            return stats
        # Slot orders must agree inside the unit (FSDP shards, expert peers): everyone starts afresh.
        self.ck.reset_popularity()
        if not window:
            self._load_initial_state()
        self.replay(
            t0,
            step,
            window,
            scope,
            self._persisted_slot,
            scalars,
            lambda k, i, s, m: boundary[(k, i, s, m)],
            stats,
            stop_after,
        )
        return stats

    def replay(
        self,
        t0: int,
        end: int,
        window: int,
        scope: set[int],
        slot_snapshot: Callable,
        scalars: dict,
        boundary: Callable,
        stats: _Stats,
        stop_after: int | None = None,
    ) -> bool:
        """Replay iterations t0..end-1 of the stages in `scope`, activating slot i at t0+i (i < window).

        `slot_snapshot(i)` gives (header, tensors) of SS_{t0+i}; `scalars[t]` the scalar log of t.
        Returns False when stopped early after `stop_after` iterations (a failure during recovery)."""
        self.ck.replaying = True
        stats.threads = self._replay_threads(scope)
        try:
            with intra_op_threads(stats.threads):
                for t in range(t0, end):
                    start = time.perf_counter()
                    if t < t0 + window:
                        self._activate_slot(*slot_snapshot(t - t0))
                    self.hooks.begin_iteration(t)
                    self.hooks.forward_backward(t, scope, *self.hooks.batch(t), boundary)
                    self.hooks.optimizer_step(scalars[t])
                    elapsed = time.perf_counter() - start
                    if t < t0 + window:
                        stats.convert += elapsed
                    else:
                        stats.catchup += elapsed
                    stats.replayed += 1
                    if stop_after is not None and stats.replayed >= stop_after and t + 1 < end:
                        return False
        finally:
            self.ck.replaying = False
            set_frozen(self.ops, False)
        return True

    def _replay_threads(self, scope: set[int]) -> int:
        """Threads for this rank's replay of `scope`: the idle cores of its node (moevement.recovery.replay_threads)."""
        replaying = [r for r, p in enumerate(self.layout.pp_of) if set(self.layout.stages_of_pp[p]) & scope]
        return replay_threads(
            replaying, self.ck.topology.node_of, self.me, self.threads, self.training_threads, self.ck.device
        )

    def _wipe(self) -> None:
        wipe_operators(self.ops, self.optimizer)
        self.ck.wipe()
        if self.log is not None:
            self.log.wipe()

    def _load_initial_state(self) -> None:
        """No checkpoint persisted yet: every operator restarts from the seed-derived initial state."""
        reset_to_initial(self.ops, self.optimizer, self.hooks.initial_parameters())

    def _persisted_slot(self, slot: int) -> tuple[SnapshotHeader, dict]:
        """SS_{t0+slot} of the newest persisted checkpoint, from the local buffers (verified at fetch)."""
        buf = self.ck.persisted_buffer(slot)
        header = SnapshotHeader.from_json(persisted_header(buf))
        return header, read_entries(buf.data, header, source=str(buf.path), verify=False)

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

    # ---- communication: snapshots, logs, scalars ------------------------------------------------------

    def _fetch_logs(self, scope: set[int], t0: int, step: int) -> dict:
        """Boundary tensors of iterations t0..step-1 from the healthy neighbours of the scope."""
        boundary = {}
        if self.log is None:
            return boundary
        dp_size = max(self.layout.dp_of) + 1
        for s in sorted(scope):
            for kind, nb in (("act", s - 1), ("grad", s + 1)):
                if not 0 <= nb < self.n_stages or nb in scope:
                    continue
                for d in range(dp_size):
                    sender = self.layout.rank_of(self.layout.owner_pp(nb), d)
                    receiver = self.layout.rank_of(self.layout.owner_pp(s), d)
                    wanted = [(kind, t, nb, m) for t in range(t0, step) for m in range(self.micro)]
                    if self.me == sender:
                        stacked = torch.stack([self.log.get(*key) for key in wanted])
                        dist.send(torch.tensor([*stacked.shape, DTYPE_CODES.index(stacked.dtype)]), receiver)
                        dist.send(stacked, receiver)
                    elif self.me == receiver:
                        meta = torch.zeros(5, dtype=torch.int64)
                        dist.recv(meta, sender)
                        stacked = torch.empty(meta[:4].tolist(), dtype=DTYPE_CODES[int(meta[4])])
                        dist.recv(stacked, sender)
                        boundary.update(zip(wanted, stacked.unbind(0)))
        return boundary

    def _share_scalars(self, failed: set[int], t0: int, step: int) -> dict[int, dict]:
        """The scalar log of t0..step-1, from the lowest-numbered surviving rank."""
        source = min(r for r in range(self.world) if r not in failed)
        payload = [{t: self.ck.scalar_log[t] for t in range(t0, step)} if self.me == source else None]
        dist.broadcast_object_list(payload, src=source)
        self.ck.scalar_log.update(payload[0])  # a failed rank's log is back: it may serve the next recovery
        return payload[0]


def _no_boundary(kind: str, iteration: int, stage: int, micro: int):
    raise RecoveryError(
        f"a full-pipeline replay needs no upstream log ({kind} of stage {stage}, iteration {iteration})"
    )


def _ranges(stages: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3,5"."""
    out, i = [], 0
    while i < len(stages):
        j = i
        while j + 1 < len(stages) and stages[j + 1] == stages[j] + 1:
            j += 1
        out.append(str(stages[i]) if i == j else f"{stages[i]}-{stages[j]}")
        i = j + 1
    return ",".join(out)
