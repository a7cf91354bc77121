"""CPU threads for a replaying rank: the cores its paused neighbours leave idle (docs/design/replay.md).

During a localized recovery only the failed stages' ranks compute; the other ranks of the node
wait in collectives. A replaying rank may then use the node's cores, shared among the node's
replaying ranks, as long as more threads cannot change a single bit of the result.

That holds when every CPU kernel of an iteration gives the same bits at any thread count. The
element-wise, row-wise and small reductions PyTorch runs here do; MKL's GEMMs do only in its
strict conditional-numerical-reproducibility mode (`MKL_CBWR=AUTO,STRICT`, which `train.py` sets
before torch starts; at one thread it costs no measurable time). Without it, or without MKL, or on
an accelerator (where CPU threads do not run the compute), replay keeps the training thread count.

The extra threads wait for work as the OpenMP runtime does by default (libgomp: spin briefly, then sleep),
fastest on cores the paused ranks leave idle (`benchmarks.omp_wait`); on cores shared with other jobs a
spinning thread keeps the thread it waits for off its core: `training.omp_wait_policy = "passive"` (set
before torch starts; it cannot change once the OpenMP runtime has started) or `fault.replay_threads 1`
(docs/design/replay.md, "Threads").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch


def thread_invariant_cpu_kernels() -> bool:
    """Whether this process's CPU GEMMs give the same bits at any thread count."""
    return torch.backends.mkl.is_available() and "STRICT" in os.environ.get("MKL_CBWR", "").upper()


def replay_threads(
    replaying: Iterable[int],
    node_of: list[int],
    rank: int,
    requested: int,
    base: int,
    device: torch.device,
    cpus: int | None = None,
) -> int:
    """Intra-op threads for `rank` while the ranks `replaying` replay.

    `requested` > 0 is used as given; 0 (auto) shares this node's `cpus` among its replaying ranks,
    never going below `base`, the training thread count. Auto keeps `base` where more threads could
    change results or cannot help (see the module docstring)."""
    if requested > 0:
        return requested
    if device.type != "cpu" or not thread_invariant_cpu_kernels():
        return base
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    sharing = sum(1 for r in set(replaying) if node_of[r] == node_of[rank])
    return max(base, cpus // max(sharing, 1))


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run the block with `n` intra-op threads, then restore the previous count."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
