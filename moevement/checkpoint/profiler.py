"""Measurements that feed Algorithm 1: every iteration's overlap time, and the copy bandwidth (a probe at
start-up and every `checkpoint.reprofile_every` windows; with `checkpoint.overlap = iteration`, the rate the
snapshot copies themselves got beside training).

Threads: `record_copy` runs on the copy thread, everything else on the training thread.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from moevement.storage.host_memory import HostBuffer
from moevement.storage.snapshot_copy import Throttle

PROBE_BYTES = 32 << 20


def gbps_to_bytes(gbps: float) -> float:
    """Gigabits per second -> bytes per second."""
    return gbps * 1e9 / 8


def probe_buffer(directory: Path, device: torch.device) -> HostBuffer:
    """The bandwidth probe's scratch buffer in `directory` (its file and mapping are kept between measurements:
    `reserve_probe` at start-up, then every measurement, takes them back)."""
    return HostBuffer(directory / "bandwidth-probe", pin=device.type == "cuda")


def reserve_probe(directory: Path, device: torch.device) -> None:
    """Start-up: the probe's buffer mapped, its pages faulted in, kept for the first measurement."""
    buffer = probe_buffer(directory, device)
    buffer.ensure(PROBE_BYTES)
    buffer.release(keep=True)


def measure_copy_bandwidth(directory: Path, device: torch.device, repeats: int = 3) -> float:
    """Bytes/s of a device-to-host-snapshot-memory copy (best of `repeats`), through a scratch buffer."""
    buffer = probe_buffer(directory, device)
    try:
        dst = buffer.ensure(PROBE_BYTES)[:PROBE_BYTES].view(torch.float32)
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
        buffer.release(keep=True)  # the next measurement (a re-profile, a later generation) maps nothing anew


class Profile:
    """The time a snapshot's copy can overlap and the rate it copies at.

    Every iteration's overlap time is recorded: with `basis` "compute", from `begin(t)` to the optimizer step
    (the forward and backward passes the copy started at `begin(t)` runs beside); with "iteration", from the
    moment the copy of `state_t` started (or could have: right after iteration t-1, `end(t-1)`) to the step,
    what the copy really ran beside: the end of iteration t-1 (logging, data loading, validation) and the
    forward and backward passes. `update()`, at each window boundary, sets `iteration_s` (what Algorithm 1
    plans the next window for) to the shortest overlap since the previous update, the run's first (warm-up)
    iteration left out. The shortest, not the median: on a shared machine iterations vary by 10% or more, and
    a snapshot sized for the median stalls the optimizer step of every shorter iteration, while one sized for
    the shortest costs at most a slightly longer window. Re-planning every window follows the machine as it
    warms up (the first iterations run up to 30% slower) and as it speeds up or slows down.

    The bandwidth: the cap (`checkpoint.bandwidth_gbps`) where it is lower, else, with "compute", the probe (one
    32 MB copy, alone), and with "iteration", once copies ran, the rate they got beside training (their bytes
    over the seconds they copied and hashed, the cap's sleeps left out) since the previous update: a copy
    thread at idle priority beside a busy training thread gets less than a probe alone.
    """

    def __init__(self, cap_gbps: float = 0.0, basis: str = "compute"):
        self.cap, self.basis = gbps_to_bytes(cap_gbps), basis
        self.measured_bandwidth = 0.0
        self.iteration_s = 0.0
        self.times: list[float] = []
        self.warm = False  # whether the warm-up iteration has been left out
        self.copies: list[tuple[int, float]] = []  # (bytes, working seconds) of the copies since the last update
        self.beside = 0.0  # bytes/s the copies got beside training before the last update (0: none measured)

    def measure_bandwidth(self, directory: Path, device: torch.device) -> None:
        self.measured_bandwidth = measure_copy_bandwidth(directory, device)

    @property
    def bandwidth(self) -> float:
        """What Algorithm 1 uses: the measured bandwidth (beside training, where measured), or the cap when that
        is lower."""
        measured = self.beside if self.basis == "iteration" and self.beside > 0 else self.measured_bandwidth
        return min(measured, self.cap) if self.cap > 0 else measured

    def throttle(self, cancelled: threading.Event | None = None) -> Throttle:
        """The cap's throttle for one copy, which `cancelled` ends between two chunks."""
        return Throttle(self.cap, cancelled)

    def record(self, seconds: float) -> None:
        """One iteration's overlap time (see the class docstring)."""
        self.times.append(seconds)

    def record_copy(self, nbytes: int, working_s: float) -> None:
        """Copy thread: a snapshot copy of `nbytes` took `working_s` seconds of copying and hashing."""
        if working_s > 0:
            self.copies.append((nbytes, working_s))

    def update(self) -> None:
        """Fix `iteration_s` and the rate beside training from what was recorded since the last update (each
        kept if nothing was)."""
        times = self.times if self.warm or len(self.times) < 2 else self.times[1:]
        if times:
            self.iteration_s = min(times)
            self.warm = True
        copies, self.copies = self.copies, []
        if copies:
            self.beside = sum(n for n, _ in copies) / sum(s for _, s in copies)
        self.times = []
