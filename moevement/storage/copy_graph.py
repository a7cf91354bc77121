"""A GPU snapshot's device calls replayed as one CUDA graph (`checkpoint.copy_graph`).

Issued call by call, a snapshot costs the training thread about seven Python calls into PyTorch per staged
chunk (`moevement.storage.device_copy`): about 140 for `bench_moe`'s 1.26 GB at W=1, and a launch-bound
training thread pays for each. A CUDA graph of the same calls is one launch. A plan's first issue runs call
by call (it loads the kernels, which a capture may not do); its second captures the device calls on the copy
stream and replays them, as every later issue does. The host chunks (a GPU optimizer's step counters) are
copied on the host at every issue. A capture that raises leaves the process call by call (no other capture
is tried), said once.

A graph holds the addresses of its plan's sources, staging slots, pinned buffer and sums, all of which the
plan keeps alive, and reads the sources' values at each replay (the optimizer updates them in place). Its
temporaries (the checksum's) come from one memory pool that every graph of a `SnapshotBuffers` shares: each
capture frees them before it ends, and replays run one after another on the copy stream, so no graph's
memory holds what another needs. A graph goes with its plan (`SnapshotBuffers._ring`, `close`), never while
its replay is in flight: a copy has been waited for (committed or dropped) before the next one is issued.

Threads: the training thread's alone.
"""

from __future__ import annotations

import sys

import torch

from moevement.storage.device_copy import DevicePlan
from moevement.storage.host_memory import clear_cuda_error

_refused = False  # a capture failed in this process: none is tried again


class GraphedPlan:
    """`plan`'s copy, issued as one CUDA graph (temporaries in memory pool `pool`) from its second issue on;
    `issue` and `checksums` are `DevicePlan`'s."""

    def __init__(self, plan: DevicePlan, pool: tuple[int, int]) -> None:
        self.plan, self.pool = plan, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.issued = 0

    def issue(self, stream: torch.cuda.Stream) -> list[str | None]:
        """Training thread: issue the copy on `stream`, after the work already issued on the training stream, as
        `DevicePlan.issue` does, its device calls replayed."""
        on_host = self.plan.issue(stream, self._device_calls)
        self.issued += 1
        return on_host

    def _device_calls(self) -> None:
        """On the copy stream: call by call at the first issue; captured (nothing runs), then replayed, at the
        second; replayed from then on."""
        if self.graph is None and self.issued and not _refused:
            self.graph = _captured(self.plan, self.pool)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.plan.issue_device(non_blocking=True)

    def checksums(self, on_host: list[str | None]) -> list[list]:
        return self.plan.checksums(on_host)


def _captured(plan: DevicePlan, pool: tuple[int, int]) -> torch.cuda.CUDAGraph | None:
    """A graph of `plan`'s device calls, captured on the current stream (nothing runs), or None if the capture
    raised: then the runtime's error is cleared, the process tries no other capture, and says so once."""
    global _refused
    graph = torch.cuda.CUDAGraph()
    try:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            plan.issue_device(non_blocking=True)
        finally:
            graph.capture_end()
    except RuntimeError as error:
        clear_cuda_error()
        _refused = True
        first_line = (str(error).strip() or type(error).__name__).splitlines()[0]
        print(
            f"warning: a snapshot copy could not be captured as a CUDA graph ({first_line}): this process issues "
            "its snapshots call by call (checkpoint.copy_graph has no effect)",
            file=sys.stderr,
            flush=True,
        )
        return None
    return graph
