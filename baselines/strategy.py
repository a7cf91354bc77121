"""The interval baselines (gemini, checkfreq, moc) behind the training loop's one interface.

A checkpoint is a window of W = 1 taken every `interval` iterations by the same snapshot machinery
MoEvement uses (driven by `baselines.intervals.IntervalPolicy`); a failure rolls every rank back to
it (`baselines.global_rollback`), and MoC accounts the tokens its partial checkpoints lose. A real
death under torchrun does the same once the job has restarted (`GlobalRollback.restart`).
"""

from __future__ import annotations

import time

from baselines.global_rollback import GlobalRollback, MocState, RestartState
from baselines.moc import expert_counts
from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.failures import FaultEvent
from moevement.recovery.live_state import LiveState, Rejoin, save_kept
from moevement.recovery.report import RecoveryFigures
from moevement.storage.host_memory import JobLock


class IntervalBaseline:
    """`checkpoint.strategy` gemini, checkfreq or moc (see `moevement.strategy.CheckpointStrategy`).

    `restart`: set after a death in this run (a torchrun restart or an in-place replacement), None for a new
    run."""

    def __init__(
        self,
        checkpointer: SparseCheckpointer,
        rollback: GlobalRollback,
        moc: MocState | None,
        lock: JobLock,
        rejoin: Rejoin,
        restart: RestartState | None = None,
    ):
        self.checkpointer, self.rollback, self.moc = checkpointer, rollback, moc
        self.lock = lock  # held for the process's lifetime: a second live run of the job is refused
        self.rejoin, self.restart = rejoin, restart

    def resume(self, step: int, loss: float) -> tuple[int, float]:
        """A new run starts at `step + 1`; a restarted one at its newest complete checkpoint (training goes
        on from there, so the loss of the iteration before it is not needed)."""
        restart, self.restart = self.restart, None
        return (step, loss) if restart is None else (self.rollback.restart(restart) - 1, float("nan"))

    def begin(self, step: int) -> None:
        self.checkpointer.begin(step)
        meta = self.checkpointer.snapshot_meta()
        if self.moc is not None and meta is not None:
            meta["moc"] = self.moc.checkpointed(step)

    def end(self, step: int, scalars: dict[str, float], tokens: dict, gate_probs: dict) -> None:
        self.checkpointer.end(step, scalars, tokens, gate_probs)
        if self.moc is not None:
            self.moc.lost.observe(step, expert_counts(tokens, self.moc.experts))

    def recover(self, step: int, failures: list[FaultEvent]) -> int:
        return self.rollback.recover(step, failures)  # every rank resumes at the checkpoint's iteration

    def last_recovery(self) -> RecoveryFigures | None:
        return self.rollback.figures

    def metrics(self) -> dict[str, float]:
        out = {**self.checkpointer.metrics(), "log_mb": 0.0}
        if self.moc is not None:
            out.update(k_pec=self.moc.selector.k, plt=self.moc.plt)
        return out

    def logged_scalars(self, first: int) -> dict[int, dict[str, float]]:
        return self.checkpointer.persisted.scalars_since(first)

    def close(self) -> dict[str, float]:
        totals = self.metrics()
        if self.moc is not None:
            totals["lost_tokens"] = self.moc.lost_tokens
        self.checkpointer.close()
        return totals

    def keep_live_state(self, next_iteration: int, detected: dict) -> int:
        """Another worker died: let the disk writes in flight land, then leave a survival marker (no
        tensors) that tells the restarted job this rank's process lived. Keeps no training state (0)."""
        self.checkpointer.flush_disk()
        save_kept(self.checkpointer.rank_dir, self.keep_in_memory(next_iteration, detected))
        return 0

    def keep_in_memory(self, next_iteration: int, detected: dict) -> LiveState:
        """A survival marker, as `keep_live_state` leaves one: every rank rolls back to the newest checkpoint,
        so no training state is kept."""
        ck = self.checkpointer
        meta = {**ck.job_meta, **self.rejoin.name, "rank": ck.topology.rank}
        return LiveState(next_iteration, next_iteration, {}, {}, {**detected, "kept": time.time()}, meta)

    def abandon(self) -> None:
        self.checkpointer.abandon()
