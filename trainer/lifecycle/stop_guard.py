"""Where SIGTERM may stop a rank, and which state the rank then holds (docs/design/lifecycle/step.md).

- while an iteration computes (forward, backward, gradient reduction, the gradient-norm all-reduce) its
  weights and optimizer state are still `state_T`: SIGTERM stops it at once (`WorkerStopped`);
- from the optimizer step of T until the iteration is logged (`end(T)`), SIGTERM waits: the rank then
  holds `state_{T+1}` and the scalar log of T;
- before training, and after the last iteration once the job gathered its final state: SIGTERM exits at
  once (a preemption), after keeping what a survivor kept in memory;
- during a recovery it keeps nothing (its stage may be half-replayed): it counts as failed.

What SIGTERM does in each phase is `verdict.on_sigterm`'s table.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

from trainer import event_writer
from trainer.lifecycle.peer_failure import WorkerStopped
from trainer.lifecycle.process_state import ProcessState
from trainer.lifecycle.verdict import OnSigterm, on_sigterm


class StopGuard:
    """Turns SIGTERM into `WorkerStopped` at points where this rank's state is consistent.

    `phase`: "setup" (SIGTERM exits at once, as a preemption), "training", "applying" (optimizer step of
    `step` to its `end`; SIGTERM waits), "recovering", "stopping" (SIGTERM is ignored; `stopped_in` is the
    phase it stopped in). `applied`: the last iteration whose update is done. `keep_at_setup`: what a
    SIGTERM in the setup phase keeps first (a survivor's state kept in memory), returning what it kept.
    `process`: where the process records SIGTERM for its later generations' guards. `step`: the last
    iteration the rank's state has applied before training starts (a survivor's kept state: the iteration
    before its next; 0 otherwise), which a SIGTERM in the setup phase names. `preempted_line(step, kept,
    detected_unix=None)`: the `preempted:` line (a `SurvivorLine`), printed and recorded (`event_writer.say`)."""

    def __init__(self, rank: int, preempted_line, process: ProcessState, keep_at_setup=None, step: int = 0):
        self.rank, self.preempted_line, self.keep_at_setup = rank, preempted_line, keep_at_setup
        self.phase, self.stopped_in, self.step, self.applied = "setup", "", step, step
        self.process, self.sigterm_at = process, None
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if process.sigterm_at is not None:  # torchrun stopped the job while the previous generation was left
            self._on_sigterm(signal.SIGTERM, None)

    def stop(self) -> None:
        """The rank stops training now (an error or SIGTERM); later signals only wait for its exit."""
        if self.phase != "stopping":
            self.stopped_in, self.phase = self.phase, "stopping"

    def _on_sigterm(self, signum, _frame) -> None:
        self.sigterm_at = self.sigterm_at or time.time()
        self.process.sigterm_at = self.process.sigterm_at or self.sigterm_at
        action = on_sigterm(self.phase)
        if action is OnSigterm.STOP:
            self.stop()
            raise WorkerStopped("SIGTERM from the torchrun agent")
        if action is OnSigterm.EXIT:
            kept = self.keep_at_setup() if self.keep_at_setup else "nothing new to keep"
            event_writer.say(self.preempted_line(self.step, kept))
            os._exit(128 + signum)

    def optimizer_step_begins(self, *_args) -> None:
        """Optimizer step pre-hook: from here until `applied`, the update of `step` must complete."""
        if self.phase == "training":
            self.phase = "applying"

    def done(self, step: int) -> None:
        """Iteration `step` is applied and logged; a SIGTERM that arrived meanwhile stops the rank now."""
        self.phase, self.applied = "training", step
        if self.sigterm_at is not None:
            self.stop()
            raise WorkerStopped("SIGTERM from the torchrun agent")

    @contextmanager
    def recovering(self):
        self.phase = "recovering"
        try:
            yield
        finally:
            self.phase = "training"
