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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from baselines.intervals import IntervalPolicy
from baselines.moc import LostTokens, PartialExpertSelector
from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.failures import FaultEvent
from moevement.recovery.fetch import fetch_from_replicas
from moevement.recovery.replay import load_master, reset_to_initial, wipe_operators
from moevement.storage.persistence import read_window


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


class GlobalRollback:
    def __init__(
        self,
        strategy: str,
        checkpointer: SparseCheckpointer,
        policy: IntervalPolicy,
        persist_dir: Path | None,
        optimizer,
        n_stages: int,
        initial_parameters: Callable[[], dict],
        line: Callable[[str], None],
        moc: MocState | None = None,
    ):
        self.strategy, self.ck, self.policy, self.persist_dir = strategy, checkpointer, policy, persist_dir
        self.optimizer, self.n_stages = optimizer, n_stages
        self.initial_parameters, self.line, self.moc = initial_parameters, line, moc
        self.me, self.world = dist.get_rank(), dist.get_world_size()
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
        rollback_to, saves, source = self._disk_saves() if self.from_disk else self._memory_saves(failed)
        fetched = time.perf_counter() - started
        saved_at = self._restore(saves)
        lost = self._account_lost_tokens(rollback_to, saved_at) if self.moc else ""
        self.policy.rolled_back(rollback_to)
        sources: list = [None] * self.world
        dist.all_gather_object(sources, source)
        source = "; ".join(f"rank{r}: {sources[r]}" for r in sorted(failed))
        self.line(
            f"recovery step={step} ranks={'+'.join(map(str, sorted(failed)))} scope=0-{self.n_stages - 1} "
            f"rollback_to={rollback_to} replayed={step - rollback_to} seconds={time.perf_counter() - started:.3f} "
            f"(fetch={fetched:.3f} convert=0.000 catchup=0.000) strategy={self.strategy} "
            f'snapshots_from="{source}"{lost}'
        )
        return rollback_to

    # ---- where the checkpoint comes from ------------------------------------------------------------

    def _memory_saves(self, failed: set[int]) -> tuple[int, list, str]:
        """Gemini: the newest replicated dense checkpoint in host memory (failed ranks fetch theirs)."""
        if self.ck.persisted.window is None:
            return 1, [], "none (initial state)"
        sources = fetch_from_replicas(self.ck, failed, 1)
        return (
            self.ck.persisted.rollback_point(),
            [self.ck.persisted.snapshot(0, verify=True)],
            f"replica on {sources[self.me]}" if self.me in sources else "local host memory",
        )

    def _disk_saves(self) -> tuple[int, list, str]:
        """CheckFreq and MoC: the newest checkpoint on disk that every rank completed, and older ones (newest first)."""
        root = self.persist_dir
        mine = {int(d.parent.name.removeprefix("window-")): d for d in root.glob(f"window-*/rank{self.me:05d}")}
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, sorted(mine))
        common = set.intersection(*(set(starts) for starts in gathered))
        if not common:
            return 1, [], "none (initial state)"
        newest = max(common)
        saves = [
            snapshot for start in sorted(mine, reverse=True) if start <= newest for snapshot in read_window(mine[start])
        ]
        return newest, saves, f"disk {root}"

    # ---- restoring operators ------------------------------------------------------------------------

    def _restore(self, saves: list) -> dict[str, int]:
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

    def _account_lost_tokens(self, rollback_to: int, saved_at: dict[str, int]) -> str:
        """MoC: tokens whose expert updates the stale restore lost; K_pec doubles when PLT passes the threshold."""
        moc = self.moc
        lost, processed = moc.lost.account(rollback_to, saved_at)
        counts = torch.tensor([lost, processed] if moc.count_tokens else [0.0, 0.0], dtype=torch.float64)
        dist.all_reduce(counts)
        moc.lost_tokens += float(counts[0])
        moc.plt = moc.lost_tokens / float(counts[1]) if counts[1] > 0 else 0.0  # over the run so far
        if moc.plt > moc.plt_threshold:
            moc.selector.double()
        return f" lost_tokens={float(counts[0]):.0f} plt={moc.plt:.4f} k_pec={moc.selector.k}"
