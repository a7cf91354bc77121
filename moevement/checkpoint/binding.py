"""What a `SparseCheckpointer` is bound to: the training state it snapshots and the rank's place in the job.

The trainer builds both once per rank (trainer/run/strategy_factory.py); a strategy adds only its own
checkpoint options (and, for an interval baseline, its policy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from moevement.operators import Stacked
from moevement.topology import Topology


@dataclass(frozen=True)
class CheckpointedModel:
    """The training state a rank's snapshots hold: `model`'s parameters (`stacked`: those that stack several
    operators' tensors, by parameter name; `moevement.operators.Stacked`) and `optimizer`'s state, computed in
    `compute_dtype` on `device`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    compute_dtype: torch.dtype
    device: torch.device
    stacked: Mapping[str, Stacked] | None = None


@dataclass(frozen=True)
class CheckpointerPlace:
    """A rank's place in the job as its checkpointer sees it: `topology` (its rank and every rank's stages and
    node), `rank_dir` (where it keeps its host state), `job_meta` (what every snapshot header carries; copied),
    `rank_dirs(r)` (where rank r keeps its host state: same-node replicas link their files there; None:
    network replication only) and `group_timeout_s` (the replication group's bound on an operation without
    progress: a hung peer fails the replication)."""

    topology: Topology
    rank_dir: Path
    job_meta: Mapping | None = None
    rank_dirs: Callable[[int], Path] | None = None
    group_timeout_s: float | None = None
