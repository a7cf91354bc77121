"""Recovery of the interval baselines (gemini, checkfreq, moc): every rank rolls back, nothing is replayed.

At the start of iteration T (failures detected at iteration boundaries), on every rank:

  1. The in-flight checkpoint is dropped; failed ranks lose their parameters, optimizer state and
     host copies.
  2. The rollback target t_c is the newest complete checkpoint: in host memory, replicated to
     peers (gemini; failed ranks fetch theirs from a replica), or on disk, common to every rank
     (checkfreq, moc).
  3. Every operator is restored from its newest save at or before t_c: for gemini and checkfreq
     that is the dense checkpoint of t_c (exact); MoC restores experts it saved earlier *stale*,
     and the tokens routed to them since are lost (PLT). Operators never saved restart from the
     seed's initial state.
  4. `recover` returns t_c and the training loop runs iterations t_c..T-1 again (recomputation).

After a torchrun restart of the same run (a worker really died; every process starts again),
`restart` does the same at start-up: the ranks whose process died are those that left no survival
marker (`IntervalBaseline.keep_live_state`); gemini loads the newest replicated checkpoint found in
host memory (a dead rank from a peer's replica, never from its own directory), checkfreq and moc the
newest window on disk that every rank holds intact and of this run. MoC's checkpoints carry its
accounting (`MocState.checkpointed`), so the stale restore loses the same tokens as in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from baselines.intervals import IntervalPolicy
from baselines.moc import LostTokens, PartialExpertSelector
from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.failures import FaultEvent
from moevement.recovery.fetch import fetch_from_replicas
from moevement.recovery.live_state import LiveState, Survival
from moevement.recovery.replay import load_master, reset_to_initial, wipe_operators
from moevement.recovery.report import RecoveryFigures, RecoveryReport, ShellFault, detect_seconds, fault_step
from moevement.recovery.restart import UNUSABLE, CheckHeader, RestartPoint, drop_newer_disk_windows
from moevement.storage.host_memory import private_subdirs, remove_tree
from moevement.storage.persistence import read_window
from moevement.storage.private_files import check_private
from moevement.storage.snapshot import SnapshotError, SnapshotHeader
from parallelisms import collectives


@dataclass
class MocState:
    """MoC's selection and lost-token accounting on this rank."""

    selector: PartialExpertSelector
    lost: LostTokens
    plt_threshold: float
    count_tokens: bool  # this rank adds its counts to the global PLT (one rank per expert shard)
    experts: set[str]  # this rank's expert operators
    lost_tokens: float = 0.0  # over all failures so far
    plt: float = 0.0
    last_checkpoint: int = 1  # iteration of the newest checkpoint (1: none yet)

    def checkpointed(self, iteration: int) -> dict:
        """A checkpoint of `state_iteration` is taken: the record its header carries for a restart (the
        tokens routed to each expert since the previous checkpoint, the totals so far, the selection)."""
        record = {
            "counts_from": self.last_checkpoint,
            "counts": self.lost.since(self.last_checkpoint),
            "processed": self.lost.processed,
            "lost_tokens": self.lost_tokens,
            "k": self.selector.k,
            "cursor": self.selector.cursor,
        }
        self.last_checkpoint = iteration
        return record

    def record_of(self, header: SnapshotHeader, source: str) -> dict:
        """The `checkpointed` record of a header read back, checked (SnapshotError naming `source`)."""
        try:
            r = header.meta["moc"]
            record = {
                "counts_from": int(r["counts_from"]),
                "counts": {op: float(r["counts"][op]) for op in r["counts"] if op in self.experts},
                "processed": float(r["processed"]),
                "lost_tokens": float(r["lost_tokens"]),
                "k": int(r["k"]),
                "cursor": int(r["cursor"]),
            }
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SnapshotError(f"{source}: malformed MoC record ({e!r})") from None
        if not 1 <= record["k"] <= self.selector.n_experts or record["counts_from"] > header.iteration:
            raise SnapshotError(f"{source}: MoC record out of range (k={record['k']})")
        return record

    def resumed(self, headers: list[SnapshotHeader]) -> None:
        """After a restart (`headers`: the checkpoints restored from, newest first, already checked): the
        newest one's totals and selection, and each interval's routed tokens as the history."""
        records = [self.record_of(h, f"snapshot of iteration {h.iteration}") for h in headers]
        if records:
            newest = records[0]
            self.lost.history = {r["counts_from"]: r["counts"] for r in records}
            self.lost.processed, self.lost_tokens = newest["processed"], newest["lost_tokens"]
            self.selector.k, self.selector.cursor = newest["k"], newest["cursor"]

    def rolled_back(self, rollback_to: int, saved_at: dict[str, int]) -> dict:
        """Every rank rolled back to `rollback_to`, each operator restored from its save at `saved_at[name]`: the
        tokens whose expert updates the stale restore lost; K_pec doubles when PLT passes the threshold.
        Returns the recovery line's `lost_tokens`, `plt` and `k_pec`. Collective."""
        lost, processed = self.lost.account(rollback_to, saved_at)
        counts = torch.tensor([lost, processed] if self.count_tokens else [0.0, 0.0], dtype=torch.float64)
        collectives.all_reduce(counts)
        self.lost_tokens += float(counts[0])
        self.last_checkpoint = rollback_to  # the next checkpoint counts the tokens routed from here
        self.plt = self.lost_tokens / float(counts[1]) if counts[1] > 0 else 0.0  # over the run so far
        if self.plt > self.plt_threshold:
            self.selector.double()
        return {"lost_tokens": float(counts[0]), "plt": self.plt, "k_pec": self.selector.k}


