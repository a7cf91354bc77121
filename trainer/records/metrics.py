"""Console lines and progress bar (rank 0), the run record's events (trainer/records/event_log.py: every rank
records its own), TensorBoard events (rank 0 writes, every rank contributes).

Every iteration is logged once: its `step` record, its `step=` line (every `metrics.log_every`) and its
TensorBoard `train/` point come from the first process that logs it after it is done, whoever dies. Rank 0
logs each iteration as it completes it; an iteration run again (a rollback's, a restart's from an older
window) is not logged again. After a recovery, a rank 0 that continues a run folder reads the newest
iteration the records hold and logs, from the scalars the checkpoint strategy kept, the iterations done
before the recovery that no process logged (rank 0 died after the survivors finished them): `catch_up`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from moevement.recovery.report import RecoveryFigures
from trainer import event_writer
from trainer.config import Config
from trainer.event_writer import Event
from trainer.flops import device_peak_flops, flops_per_token, step_throughput
from trainer.records import event_log
from trainer.records.event_lines import StepLine, ValidationLine
from trainer.records.tensorboard import StageGather, TensorBoardEvents

TRAINING_SCALARS = ("loss", "aux_loss", "lr", "grad_norm")  # a step line's first fields, in a late line too


class MetricsLogger:
    """Logs each iteration once (module docstring) and prints rank 0's lines; records every event line it
    prints where this process records events (`event_writer.record_events_in`).

    `run_dir` (rank 0's run folder, None elsewhere) receives the TensorBoard events; `continued` when it
    continues an earlier generation's folder, whose newest logged iteration is then read from its records.
    `device`: where this rank computes (the peak its MFU divides by, `trainer.flops.device_peak_flops`).
    Training thread only, but `line`, which a periodic save's background thread calls too (a lock keeps each
    line and its record whole)."""

    def __init__(
        self,
        cfg: Config,
        rank: int,
        stage: int,
        run_dir: Path | None,
        continued: bool = False,
        device: torch.device | None = None,
    ):
        self.cfg, self.stage = cfg, stage
        t = cfg.training
        self.flops_per_step = flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
        self.peak = device_peak_flops(device or torch.device("cpu"), cfg.metrics.peak_tflops)
        self.run_dir, self.continued = run_dir, continued
        self.enabled = rank == 0
        self.log_every = cfg.metrics.log_every
        self.bar = tqdm(disable=True)  # until `start`: lines printed before go straight to stdout
        self.events = None
        # the newest iteration logged (rank 0): the records' in a continued folder, else known at `start`
        self.logged = event_log.last_step(run_dir) if continued and run_dir is not None else None
        self.lock = threading.Lock()  # `line` from the training thread and a background save's

    def start(self, first_step: int) -> None:
        """Training starts (or resumes) at iteration `first_step`: the progress bar and TensorBoard begin. A
        continued folder's TensorBoard events from the first iteration not logged yet on are dropped
        (TensorBoard's purge): a point its writer left without a record is written again."""
        cfg = self.cfg
        if self.logged is None:
            self.logged = first_step - 1
        show_bar = self.enabled and cfg.metrics.progress and sys.stderr.isatty()
        self.bar = tqdm(
            total=cfg.training.steps,
            initial=first_step - 1,
            disable=not show_bar,
            dynamic_ncols=True,
            desc="train",
            unit="step",
        )
        if cfg.metrics.tensorboard:
            gather = StageGather(cfg.model.n_layers, cfg.model.n_routed_experts, cfg.parallelism.pp, self.stage)
            self.events = TensorBoardEvents(
                self.run_dir if self.enabled else None,
                self.logged + 1 if self.continued else None,
                cfg.metrics.tensorboard_every,
                gather,
                snapshots=cfg.checkpoint.strategy != "none",
            )

    def line(self, out: str | Event, every_rank: bool = False) -> None:
        """Print `out`: on rank 0, or on any rank with `every_rank` (a dying rank's `fault:` line). An event (a
        `fault`, `recovery`, `recovery work`, `final` line...: `line()` and `record()`) is first recorded where
        this process records events, so a printed line always has its record."""
        if not (self.enabled or every_rank):
            return
        with self.lock:
            if not isinstance(out, str):
                event_writer.record(out)
                out = out.line()
            self._print(out)

    def _print(self, text: str) -> None:
        if self.bar.disable:
            print(text, flush=True)
        else:
            self.bar.write(text)

    def step(
        self,
        step: int,
        scalars: dict[str, float],
        snapshot: dict[str, float],
        tokens: dict[str, torch.Tensor],
        elapsed_s: float,
        wall_s: float,
    ) -> None:
        """Log iteration `step` (1-based), which took `elapsed_s`, `wall_s` into the run, unless it was logged
        before: its `step` record and `step=<n> loss=<float> ...` line with the training scalars, this rank's
        snapshot figures, `tok_per_s`, `tflops` (model TFLOP/s per device), `mfu` (only where the device's
        peak is known) and `wall_s` (last: checks read the line's end). Every rank calls it (the TensorBoard
        gather is collective, and runs after the iteration is logged: a peer's death there loses no line)."""
        t, p = self.cfg.training, self.cfg.parallelism
        throughput = step_throughput(self.flops_per_step, elapsed_s, p.pp * p.dp, self.peak)
        rates = {"tok_per_s": t.batch_size * t.seq_len / elapsed_s, **throughput, "wall_s": wall_s}
        fresh = self.logged is None or step > self.logged
        if self.enabled and fresh:
            self._log(StepLine(step, tuple({**scalars, **snapshot, **rates}.items())), {**scalars, **rates})
        if self.events is not None:
            self.events.gather(step, tokens, snapshot, write=fresh)
        if self.enabled:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{scalars['loss']:.4f}")

    def _log(self, line: StepLine, tensorboard: dict[str, float]) -> None:
        """Rank 0 logs an iteration: TensorBoard first, then its record, then (every `log_every`) its line."""
        if self.events is not None:
            self.events.scalars(line.step, tensorboard)
        event_writer.record(line)
        self.logged = line.step
        if line.step % self.log_every == 0:
            self._print(line.line())

    def catch_up(self, done: int, logged_scalars: Callable[[int], dict[int, dict[str, float]]]) -> None:
        """Rank 0, after `start` and a recovery: iterations 1..`done` are done. Log those after the newest
        logged one, each as a `late` line of the scalars `logged_scalars(first)` returns (the strategy's log
        from iteration `first` on): rank 0 died after the survivors finished them. One line names those
        whose scalars are not kept (they stay unlogged)."""
        if not self.enabled or done <= self.logged:
            return
        kept = logged_scalars(self.logged + 1)
        missing = [step for step in range(self.logged + 1, done + 1) if step not in kept]
        for step in range(self.logged + 1, done + 1):
            if step in kept:
                values = {k: float(kept[step][k]) for k in TRAINING_SCALARS if k in kept[step]}
                self._log(StepLine(step, tuple(values.items()), late=True), values)
        if missing:
            self._print(f"log: iterations {missing[0]}-{missing[-1]} were done but never logged (no scalars kept)")
        self.logged = done

    def recovery(self, figures: RecoveryFigures | None) -> None:
        """A recovery is done (its line is printed): its figures go to TensorBoard (rank 0 writes them)."""
        if self.events is not None and figures is not None:
            self.events.recovery(figures)

    def validation(self, step: int, loss: float) -> None:
        """The validation loss after iteration `step`: rank 0's line and record (each time one runs: a
        validation run again after a recovery is logged again, on the state training goes on from), and its
        TensorBoard point."""
        if self.enabled:
            self.line(ValidationLine(step, loss))
        if self.events is not None:
            self.events.validation(step, loss)

    def close(self) -> None:
        self.bar.close()
        if self.events is not None:
            self.events.close()
