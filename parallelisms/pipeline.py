"""Pipeline parallelism with `torch.distributed.pipelining`, TorchTitan-style.

The model is cut into `pp * stages_per_rank` stages of contiguous layers (embedding on
the first, norm + head on the last) by deleting what a stage does not own, so every
parameter keeps its global name. Stage `s` lives on pipeline rank `s % pp` (loop order).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from parallelisms.mesh import ParallelDims, ParallelismConfig

SCHEDULE_CLASSES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe, "Interleaved1F1B": ScheduleInterleaved1F1B}


def stage_layer_ranges(n_layers: int, n_stages: int, split_points: str = "") -> list[range]:
    """Contiguous layer ids of each stage: balanced, or starting at the given split points."""
    if split_points:
        starts = [0, *(int(p) for p in split_points.split(","))]
    else:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
        starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(a, b) for a, b in zip(starts, [*starts[1:], n_layers])]


def local_stage_ids(cfg: ParallelismConfig, pp_rank: int) -> list[int]:
    return [pp_rank + v * cfg.pp for v in range(cfg.stages_per_rank)]


def prune_to_stage(model: torch.nn.Module, stage: int, n_stages: int, layers: range) -> torch.nn.Module:
    """A copy of `model` holding only `layers` (+ embedding if first, norm/head if last)."""
    part = copy.deepcopy(model)
    for key in list(part.layers.keys()):
        if int(key) not in layers:
            del part.layers[key]
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def split_model(
    model: torch.nn.Module, cfg: ParallelismConfig, pp_rank: int
) -> tuple[list[int], list[torch.nn.Module]]:
    """(stage ids, stage modules) this pipeline rank runs; build `model` on meta to save memory."""
    n_stages = cfg.pp * cfg.stages_per_rank
    ranges = stage_layer_ranges(len(model.layers), n_stages, cfg.split_points)
    ids = local_stage_ids(cfg, pp_rank)
    return ids, [prune_to_stage(model, s, n_stages, ranges[s]) for s in ids]


def build_schedule(
    parts: list[torch.nn.Module],
    stage_ids: list[int],
    dims: ParallelDims,
    micro_batches: int,
    device: torch.device,
    stage_shapes,
    loss_fn,
):
    """(schedule, PipelineStages) over this rank's stages; `loss_fn`: the per-micro-batch mean CE.

    `stage_shapes(s)` gives example (input, output) tensors of stage `s` (static shapes: no
    shape-inference forward, so every forward is a real micro-batch).

    With `scale_grads=True` the schedule divides gradients by the micro-batch count after
    the last backward, which equals accumulating `loss / micro_batches`.
    """
    cfg = dims.cfg
    n_stages = cfg.pp * cfg.stages_per_rank
    group = dims.group("pp")
    stages = []
    for part, s in zip(parts, stage_ids):
        inputs, outputs = stage_shapes(s)
        stages.append(PipelineStage(part, s, n_stages, device, input_args=(inputs,), output_args=outputs, group=group))
    cls = SCHEDULE_CLASSES[cfg.schedule]
    stage_arg = stages if cfg.schedule == "Interleaved1F1B" else stages[0]
    # a schedule runs backward only when it has a loss function, so a rank without the last stage needs one too
    return cls(stage_arg, n_microbatches=micro_batches, loss_fn=loss_fn or lm_loss, scale_grads=True), stages


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