@dataclass
class RestartState:
    """What a torchrun restart of this run (generation > 0) starts from."""

    kept: LiveState | None  # this rank's survival marker (None: its process died)
    host: RestartPoint | None  # gemini's newest replicated checkpoint in host memory, or an elastic round's re-laid
    check: CheckHeader  # refuses a snapshot of another run, rank or layout
    fault: ShellFault | None = None  # a replacement in place: the fault it replaces, as its rank shell saw it


class Rollback(NamedTuple):
    """Where every rank rolls back to (`to`, an iteration; 1: the initial state), the saves this rank restores
    (newest first) and where they came from (`source`, for the recovery line)."""

    to: int
    saves: Sequence  # (header, tensors) pairs
    source: str


NOTHING_SAVED = Rollback(1, (), "none (initial state)")


class Timing(NamedTuple):
    """A recovery's figures for its line: `seconds()` (its time so far, read when the line is printed), the
    seconds spent finding its checkpoint (`fetched`) and from the fault to its detection (`detect`, 0 for an
    injected failure)."""

    seconds: Callable[[], float]
    fetched: float
    detect: float | None = 0.0


class GlobalRollback:
    """Rolls every rank back to the newest complete checkpoint of `checkpointer` (on disk under its
    `persist_dir` for checkfreq and moc): `recover` in place, `restart` after a torchrun restart (module
    docstring). `initial_parameters()`: the seed's initial parameters, for operators never saved."""

    def __init__(
        self,
        strategy: str,
        checkpointer: SparseCheckpointer,
        policy: IntervalPolicy,
        n_stages: int,
        initial_parameters: Callable[[], dict],
        line: Callable[[str | RecoveryReport], None],
        moc: MocState | None = None,
    ):
        self.strategy, self.ck, self.policy = strategy, checkpointer, policy
        persist_dir = checkpointer.cfg.persist_dir
        self.persist_dir = Path(persist_dir) if persist_dir else None
        self.optimizer, self.n_stages = checkpointer.optimizer, n_stages
        self.initial_parameters, self.line, self.moc = initial_parameters, line, moc
        self.me, self.world = dist.get_rank(), dist.get_world_size()
        self.figures: RecoveryFigures | None = None  # of the newest recovery or restart (the loop reads them)
        self.from_disk = strategy in ("checkfreq", "moc")

    def recover(self, step: int, events: list[FaultEvent]) -> int:
        """Failures at the start of iteration `step`: restore every rank; returns the iteration to resume at."""
        started = time.perf_counter()
        failed = set().union(*(e.ranks for e in events))
        self.ck.abort_window()
        self.ck.flush_disk()  # every write that was going to land has landed
        if self.me in failed:
            wipe_operators(self.ck.ops, self.optimizer)
            self.ck.wipe()
        rollback = self._disk_saves() if self.from_disk else self._memory_saves(failed)
        fetched = time.perf_counter() - started
        saved_at = self._restore(rollback.saves)
        lost = self.moc.rolled_back(rollback.to, saved_at) if self.moc else {}
        self.policy.rolled_back(rollback.to)
        timing = Timing(lambda: time.perf_counter() - started, fetched)
        self._report(step, failed, rollback, timing, lost, fault_step=step)
        return rollback.to

    def restart(self, state: RestartState) -> int:
        """After a torchrun restart of this run: every rank rolls back to the newest complete checkpoint
        as `recover` would (1 when there is none: the initial state), or to `state.host` when the start found
        one (gemini's in host memory; an elastic round's, re-laid); returns its iteration. Collective."""
        started = time.perf_counter()
        gathered: list = [None] * self.world
        collectives.all_gather_object(gathered, (state.kept.survival() if state.kept else None, state.fault))
        kept: list[Survival | None] = [k for k, _ in gathered]
        dead = {r for r, k in enumerate(kept) if k is None}
        if state.host is not None:
            rollback = Rollback(state.host.window_start, state.host.snapshots, state.host.sources[self.me])
        elif self.from_disk:
            rollback = self._disk_restart(state.check)
        else:
            rollback = NOTHING_SAVED
        fetched = time.perf_counter() - started + (state.host.seconds if state.host else 0.0)
        if rollback.to == 1:
            self.line(
                f"restart: no complete {self.strategy} checkpoint of this run survives on every rank; "
                "STARTING FROM THE INITIAL STATE"
            )
        saved_at = self._restore(rollback.saves)
        lost = {}
        if self.moc:
            self.moc.resumed([header for header, _ in rollback.saves])
            lost = self.moc.rolled_back(rollback.to, saved_at)
        self.policy.rolled_back(rollback.to)
        survivors = [k for k in kept if k]
        step = max((k.next_iteration for k in survivors), default=rollback.to)
        detected = min((k.detected.get("time", time.time()) for k in survivors), default=None)
        seconds = (lambda: time.time() - detected) if detected else (lambda: time.perf_counter() - started)
        faults = [fault for _, fault in gathered]
        timing = Timing(seconds, fetched, detect_seconds(detected, faults))
        self._report(step, dead, rollback, timing, lost, restart="global", fault_step=fault_step(faults))
        return rollback.to

    def _report(
        self,
        step: int,
        failed: set[int],
        rollback: Rollback,
        timing: Timing,
        lost: dict,
        restart: str | None = None,
        fault_step: int | None = None,
    ) -> None:
        """Rank 0 prints (and records) the `recovery` line (`lost`: MoC's `lost_tokens`, `plt` and `k_pec`;
        `restart`: how the job restarted, if it did; `fault_step`: the iteration the fault struck in); the failed
        ranks' `rollback.source`s are named. Collective."""
        sources: list = [None] * self.world
        collectives.all_gather_object(sources, rollback.source)
        report = RecoveryReport(
            step=step,
            ranks=tuple(sorted(failed)),
            scope=tuple(range(self.n_stages)),
            rollback_to=rollback.to,
            replayed=step - rollback.to,
            seconds=timing.seconds(),
            fetch=timing.fetched,
            convert=0.0,
            restart=restart,
            strategy=self.strategy,
            snapshots_from=tuple(f"rank{r}: {sources[r]}" for r in sorted(failed)),
            detect=timing.detect,
            fault_step=fault_step,
            **lost,
        )
        self.line(report)
        self.figures = RecoveryFigures.of(report, failed, self.world)

    # ---- where the checkpoint comes from ------------------------------------------------------------

    def _memory_saves(self, failed: set[int]) -> Rollback:
        """Gemini: the newest replicated dense checkpoint in host memory (failed ranks fetch theirs)."""
        if self.ck.persisted.span is None:
            return NOTHING_SAVED
        sources = fetch_from_replicas(self.ck, failed, 1)
        return Rollback(
            self.ck.persisted.rollback_point(),
            [self.ck.persisted.snapshot(0, verify=True)],
            f"replica on {sources[self.me]}" if self.me in sources else "local host memory",
        )

    def _disk_saves(self) -> Rollback:
        """CheckFreq and MoC: the newest checkpoint on disk that every rank completed, and older ones (newest first)."""
        root = self.persist_dir
        mine = {
            int(d.parent.name.removeprefix("window-")): d
            for d in private_subdirs(root, "window-", f"rank{self.me:05d}")
        }
        newest = self._newest_common(mine)
        if newest is None:
            return NOTHING_SAVED
        saves = [
            snapshot for start in sorted(mine, reverse=True) if start <= newest for snapshot in read_window(mine[start])
        ]
        return Rollback(newest, saves, f"disk {root}")

    def _disk_restart(self, check: CheckHeader) -> Rollback:
        """After a restart: as `_disk_saves`, over this rank's windows that are intact and of this run.
        One that is not is refused (one line) and removed, and so are the windows newer than the one
        restored (training writes them again): a later `_disk_saves` meets none of them. A window
        directory that is a symlink or not owner-only stops the run (HostMemoryError): never followed."""
        root = self.persist_dir
        loaded = {}
        for directory in private_subdirs(root, "window-", f"rank{self.me:05d}"):
            check_private(directory.parent)
            try:
                loaded[int(directory.parent.name.removeprefix("window-"))] = self._checked_window(directory, check)
            except (*UNUSABLE, KeyError, TypeError, ValueError) as e:
                print(f"restart: rank {self.me} refused {directory}: {e}; removed it", flush=True)
                remove_tree(directory, root)
        newest = self._newest_common(loaded)
        drop_newer_disk_windows(self.me, root, newest or 0)
        if newest is None:
            return NOTHING_SAVED
        saves = [snapshot for start in sorted(loaded, reverse=True) if start <= newest for snapshot in loaded[start]]
        return Rollback(newest, saves, f"disk {root}")

    def _checked_window(self, directory: Path, check: CheckHeader) -> list:
        """A disk window's snapshots, checksums verified, refused unless they are this run's and this rank's."""
        snapshots = read_window(directory)
        for header, _ in snapshots:
            check(header, str(directory))
            unknown = sorted(set(header.active) - set(self.ck.ops_by_name))
            if unknown:
                raise SnapshotError(f"{directory}: holds operators this rank does not ({', '.join(unknown[:3])})")
            if self.moc:
                self.moc.record_of(header, str(directory))
        return snapshots

    def _newest_common(self, starts) -> int | None:
        """The newest window start every rank lists (None: there is none). Collective."""
        gathered: list = [None] * self.world
        collectives.all_gather_object(gathered, sorted(starts))
        return max(set.intersection(*(set(s) for s in gathered)), default=None)

    # ---- restoring operators ------------------------------------------------------------------------

    def _restore(self, saves: Sequence) -> dict[str, int]:
        """Load each operator from its newest save (`saves` newest first); returns {operator: iteration}."""
        saved_at: dict[str, int] = {}
        for header, tensors in saves:
            for name in header.active:
                if name not in saved_at:
                    load_master(self.ck.ops_by_name[name], tensors, self.optimizer)
                    saved_at[name] = header.iteration
        never = [op for op in self.ck.ops if op.name not in saved_at]
        if never:
            reset_to_initial(never, self.optimizer, self.initial_parameters())
        return saved_at
