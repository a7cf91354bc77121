"""TensorBoard events of a run, written by rank 0 into the run folder, with every pipeline stage's figures.

Every iteration, once (the first time it is done: trainer/records/metrics.py): rank 0's `train/` scalars (loss,
lr, ...: the same on every rank). Every
`metrics.tensorboard_every` iterations, one small all-reduce over all ranks brings rank 0 each stage's
expert load since the last gather (written as a layers x experts heatmap and one max/mean scalar per MoE
layer), each stage's snapshot figures (`snapshot/pp<r>/<figure>` at that iteration, the largest over
the ranks of pipeline rank r; `host_mb` is the host memory its snapshot buffers and replicas hold) and
each stage's memory (`memory/pp<r>/rss_mb` and `peak_rss_mb`: the resident set of its largest rank at that
iteration, and the largest peak so far; on CUDA `cuda_max_allocated_mb`, the allocator's peak so far).

At the iteration each recovery struck before, rank 0 writes its `fault/` figures (`ranks_failed`,
`scope_ranks`, `rollback_to`, `replayed`, `recovery_s`): a loss curve shows where failures struck.
"""

from __future__ import annotations

import os
import re
import resource
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moevement.recovery.report import RecoveryFigures
from parallelisms import collectives

SNAPSHOT_FIGURES = ("ckpt_mb", "stall_ms", "window", "repl_lag", "host_mb", "log_mb")
MEMORY_FIGURES = ("rss_mb", "peak_rss_mb", "cuda_max_allocated_mb")
STAGE_FIGURES = (*SNAPSHOT_FIGURES, *MEMORY_FIGURES)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(module_name: str) -> int | None:
    """The global decoder-layer index in a module name (`layers.3.moe` -> 3)."""
    m = _LAYER.search(module_name + ".")
    return int(m[1]) if m else None


def host_memory_mb() -> dict[str, float]:
    """This process's resident set now and its peak so far, in MB (1e6 bytes), from Linux's
    ``/proc/self/statm`` and ``getrusage`` (pages of mapped shared-memory snapshots it touched included)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    rss = resident_pages * os.sysconf("SC_PAGE_SIZE")
    # KiB on Linux; the kernel's two counts may disagree by a few pages (per-CPU counters): a peak is >= now
    peak = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"rss_mb": rss / 1e6, "peak_rss_mb": peak / 1e6}


def device_memory_mb() -> dict[str, float]:
    """The most CUDA memory this process's tensors have held so far on its device, in MB: the caching
    allocator's counter (no synchronisation); nothing without CUDA."""
    if not torch.cuda.is_available():
        return {}
    return {"cuda_max_allocated_mb": torch.cuda.max_memory_allocated() / 1e6}


class StageGather:
    """Every rank's contribution to one gather: its MoE layers' token counts (dp-global already, so every
    rank of a stage holds the same rows), its stage's snapshot figures and its own host memory; an
    all-reduce (max) joins them.

    The counts are summed where the model puts them (its device: no copy to the host per iteration) and
    reach the host once per gather, where the all-reduce of this small CPU tensor runs."""

    def __init__(self, n_layers: int, n_experts: int, n_stages: int, stage: int):
        self.n_layers, self.n_experts, self.n_stages, self.stage = n_layers, n_experts, n_stages, stage
        self.tokens: torch.Tensor | None = None  # [layers, experts] float64 on the counts' device, from the first add
        self.first_step: int | None = None

    def add(self, step: int, tokens: dict[str, torch.Tensor]) -> None:
        """Count iteration `step`'s routed tokens (by MoE module name)."""
        if self.first_step is None:
            self.first_step = step
        for name, counts in tokens.items():
            index = layer_index(name)
            if index is not None:
                if self.tokens is None:
                    self.tokens = torch.zeros(self.n_layers, self.n_experts, dtype=torch.float64, device=counts.device)
                self.tokens[index] += counts.to(torch.float64)

    def gather(self, owned: set[int], figures: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token counts [layers, experts], whether each layer is a MoE layer of some stage [layers],
        stage figures [stages, STAGE_FIGURES]) over all ranks (collective); resets the counts."""
        moe = torch.zeros(self.n_layers, dtype=torch.float64)
        moe[sorted(owned)] = 1.0
        figures = {**figures, **host_memory_mb(), **device_memory_mb()}
        snapshot = torch.zeros(self.n_stages, len(STAGE_FIGURES), dtype=torch.float64)
        snapshot[self.stage] = torch.tensor([float(figures.get(k, 0.0)) for k in STAGE_FIGURES])
        tokens = torch.zeros(self.n_layers, self.n_experts, dtype=torch.float64)
        if self.tokens is not None:
            tokens.copy_(self.tokens)  # the one device-to-host copy of the gather
            self.tokens.zero_()
        flat = torch.cat([tokens.flatten(), moe, snapshot.flatten()])
        collectives.all_reduce(flat, op=dist.ReduceOp.MAX)
        n = self.n_layers * self.n_experts
        self.first_step = None
        return flat[:n].view(self.n_layers, self.n_experts), flat[n : n + self.n_layers] > 0, flat[n + self.n_layers :]


def heatmap_image(tokens: torch.Tensor, layers: list[int], title: str) -> np.ndarray:
    """RGB [H, W, 3] uint8: each MoE layer's share of routed tokens per expert (1/E is a perfect balance)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    share = tokens / tokens.sum(dim=1, keepdim=True).clamp(min=1)
    n_experts = tokens.shape[1]
    fig = Figure(figsize=(min(4 + 0.2 * n_experts, 16), min(2 + 0.25 * len(layers), 12)), dpi=100)
    ax = fig.add_subplot()
    image = ax.imshow(share.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(layers)), [str(i) for i in layers])
    ax.set_xlabel("routed expert")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label=f"share of tokens (even: 1/{n_experts})")
    fig.tight_layout()
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


