"""The one interface the training loop talks to, and MoEvement's implementation of it.

Per run, the loop calls `resume` once after building the model, then per iteration t: `recover(t, ...)`
when failures strike before t (and `last_recovery()` for its figures), `begin(t)` before the forward
pass, `end(t, ...)` after the optimizer step, `metrics()` for the step line; at the end `close()`. When
the rank is stopped because another worker died (or the job is stopped), `keep_live_state(t)` saves what
a torchrun restart resumes from. Every checkpoint strategy (`none`, MoEvement, and the baselines in
`baselines/`) implements `CheckpointStrategy`; nothing else of a strategy is reached from the loop.
"""

from __future__ import annotations

from typing import Protocol

from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.checkpoint.planner import WindowInputs
from moevement.failures import FaultEvent
from moevement.recovery.live_state import LiveState, keep_in_memory, save_kept
from moevement.recovery.localized import Recovery, Rejoin
from moevement.recovery.report import RecoveryFigures
from moevement.recovery.restart import RestartPoint
from moevement.recovery.start_source import Source
from moevement.recovery.upstream_log import UpstreamLog
from moevement.storage.host_memory import JobLock


class CheckpointStrategy(Protocol):
    def resume(self, step: int, loss: float) -> tuple[int, float]:
        """`state_{step+1}` is loaded (`step` = 0, or a dense checkpoint's step, whose loss was `loss`); returns
        the last iteration done and its loss once the strategy restored from the source the start-source
        table chose for it (`moevement/recovery/start_source.py`; training goes on after it)."""
        ...

    def begin(self, step: int) -> None:
        """Iteration `step` starts (its snapshot, if any, is of `state_step`)."""
        ...

    def end(self, step: int, scalars: dict[str, float], tokens: dict, gate_probs: dict) -> None:
        """Iteration `step` is done; `scalars` (lr, clip coefficient, ...) are what a replay of it needs."""
        ...

    def recover(self, step: int, failures: list[FaultEvent]) -> int:
        """`failures` strike before iteration `step`; returns the iteration training goes on with."""
        ...

    def last_recovery(self) -> RecoveryFigures | None:
        """The figures of this rank's newest `recover` (None before any): read by the loop right after it."""
        ...

    def metrics(self) -> dict[str, float]:
        """Columns of the step line (`ckpt_mb`, `stall_ms`, `host_mb`, ...)."""
        ...

    def logged_scalars(self, first: int) -> dict[int, dict[str, float]]:
        """The scalars `end` logged (or a recovery brought back) of iterations `first` on, that this rank holds:
        rank 0 logs from them the iterations done before a recovery that no step line logged."""
        ...

    def close(self) -> dict[str, float]:
        """Drain background work and release host state; returns the run's totals for the accounting line."""
        ...

    def keep_live_state(self, next_iteration: int, detected: dict) -> int:
        """This rank stops (another worker died): keep `state_{next_iteration}` for the restarted process,
        if the strategy can use it; returns the bytes kept."""
        ...

    def keep_in_memory(self, next_iteration: int, detected: dict) -> LiveState | None:
        """Another worker died and is replaced in place: `state_{next_iteration}` and the logs this rank's
        next generation starts from, kept in this process (None: the strategy does not rejoin in place)."""
        ...

    def abandon(self) -> None:
        """This rank leaves its generation (another worker died): end background work without waiting on
        peers and release host state without removing it; the next generation builds a new strategy (and
        keeps the process's job lock)."""
        ...


class NoCheckpointing:
    """`checkpoint.strategy = "none"`: the fault-free reference (the config refuses failures with it)."""

    def resume(self, step: int, loss: float) -> tuple[int, float]:
        return step, loss

    def begin(self, step: int) -> None:
        pass

    def end(self, step: int, scalars: dict[str, float], tokens: dict, gate_probs: dict) -> None:
        pass

    def recover(self, step: int, failures: list[FaultEvent]) -> int:
        raise RuntimeError("checkpoint.strategy 'none' cannot recover from a failure")

    def last_recovery(self) -> RecoveryFigures | None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def logged_scalars(self, first: int) -> dict[int, dict[str, float]]:
        return {}

    def close(self) -> dict[str, float]:
        return {}

    def keep_live_state(self, next_iteration: int, detected: dict) -> int:
        return 0

    def keep_in_memory(self, next_iteration: int, detected: dict) -> LiveState | None:
        return None

    def abandon(self) -> None:
        pass


