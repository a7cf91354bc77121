"""The interval baselines (gemini, checkfreq, moc) behind the training loop's one interface.

A checkpoint is a window of W = 1 taken every `interval` iterations by the same snapshot machinery
MoEvement uses (driven by `baselines.intervals.IntervalPolicy`); a failure rolls every rank back to
it (`baselines.global_rollback`), and MoC accounts the tokens its partial checkpoints lose.
"""

from __future__ import annotations

from baselines.global_rollback import GlobalRollback, MocState
from baselines.moc import expert_counts
from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.failures import FaultEvent
from moevement.storage.host_memory import JobLock


class IntervalBaseline:
    """`checkpoint.strategy` gemini, checkfreq or moc (see `moevement.strategy.CheckpointStrategy`)."""

    def __init__(self, checkpointer: SparseCheckpointer, rollback: GlobalRollback, moc: MocState | None, lock: JobLock):
        self.checkpointer, self.rollback, self.moc = checkpointer, rollback, moc
        self.lock = lock  # held for the process's lifetime: a second live run of the job is refused

    def resume(self, step: int, loss: float) -> tuple[int, float]:
        return step, loss  # a baseline's checkpoints belong to the run that took them: a new run starts afresh

    def begin(self, step: int) -> None:
        self.checkpointer.begin(step)

    def end(self, step: int, scalars: dict[str, float], tokens: dict, gate_probs: dict) -> None:
        self.checkpointer.end(step, scalars, tokens, gate_probs)
        if self.moc is not None:
            self.moc.lost.observe(step, expert_counts(tokens, self.moc.experts))

    def recover(self, step: int, failures: list[FaultEvent]) -> int:
        return self.rollback.recover(step, failures)  # every rank resumes at the checkpoint's iteration

    def metrics(self) -> dict[str, float]:
        out = {**self.checkpointer.metrics(), "log_mb": 0.0}
        if self.moc is not None:
            out.update(k_pec=self.moc.selector.k, plt=self.moc.plt)
        return out

    def close(self) -> dict[str, float]:
        totals = self.metrics()
        if self.moc is not None:
            totals["lost_tokens"] = self.moc.lost_tokens
        self.checkpointer.close()
        return totals

    def keep_live_state(self, next_iteration: int, detected: dict) -> int:
        return 0  # an interval baseline restarts from its own checkpoint
