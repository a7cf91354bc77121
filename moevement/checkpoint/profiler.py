"""Measurements that feed Algorithm 1: every iteration's overlap time, and the copy bandwidth
(at start-up and every `checkpoint.reprofile_every` windows)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from moevement.storage.host_memory import HostBuffer
from moevement.storage.snapshot_copy import Throttle

PROBE_BYTES = 32 << 20


def gbps_to_bytes(gbps: float) -> float:
    """Gigabits per second -> bytes per second."""
    return gbps * 1e9 / 8


def measure_copy_bandwidth(directory: Path, device: torch.device, repeats: int = 3) -> float:
    """Bytes/s of a device-to-host-snapshot-memory copy (best of `repeats`), through a scratch buffer."""
    buffer = HostBuffer(directory / "bandwidth-probe", pin=device.type == "cuda")
    try:
        dst = buffer.ensure(PROBE_BYTES).view(torch.float32)
        src = torch.rand(dst.numel(), device=device)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return PROBE_BYTES / best
    finally:
        buffer.release()
        for suffix in (".bin", ".json"):
            buffer.path.with_suffix(suffix).unlink(missing_ok=True)


class Profile:
    """The iteration time a snapshot can overlap (forward + backward) and the copy bandwidth.

    Every iteration's overlap time is recorded; `update()`, at each window boundary, sets
    `iteration_s` (what Algorithm 1 plans the next window for) to the shortest overlap since the
    previous update, the run's first (warm-up) iteration left out. The shortest, not the median:
    on a shared machine iterations vary by 10% or more, and a snapshot sized for the median
    stalls the optimizer step of every shorter iteration, while one sized for the shortest costs
    at most a slightly longer window. Re-planning every window follows the machine as it warms up
    (the first iterations run up to 30% slower) and as it speeds up or slows down.
    """

    def __init__(self, cap_gbps: float = 0.0):
        self.cap = gbps_to_bytes(cap_gbps)
        self.measured_bandwidth = 0.0
        self.iteration_s = 0.0
        self.times: list[float] = []
        self.warm = False  # whether the warm-up iteration has been left out

    def measure_bandwidth(self, directory: Path, device: torch.device) -> None:
        self.measured_bandwidth = measure_copy_bandwidth(directory, device)

    @property
    def bandwidth(self) -> float:
        """What Algorithm 1 uses: the measured bandwidth, or the cap when that is lower."""
        return min(self.measured_bandwidth, self.cap) if self.cap > 0 else self.measured_bandwidth

    def throttle(self) -> Throttle:
        return Throttle(self.cap)

    def record(self, seconds: float) -> None:
        self.times.append(seconds)

    def update(self) -> None:
        """Fix `iteration_s` from the times recorded since the last update (kept if there are none)."""
        times = self.times if self.warm or len(self.times) < 2 else self.times[1:]
        if times:
            self.iteration_s = min(times)
            self.warm = True
        self.times = []