class TensorBoardEvents:
    """Rank 0's writer (None elsewhere) plus every rank's part of the periodic gather."""

    def __init__(self, log_dir: Path | None, purge_step: int | None, every: int, gather: StageGather, snapshots: bool):
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        self.every, self.stage_gather, self.snapshots = every, gather, snapshots

    def scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Rank 0 writes iteration `step`'s `train/` scalars, flushed before the caller records the iteration as
        logged (a process killed in between leaves the point, which the next writer's purge replaces)."""
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(f"train/{key}", value, step)
            self.writer.flush()

    def gather(self, step: int, tokens: dict, snapshot: dict[str, float], write: bool = True) -> None:
        """Iteration `step` is done on every rank: count its routed tokens; every `every` iterations every rank
        takes part in the gather (collective) and rank 0 writes it, unless `write` is false (an iteration run
        again, logged before)."""
        self.stage_gather.add(step, tokens)
        if step % self.every == 0:
            first = self.stage_gather.first_step
            owned = {i for i in map(layer_index, tokens) if i is not None}
            counts, moe, figures = self.stage_gather.gather(owned, snapshot)
            if self.writer is not None and write:
                self._write_gathered(first, step, counts, moe, figures)
                self.writer.flush()

    def _write_gathered(self, first: int, step: int, counts: torch.Tensor, moe, figures: torch.Tensor) -> None:
        layers = [i for i in range(len(moe)) if moe[i]]
        if layers:
            rows = counts[layers]
            for i, row in zip(layers, rows):
                mean = float(row.mean())
                imbalance = float(row.max()) / mean if mean else 0.0
                self.writer.add_scalar(f"expert_load/layer_{i}_max_over_mean", imbalance, step)
            title = f"tokens per expert, iterations {first}-{step}"
            self.writer.add_image("expert_load/heatmap", heatmap_image(rows, layers, title), step, dataformats="HWC")
        for stage, row in enumerate(figures.view(-1, len(STAGE_FIGURES)).tolist()):
            for key, value in zip(STAGE_FIGURES, row):
                if key == "cuda_max_allocated_mb" and not torch.cuda.is_available():
                    continue
                if key in MEMORY_FIGURES:
                    self.writer.add_scalar(f"memory/pp{stage}/{key}", value, step)
                elif self.snapshots:
                    self.writer.add_scalar(f"snapshot/pp{stage}/{key}", value, step)

    def recovery(self, figures: RecoveryFigures) -> None:
        """Rank 0 writes a recovery's `fault/` figures at the iteration the failures struck before."""
        if self.writer is None:
            return
        values = {
            "ranks_failed": len(figures.ranks),
            "scope_ranks": figures.scope_ranks,
            "rollback_to": figures.rollback_to,
            "replayed": figures.replayed,
            "recovery_s": figures.seconds,
        }
        for key, value in values.items():
            self.writer.add_scalar(f"fault/{key}", value, figures.step)
        self.writer.flush()

    def validation(self, step: int, loss: float) -> None:
        if self.writer is not None:
            self.writer.add_scalar("val/loss", loss, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
