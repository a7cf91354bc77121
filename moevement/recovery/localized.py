"""Localized recovery (docs/design/recovery.md): roll back only the failed stages' data-parallel groups.

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
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.failures import FaultEvent
from moevement.recovery.conversion import Conversion, ReplayPlan, ReplayStats
from moevement.recovery.fetch import (
    fetch_boundary_logs,
    fetch_from_replicas,
    fetch_scalars,
)
from moevement.recovery.live_state import Rejoin, Survival, restore_live_state
from moevement.recovery.replay import wipe_operators
from moevement.recovery.report import RecoveryFigures, RecoveryReport, RecoveryWork, detect_seconds, fault_step
from moevement.recovery.restart import RestartPoint
from moevement.recovery.start_source import Source, after_rejoin
from moevement.recovery.upstream_log import UpstreamLog
from moevement.topology import Topology
from parallelisms import collectives


class Recovery:
    """Localized recovery and whole-job restart of this rank (see the module docstring). Training thread
    only; every public method is collective over the whole job."""

    def __init__(
        self,
        checkpointer: SparseCheckpointer,
        log: UpstreamLog | None,
        layout: Topology,
        micro_batches: int,
        conversion: Conversion,
        line: Callable[[str | RecoveryReport | RecoveryWork], None],
        global_rollback: bool = False,
    ):
        self.ck, self.log, self.layout, self.micro = checkpointer, log, layout, micro_batches
        self.conversion, self.line = conversion, line  # prints on rank 0; a report's record goes beside its line
        self.figures: RecoveryFigures | None = None  # of the newest `recover` (the loop reads them after it)
        self.global_rollback = global_rollback  # every stage rolls back and replays (the baseline to compare with)
        self.me, self.world = dist.get_rank(), dist.get_world_size()

    def recover(self, step: int, events: list[FaultEvent]) -> None:
        """Failures `events` strike before iteration `step`: the failed stages recover; on return every rank
        holds state_step and iteration `step` runs next."""
        started = time.perf_counter()
        work_before = self.log.work() if self.log else (0, 0)
        self.ck.abort_window()
        failed: set[int] = set()
        queue = list(events)
        while queue:
            event = queue.pop(0)
            failed |= set(event.ranks)
            if self.me in event.ranks:
                wipe_rank(self.ck, self.conversion.optimizer, self.log)
            stats = self._run(step, failed, stop_after=1 if queue else None)  # a later event cuts it short
        fetch, convert, catchup = _slowest(stats.fetch, stats.convert, stats.catchup)
        seconds = time.perf_counter() - started
        pps = self._rolled_back(failed)
        t0 = self.ck.persisted.rollback_point()
        scope = _stages_of(self.layout, pps)
        ranks = tuple(sorted(failed))
        # injected: every rank knows of it at once (detect=0)
        report = RecoveryReport(
            step, ranks, scope, t0, step - t0, seconds, fetch, convert, catchup, detect=0.0, fault_step=step
        )
        self._report(report, failed, pps)
        self.report_work(failed, pps, work_before, stats)

    def report_work(
        self,
        failed: set[int],
        pps: set[int],
        work_before: tuple[int, int],
        stats: ReplayStats,
        rejoin: Rejoin | None = None,
    ) -> None:
        """Rank 0 prints every rank's `recovery work` line: its role and the forwards/backwards it ran, and after
        a restart (`rejoin`) how long it built its model (`build_s`) and what a warm standby built of it."""
        forwards, backwards = (a - b for a, b in zip(self.log.work() if self.log else (0, 0), work_before))
        role = "failed" if self.me in failed else ("rolled-back" if self.layout.pp_of[self.me] in pps else "healthy")
        phases = tuple(stats.phases.items())
        built, prebuilt = (_build_seconds(rejoin.timeline), rejoin.prebuilt) if rejoin else (None, None)
        mine = RecoveryWork(
            self.me, role, forwards, backwards, stats.threads, stats.sources.get(self.me), phases, built, prebuilt
        )
        work = [None] * self.world if self.me == 0 else None
        collectives.gather_object(mine, work, dst=0)
        for line in work or []:
            self.line(line)

    def rejoin(self, found: RestartPoint | None, rejoin: Rejoin) -> tuple[int, int]:
        """After a torchrun restart with survivors: the stages of the ranks that kept no live state replay
        from `found` (or the initial state) to the survivors' iteration; the others restore theirs and
        serve logs. Survivors' logs that do not reach back to `found` (or states older than it) make every
        stage roll back to it instead. Returns (the iteration training goes on with, the first one every
        rank holds logs of)."""
        started, rejoin_start = time.perf_counter(), time.time()
        live = rejoin.live
        gathered: list = [None] * self.world
        collectives.all_gather_object(gathered, (live.survival() if live else None, rejoin.fault))
        kept: list[Survival | None] = [k for k, _ in gathered]
        target = max(k.next_iteration for k in kept if k)
        failed = {r for r, k in enumerate(kept) if not k or k.next_iteration != target}
        t0 = found.window_start if found else 1
        logs_from = max(k.log_from for k in kept if k and k.next_iteration == target)
        if after_rejoin(t0, target, logs_from, found is not None) is not Source.LIVE_STATE:
            self.line(f"restart: the survivors' logs do not cover iteration {t0} on: every stage rolls back")
            return (self.restart(found) if found else 1), t0
        pps = self._rolled_back(failed)
        if self.me not in failed:
            self.ck.persisted.restore_scalars(live.scalars)
            if self.layout.pp_of[self.me] not in pps:
                restore_live_state(live, self.ck.ops, self.conversion.optimizer, self.log)
        restored = time.time()
        stats = self._catch_up(found, failed, pps, t0, target, started)
        fetch, convert, catchup = _slowest(stats.fetch, stats.convert, stats.catchup)
        detected, timeline = _detection(kept, rejoin, restored)
        how = "replaced" if rejoin.in_place else "global-replay" if self.global_rollback else "local"
        report = RecoveryReport(
            step=target,
            ranks=tuple(sorted(failed)),
            scope=_stages_of(self.layout, pps),
            rollback_to=t0,
            replayed=target - t0,
            seconds=time.time() - detected,
            restart_seconds=_restart_seconds(rejoin, timeline, detected, rejoin_start),
            fetch=fetch,
            convert=convert,
            catchup=catchup,
            restart=how,
            detected_by=tuple(_how(kept)),
            detect=detect_seconds(detected, [fault for _, fault in gathered]),
            fault_step=fault_step([fault for _, fault in gathered]),
        )
        self._report(report, failed, pps)
        self.line(f"restart timeline rank={self.me}: {_stages(timeline)}")
        self.report_work(failed, pps, (0, 0), stats, rejoin)
        return target, t0

    def _catch_up(
        self, found: RestartPoint | None, failed: set[int], pps: set[int], t0: int, target: int, started: float
    ) -> ReplayStats:
        """A rejoin's replay: the stages of pipeline ranks `pps` replay from `found` (None: the initial state,
        t0 1) to `target`, with the logs the others serve. Collective; `started`: when the rejoin began."""
        stats = ReplayStats()
        if found is not None and self.me in failed:
            stats.sources[self.me] = found.sources[self.me].replace(" ", "_")
        window_size, snapshots = (found.window_size, found.snapshots.__getitem__) if found else (0, None)
        scope = self.layout.stages_of(pps)
        boundary, scalars = self._logs(failed, scope, t0, target)
        stats.fetch = time.perf_counter() - started
        if self.layout.pp_of[self.me] in pps:
            if found is None:
                self.conversion.load_initial_state()
            self.conversion.replay(ReplayPlan(t0, target, window_size, scope, snapshots, scalars, boundary), stats)
        return stats

    def restart(self, found: RestartPoint) -> int:
        """Whole-job restart: every stage converts `found` by a full-pipeline replay (global rollback).

        Returns the first iteration to train next: t0 + W, or for a window re-laid from another layout
        (`found.relaid`) t0 + W - 1. Its last slot makes every operator active, so the new layout trains that
        iteration as any other, computing its own clip coefficient rather than replaying the old layout's
        (with W = 1 nothing is replayed: the run is the new layout's from t0 on, bit for bit). The logged scalars
        of the replayed iterations come from the headers and are kept, as are the boundary logs the replay
        writes: every rank holds both from t0 on."""
        started = time.perf_counter()
        t0, window_size = found.window_start, found.window_size
        replayed = window_size - 1 if found.relaid else window_size
        stats = ReplayStats(fetch=found.seconds)
        scalars = {header.iteration: header.meta["scalars"] for header, _ in found.snapshots[:replayed]}
        self.ck.persisted.restore_scalars(scalars)
        every_stage = set(range(self.layout.n_stages))
        self.conversion.replay(
            ReplayPlan(t0, t0 + replayed, window_size, every_stage, found.snapshots.__getitem__, scalars, {}), stats
        )
        if found.relaid:
            self.conversion.activate_slot(*found.snapshots[-1])
        fetch, convert = _slowest(stats.fetch, stats.convert)
        report = RecoveryReport(
            step=found.last_iteration + 1,
            ranks=tuple(range(self.world)),
            scope=tuple(sorted(every_stage)),
            rollback_to=t0,
            replayed=replayed,
            seconds=time.perf_counter() - started + found.seconds,
            fetch=fetch,
            convert=convert,
            restart="global",
            snapshots_from=tuple(f"rank{r}: {s}" for r, s in enumerate(found.sources)),
        )
        self._report(report, set(range(self.world)), set(self.layout.pp_of))
        return t0 + replayed

    def _report(self, report: RecoveryReport, failed: set[int], pps: set[int]) -> None:
        """Rank 0 prints the recovery line (and records it); every rank keeps its figures for the loop (`figures`)."""
        self.line(report)
        self.figures = RecoveryFigures.of(report, failed, sum(p in pps for p in self.layout.pp_of))

    def _rolled_back(self, failed: set[int]) -> set[int]:
        """Pipeline ranks that roll back: those of the failed ranks (localized), or all (global)."""
        if self.global_rollback:
            return set(range(len(self.layout.stages_of_pp)))
        return {self.layout.pp_of[r] for r in failed}

    # ---- one (possibly widened) recovery -----------------------------------------------------------

    def _run(self, step: int, failed: set[int], stop_after: int | None) -> ReplayStats:
        """One recovery of `failed` before iteration `step`: fetch, then (the rolled-back stages) replay
        from the newest persisted window, stopping after `stop_after` iterations when one is given."""
        stats = ReplayStats()
        pps = self._rolled_back(failed)
        scope = self.layout.stages_of(pps)
        t0 = self.ck.persisted.rollback_point()
        window_size = self.ck.persisted.span.size if self.ck.persisted.span else 0
        start = time.perf_counter()
        if window_size:
            stats.sources = fetch_from_replicas(self.ck, failed, window_size)
        boundary, scalars = self._logs(failed, scope, t0, step)
        stats.fetch = time.perf_counter() - start
        if self.layout.pp_of[self.me] not in pps:
            return stats
        # Slot orders must agree inside the unit (FSDP shards, expert peers): everyone starts afresh.
        self.ck.reset_popularity()
        if not window_size:
            self.conversion.load_initial_state()
        self.conversion.replay(
            ReplayPlan(t0, step, window_size, scope, self.ck.persisted.snapshot, scalars, boundary, stop_after), stats
        )
        return stats

    def _logs(self, failed: set[int], scope: set[int], t0: int, end: int) -> tuple[Mapping, dict[int, dict]]:
        """(boundary logs, scalar logs) of iterations `t0..end-1` that a replay of `scope` needs: those of its
        outer boundaries from the healthy neighbouring stages, and the scalars for the `failed` ranks from a
        survivor. Collective (every rank serves or receives logs)."""
        boundary = fetch_boundary_logs(self.log, self.layout, self.micro, scope, t0, end)
        return boundary, fetch_scalars(self.ck, failed, t0, end)


def wipe_rank(checkpointer: SparseCheckpointer, optimizer: torch.optim.Optimizer, log: UpstreamLog | None) -> None:
    """This rank failed: its operators, optimizer state, host copies and logs are gone."""
    wipe_operators(checkpointer.ops, optimizer)
    checkpointer.wipe()
    if log is not None:
        log.wipe()


def _slowest(*seconds: float) -> list[float]:
    """Once every rank is done (barrier): each of `seconds`, the largest any rank measured. Collective:
    every rank passes as many values."""
    collectives.barrier()
    totals = torch.tensor(seconds, dtype=torch.float64)
    collectives.all_reduce(totals, op=dist.ReduceOp.MAX)
    return totals.tolist()


def _stages_of(layout: Topology, pps: set[int]) -> tuple[int, ...]:
    """The stages the pipeline ranks `pps` run, ascending."""
    return tuple(sorted(layout.stages_of(pps)))


def _detection(kept: list[Survival | None], rejoin: Rejoin, restored: float) -> tuple[float, dict[str, float]]:
    """When the first survivor detected the death (unix time), and the rejoin's timeline: the unix time each
    stage was reached, from the last survivor's keeping its state to this rank's restoring its own."""
    survivors = [k for k in kept if k]
    detected = min(k.detected.get("time", 0.0) for k in survivors)
    kept_at = max(k.detected.get("kept", 0.0) for k in survivors)
    return detected, {"kept": kept_at, **rejoin.timeline, "restored": restored}


def _restart_seconds(
    rejoin: Rejoin, timeline: dict[str, float], detected: float, rebuilt: float
) -> tuple[tuple[str, float], ...]:
    """The seconds from the first detection of the death to the rejoin's replay, by stage. In place: keep
    (until the last survivor kept its state in memory and left its groups), join (the next generation's
    process group), rebuild (data, model, strategy). After a torchrun restart: keep (state to shared
    memory), restart (until the new processes started), setup (their imports, process group, model,
    strategy)."""
    kept = timeline["kept"]
    if rejoin.in_place:
        joined = timeline.get("process_group", kept)
        return ("keep", kept - detected), ("join", joined - kept), ("rebuild", rebuilt - joined)
    exec_at = timeline.get("exec", rebuilt)
    return ("keep", kept - detected), ("restart", exec_at - kept), ("setup", rebuilt - exec_at)


def _build_seconds(timeline: dict[str, float]) -> float | None:
    """Seconds from this process's device mesh to its model (data, model, optimizer built or taken on from a
    warm standby); None where its set-up did not mark both."""
    if "mesh" not in timeline or "model" not in timeline:
        return None
    return timeline["model"] - timeline["mesh"]


def _stages(timeline: dict[str, float]) -> str:
    """`stage=<seconds from the previous stage to it>` in order, from unix times of each stage reached."""
    names = list(timeline)
    return " ".join(f"{b}={timeline[b] - timeline[a]:.3f}" for a, b in zip(names, names[1:]))


def _how(kept: list[Survival | None]) -> list[str]:
    """How the survivors learned of the failure, earliest first: ["rank0: SIGTERM", ...]."""
    told = sorted((k.detected.get("time", 0.0), r, k.detected.get("how", "?")) for r, k in enumerate(kept) if k)
    return [f"rank{r}: {how}" for _, r, how in told]
