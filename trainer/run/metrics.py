"""Console lines and progress bar (rank 0), the run record's events.jsonl (rank 0), TensorBoard events (rank 0
writes, every rank contributes)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
from tqdm import tqdm

from moevement.recovery.report import RecoveryFigures
from trainer.config import Config
from trainer.flops import device_peak_flops, flops_per_token, step_throughput
from trainer.run.event_log import Event, append_event
from trainer.run.tensorboard import StageGather, TensorBoardEvents


class MetricsLogger:
    """Prints the `step=` lines checks parse and mirrors them to TensorBoard; records the event lines (`line`).

    `run_dir` (rank 0's run folder, None elsewhere) receives the events; `continued` when it continues an
    earlier torchrun attempt's folder, whose events from the first iteration this process runs on are
    then dropped (TensorBoard's purge). `device`: where this rank computes (the peak its MFU divides by,
    `trainer.flops.device_peak_flops`). Training thread only, but `line`, which a periodic save's background
    thread calls too (a lock keeps each line and its record whole)."""

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
        self.lock = threading.Lock()  # `line` from the training thread and a background save's

    def start(self, first_step: int) -> None:
        """Training starts (or resumes) at iteration `first_step`: the progress bar and TensorBoard begin."""
        cfg = self.cfg
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
                first_step if self.continued else None,
                cfg.metrics.tensorboard_every,
                gather,
                snapshots=cfg.checkpoint.strategy != "none",
            )

    def line(self, out: str | Event, every_rank: bool = False) -> None:
        """Print `out`: on rank 0, or on any rank with `every_rank` (a dying rank's `fault:` line). An event (a
        `recovery`, `recovery work`, `fault` or `final` line: `line()` and `record()`) is first appended to the
        run's events.jsonl where this process keeps the run record (rank 0), so a printed line always has its
        record. Another rank's event stays printed only: rank 0 could record it only through a collective, and
        a rank that is about to kill itself holds none."""
        if not (self.enabled or every_rank):
            return
        with self.lock:
            if isinstance(out, str):
                text = out
            else:
                text = out.line()
                if self.run_dir is not None:
                    self._record(out)
            if self.bar.disable:
                print(text, flush=True)
            else:
                self.bar.write(text)

    def _record(self, event: Event) -> None:
        """Append `event`'s record; a run folder that cannot take it costs the record, not the run (one line)."""
        try:
            append_event(self.run_dir, event)
        except OSError as e:
            print(f"run record: {self.run_dir}: cannot record the event ({e}); it is printed only", flush=True)

    def step(
        self,
        step: int,
        scalars: dict[str, float],
        snapshot: dict[str, float],
        tokens: dict[str, torch.Tensor],
        elapsed_s: float,
        wall_s: float,
    ) -> None:
        """Log iteration `step` (1-based), which took `elapsed_s`, `wall_s` into the run:
        `step=<n> loss=<float> ...` with the training scalars, this rank's snapshot figures, `tok_per_s`,
        `tflops` (model TFLOP/s per device), `mfu` (only where the device's peak is known) and `wall_s` (last:
        checks read the line's end). Every rank calls it (the TensorBoard gather is collective)."""
        t, p = self.cfg.training, self.cfg.parallelism
        throughput = step_throughput(self.flops_per_step, elapsed_s, p.pp * p.dp, self.peak)
        rates = {"tok_per_s": t.batch_size * t.seq_len / elapsed_s, **throughput, "wall_s": wall_s}
        if self.events is not None:
            self.events.step(step, {**scalars, **rates}, tokens, snapshot)
        if not self.enabled:
            return
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{scalars['loss']:.4f}")
        if step % self.log_every == 0:
            fields = " ".join(f"{k}={_fmt(v)}" for k, v in {**scalars, **snapshot, **rates}.items())
            self.line(f"step={step} {fields}")

    def recovery(self, figures: RecoveryFigures | None) -> None:
        """A recovery is done (its line is printed): its figures go to TensorBoard (rank 0 writes them)."""
        if self.events is not None and figures is not None:
            self.events.recovery(figures)

    def validation(self, step: int, loss: float) -> None:
        if self.enabled:
            self.line(f"validation step={step} val_loss={loss:.6f}")
        if self.events is not None:
            self.events.validation(step, loss)

    def close(self) -> None:
        self.bar.close()
        if self.events is not None:
            self.events.close()


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.6f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
