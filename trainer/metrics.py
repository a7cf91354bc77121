"""Console lines, progress bar and TensorBoard scalars (rank 0 only)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from trainer.config import Config


class MetricsLogger:
    """Prints the `step=` lines checks parse and mirrors them to TensorBoard."""

    def __init__(self, cfg: Config, rank: int, first_step: int):
        self.enabled = rank == 0
        self.log_every = cfg.metrics.log_every
        show_bar = self.enabled and cfg.metrics.progress and sys.stderr.isatty()
        self.bar = tqdm(
            total=cfg.training.steps, initial=first_step - 1, disable=not show_bar, dynamic_ncols=True, unit="step"
        )
        self.writer = None
        if self.enabled and cfg.metrics.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = Path(cfg.job.output_dir) / cfg.job.name / "tb"
            self.writer = SummaryWriter(log_dir=str(log_dir))

    def line(self, text: str) -> None:
        if self.enabled:
            if self.bar.disable:
                print(text, flush=True)
            else:
                self.bar.write(text)

    def step(self, step: int, scalars: dict[str, float], expert_load: dict[str, torch.Tensor]) -> None:
        """Log iteration `step` (1-based): `step=<n> loss=<float> key=value ...`."""
        if not self.enabled:
            return
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{scalars['loss']:.4f}")
        if step % self.log_every == 0:
            fields = " ".join(f"{k}={_fmt(v)}" for k, v in scalars.items())
            self.line(f"step={step} {fields}")
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(f"train/{key}", value, step)
            for layer, counts in expert_load.items():
                self.writer.add_histogram(f"expert_load/{layer}", counts.float(), step)

    def validation(self, step: int, loss: float) -> None:
        if self.enabled:
            self.line(f"validation step={step} val_loss={loss:.6f}")
            if self.writer is not None:
                self.writer.add_scalar("val/loss", loss, step)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.6f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
