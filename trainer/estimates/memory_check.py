"""Before a run allocates its model: does the estimated per-rank peak fit the device? (`train.py` setup)

The estimate is the dry run's (`trainer.estimates.memory_estimate`: upper-bound bookkeeping of what is alive
together; the caching allocator's reserve and fragmentation come on top), for the largest rank at the
configured `training.activation_checkpoint`. The device's memory is a GPU's total memory, or on the CPU the
host's (`host_estimate.node_memory`) shared by the ranks torchrun starts on it (`LOCAL_WORLD_SIZE`). Where the
peak is larger, rank 0 prints one `WARNING: memory:` line with the keys that would fit it: the lightest
activation checkpointing at the configured micro-batches, the fewest micro-batches (a power of two more) at
the configured checkpointing, else both together, else that only more ranks or a smaller model or batch do. The run
goes on: an upper bound may be pessimistic, and the allocator has the last word.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from trainer.config import Config, ConfigError, validate
from trainer.estimates.activation_estimate import MODES, micro_batch_shape
from trainer.estimates.host_estimate import gb, node_memory
from trainer.estimates.memory_estimate import configured_mode, estimate

LIGHTEST_FIRST = ("none", "selective", "full")  # activation checkpointing, by how much it recomputes


@dataclass
class DeviceMemory:
    """The bytes one rank may use and what they are (for the warning line)."""

    nbytes: int
    what: str


def device_memory(device: torch.device) -> DeviceMemory:
    """A GPU's total memory; on the CPU, this host's memory over the ranks torchrun runs on it."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceMemory(props.total_memory, f"{device}'s {gb(props.total_memory)} GB ({props.name})")
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    host = node_memory().nbytes
    shared = f", shared by its {ranks} ranks" if ranks > 1 else ""
    return DeviceMemory(host // ranks, f"this host's {gb(host)} GB (MemTotal{shared})")


def peaks(cfg: Config) -> dict[str, int]:
    """The largest per-rank peak under `cfg`, by activation checkpointing mode."""
    ranks = estimate(cfg)
    return {mode: max(r.peak(mode) for r in ranks) for mode in MODES}


def more_micro_batches(cfg: Config) -> Iterator[Config]:
    """`cfg` with 2, 4, 8... times its micro-batches, each a valid config, while a micro-batch holds a sequence."""
    n = cfg.training.micro_batches * 2
    while n * cfg.parallelism.dp <= cfg.training.batch_size:
        candidate = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, micro_batches=n))
        try:
            validate(candidate)
        except ConfigError:
            n *= 2
            continue
        yield candidate
        n *= 2


def fitting_keys(cfg: Config, budget: int, configured: dict[str, int]) -> list[str]:
    """The overrides that bring the peak (`configured`: `peaks(cfg)`) under `budget`, each with its peak."""
    mode = configured_mode(cfg)
    heavier = LIGHTEST_FIRST[LIGHTEST_FIRST.index(mode) + 1 :]
    found = [
        f"--training.activation_checkpoint {m} ({gb(configured[m])} GB)" for m in heavier if configured[m] <= budget
    ]
    found = found[:1]
    for candidate in more_micro_batches(cfg):
        n, candidate_peaks = candidate.training.micro_batches, peaks(candidate)
        if candidate_peaks[mode] <= budget:
            return [*found, f"--training.micro_batches {n} ({gb(candidate_peaks[mode])} GB)"]
        both = next((m for m in heavier if candidate_peaks[m] <= budget), None)
        if both and not found:
            return [
                f"--training.activation_checkpoint {both} --training.micro_batches {n} ({gb(candidate_peaks[both])} GB)"
            ]
    return found


def over_line(cfg: Config, memory: DeviceMemory) -> str | None:
    """The warning line when the configured peak is over `memory`, else None."""
    configured = peaks(cfg)
    mode = configured_mode(cfg)
    if configured[mode] <= memory.nbytes:
        return None
    b, s = micro_batch_shape(cfg)
    keys = fitting_keys(cfg, memory.nbytes, configured)
    fits = (
        f"fits with {' or '.join(keys)}"
        if keys
        else "no activation checkpointing or micro-batch count fits it: more ranks do (parallelism.pp, or "
        "parallelism.dp with FSDP), or a smaller model or batch"
    )
    return (
        f"WARNING: memory: the largest rank's estimated peak, {gb(configured[mode])} GB (activation_checkpoint="
        f"{mode}, micro-batch {b}x{s}), is more than {memory.what}; {fits} (upper bounds; train.py --dry-run "
        "itemizes them)"
    )


def warn_if_over(cfg: Config, rank: int, device: torch.device) -> None:
    """On rank 0, before the model is built: print the warning line when the run's estimate is over its device."""
    if rank == 0:
        line = over_line(cfg, device_memory(device))
        if line:
            print(line, flush=True)
