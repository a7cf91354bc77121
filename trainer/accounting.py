"""ETTR bookkeeping of one run: productive iterations, recomputed ones, recovery, checkpoint memory.

An iteration counts as productive the first time it completes; running it again after a rollback
is recomputation (lost work). At the end, rank 0 prints one line that `benchmarks.ettr` reads:

    accounting wall_s=<x> iterations=<n> productive_s=<x> recompute_s=<x> recovery_s=<x> failures=<n>
               recomputed=<n> goodput=<samples/s> lost_tokens=<n> host_mb=<x> log_mb=<x>
"""

from __future__ import annotations

import time


class RunAccounting:
    def __init__(self, first_step: int, samples_per_step: int):
        self.first_step, self.samples = first_step, samples_per_step
        self.high_water = first_step - 1  # newest iteration completed so far
        self.productive_s = self.recompute_s = self.recovery_s = 0.0
        self.failures = self.recomputed = 0
        self.started = time.perf_counter()
        self.last_recovery_end = 0.0  # perf_counter() when the newest recovery finished

    def iteration(self, step: int, seconds: float) -> None:
        if step > self.high_water:
            self.productive_s += seconds
            self.high_water = step
        else:
            self.recompute_s += seconds
            self.recomputed += 1

    def recovered(self, failures: int, seconds: float) -> None:
        self.failures += failures
        self.recovery_s += seconds
        self.last_recovery_end = time.perf_counter()

    def line(self, metrics: dict[str, float], lost_tokens: float) -> str:
        wall = time.perf_counter() - self.started
        iterations = self.high_water - self.first_step + 1
        return (
            f"accounting wall_s={wall:.3f} iterations={iterations} productive_s={self.productive_s:.3f} "
            f"recompute_s={self.recompute_s:.3f} recovery_s={self.recovery_s:.3f} failures={self.failures} "
            f"recomputed={self.recomputed} goodput={iterations * self.samples / wall:.3f} "
            f"lost_tokens={lost_tokens:.0f} host_mb={metrics.get('host_mb', 0.0):.1f} "
            f"log_mb={metrics.get('log_mb', 0.0):.1f}"
        )
