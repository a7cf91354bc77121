"""The small object collectives of the end of a run and of dense checkpoints, on the default group
(through `parallelisms.collectives`, like every collective of the trainer).

Only records travel here (names, digests, file checksums, error lines), never tensors: the state itself
stays where it lives (`trainer.checkpoint.state`). One process without `torch.distributed` is a group of one.
"""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

from parallelisms import collectives

T = TypeVar("T")


def _alone() -> bool:
    return not dist.is_initialized() or dist.get_world_size() == 1


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def gather_to_rank0(record: T) -> list[T] | None:
    """Every rank's `record`, by rank, on rank 0; None elsewhere. Collective."""
    if _alone():
        return [record]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    collectives.gather_object(record, gathered, dst=0)
    return gathered


def from_rank0(record: T) -> T:
    """Rank 0's `record` on every rank. Collective."""
    if _alone():
        return record
    box = [record]
    collectives.broadcast_object_list(box, src=0)
    return box[0]


def all_records(record: T) -> list[T]:
    """Every rank's `record`, by rank, on every rank. Collective."""
    if _alone():
        return [record]
    gathered = [None] * dist.get_world_size()
    collectives.all_gather_object(gathered, record)
    return gathered
