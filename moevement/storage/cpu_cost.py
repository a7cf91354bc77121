"""CPU seconds of the checkpointing activities, per process, by activity.

On CPU training every second a background thread computes is taken from training (docs/design/sparse-checkpointing.md:
on a GPU the copies ride DMA engines). `measure(activity)` adds the calling thread's CPU time
(`time.thread_time`: running, not waiting or sleeping) spent inside it to the process's total for
that activity; `CpuMark` reads them, with the whole process's and the training thread's CPU time
beside them, so that what no activity accounts for (the communication library's own threads, the
allocator) shows as the remainder.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# Background threads: copy, checksum, header (a snapshot's commit record, encoded on the copy thread),
# replication, persistence, prefault (buffers grown ahead of need). On the training thread: upstream_log (the
# boundary tensors' host copies), checkpointer (its begin / pre-step / end calls) and window (a window's start:
# plan, layouts, buffers).
ACTIVITIES = (
    "copy",
    "checksum",
    "header",
    "replication",
    "persistence",
    "prefault",
    "upstream_log",
    "checkpointer",
    "window",
)
BACKGROUND = ("copy", "checksum", "header", "replication", "persistence", "prefault")

_lock = threading.Lock()
_seconds = dict.fromkeys(ACTIVITIES, 0.0)
_calls = dict.fromkeys(ACTIVITIES, 0)


@contextmanager
def measure(activity: str) -> Iterator[None]:
    """Add the calling thread's CPU time inside the block to `activity`'s total."""
    start = time.thread_time()
    try:
        yield
    finally:
        elapsed = time.thread_time() - start
        with _lock:
            _seconds[activity] += elapsed
            _calls[activity] += 1


def process_cpu_s() -> float:
    """User plus system CPU seconds of every thread of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class CpuMark:
    """CPU seconds so far: the process's, the calling (training) thread's, and every activity's (with the
    number of measured calls of each)."""

    process_s: float
    thread_s: float
    activities: dict[str, float]
    calls: dict[str, int]

    @classmethod
    def now(cls) -> CpuMark:
        with _lock:
            activities, calls = dict(_seconds), dict(_calls)
        return cls(process_cpu_s(), time.thread_time(), activities, calls)

    def line_since(self, start: CpuMark, rank: int, iterations: int) -> str:
        """`cpu_cost rank=<r> iterations=<n> process_s=... training_thread_s=... <activity>_s=... other_s=...
        <activity>_calls=...`: CPU seconds between `start` and this mark; other_s is the process's CPU time
        outside the training thread and the background activities (communication threads, data loading);
        <activity>_calls counts the measured calls (a call's cost is <activity>_s / <activity>_calls)."""
        spent = {a: self.activities[a] - start.activities[a] for a in ACTIVITIES}
        process, thread = self.process_s - start.process_s, self.thread_s - start.thread_s
        other = process - thread - sum(spent[a] for a in BACKGROUND)
        fields = " ".join(f"{a}_s={spent[a]:.6f}" for a in ACTIVITIES)
        calls = " ".join(f"{a}_calls={self.calls[a] - start.calls[a]}" for a in ACTIVITIES)
        return (
            f"cpu_cost rank={rank} iterations={iterations} process_s={process:.3f} "
            f"training_thread_s={thread:.3f} {fields} other_s={other:.3f} {calls}"
        )