class MoEvement:
    """Sparse checkpointing, upstream logs at pipeline boundaries, localized recovery (docs/design/recovery.md)."""

    def __init__(
        self,
        checkpointer: SparseCheckpointer,
        log: UpstreamLog | None,
        recovery: Recovery,
        lock: JobLock,
        source: Source = Source.INITIAL,
        found: RestartPoint | None = None,
        rejoin: Rejoin | None = None,
    ):
        self.checkpointer, self.log, self.recovery = checkpointer, log, recovery
        self.source = source  # where this rank's state comes from (moevement/recovery/start_source.py)
        self.found = found  # a persisted (or re-laid) sparse window of this job to restart from
        self.rejoin = rejoin  # after a torchrun restart with survivors: who kept what, and this generation's name
        self.history_from = 1  # first iteration whose boundary and scalar logs this process holds
        self.lock = lock  # held for the process's lifetime: a second live run of the job is refused
        self.leftovers = True  # the rank directory may hold earlier processes' state until training goes on

    def resume(self, step: int, loss: float) -> tuple[int, float]:
        """Restores from the start's source: survivors' live state (the other stages replay to it), a
        persisted or re-laid window (converted), else `step` (the dense checkpoint or the initial state). A
        restart keeps the window it restarted from as its persisted checkpoint, so that another death before
        the job persists a window of its own recovers from there."""
        found, self.found = self.found, None
        if self.source is Source.LIVE_STATE:  # the dead ranks' stages caught up
            resumed, self.history_from = self.recovery.rejoin(found, self.rejoin)
        elif self.source in (Source.PERSISTED_WINDOW, Source.RELAID_WINDOW):  # state_{t0+W} is current
            resumed, self.history_from = self.recovery.restart(found), found.window_start
        else:
            resumed = self.history_from = step + 1
        if found is not None:
            self.checkpointer.adopt(found.window_index, found.snapshots)
        if resumed - 1 == step:
            return step, loss
        logged = self.checkpointer.persisted.scalars_since(resumed - 1).get(resumed - 1, {})
        return resumed - 1, logged.get("loss", float("nan"))  # the final line's loss if nothing is left to train

    def planned_window(self) -> WindowInputs | None:
        """What Algorithm 1 last planned a window with (`metrics.profile`; None: no window was planned)."""
        return self.checkpointer.planner.last_inputs

    def begin(self, step: int) -> None:
        if self.leftovers:  # from here on a stop keeps this process's own live state
            self.checkpointer.drop_leftovers()
            self.leftovers = False
        if self.log is not None:
            self.log.collect_garbage(self.checkpointer.persisted.rollback_point())
            self.log.begin(step)
        self.checkpointer.begin(step)

    def end(self, step: int, scalars: dict[str, float], tokens: dict, gate_probs: dict) -> None:
        self.checkpointer.end(step, scalars, tokens, gate_probs)

    def recover(self, step: int, failures: list[FaultEvent]) -> int:
        self.recovery.recover(step, failures)
        return step  # the failed stages caught up in place: iteration `step` runs next on every rank

    def last_recovery(self) -> RecoveryFigures | None:
        return self.recovery.figures

    def metrics(self) -> dict[str, float]:
        return {**self.checkpointer.metrics(), "log_mb": self.log.nbytes() / 1e6 if self.log else 0.0}

    def logged_scalars(self, first: int) -> dict[int, dict[str, float]]:
        return self.checkpointer.persisted.scalars_since(first)

    def close(self) -> dict[str, float]:
        totals = self.metrics()
        self.checkpointer.close()
        return totals

    def keep_live_state(self, next_iteration: int, detected: dict) -> int:
        return save_kept(self.checkpointer.rank_dir, self.keep_in_memory(next_iteration, detected))

    def keep_in_memory(self, next_iteration: int, detected: dict) -> LiveState:
        ck, log_from = self.checkpointer, self._log_from()
        scalars = ck.persisted.scalars_since(log_from)
        meta = self._live_meta()
        return keep_in_memory(ck.ops, ck.optimizer, self.log, scalars, next_iteration, log_from, detected, meta)

    def _log_from(self) -> int:
        """The first iteration whose logs a kept state carries: the rollback point's, if this process holds them."""
        return max(self.checkpointer.persisted.rollback_point(), self.history_from)

    def _live_meta(self) -> dict:
        ck = self.checkpointer
        return {**ck.job_meta, **(self.rejoin.name if self.rejoin else {}), "rank": ck.topology.rank}

    def abandon(self) -> None:
        self.checkpointer.abandon()
