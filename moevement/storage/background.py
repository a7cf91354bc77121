"""CPU priority of the checkpointing threads (snapshot copy, replication, disk writes).

On CPU training the compute threads keep every core busy. A background thread at normal priority
preempts one of them in the middle of a parallel operator while the others wait for it at the
operator's barrier, so a second of background CPU can cost up to a second per compute thread. At
`idle` priority (Linux SCHED_IDLE) the scheduler runs it only on a core that would otherwise idle:
between operators, in pipeline bubbles, while a rank waits for communication. The copy still has
the whole forward and backward pass to finish before the optimizer step waits for it (the `stall`
metric shows when it did not). On GPU the copy thread only enqueues asynchronous copies.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

import torch

Priority = Literal["idle", "normal"]
PRIORITIES: tuple[str, ...] = get_args(Priority)


def enter_background(priority: str) -> None:
    """Make the calling thread a checkpointing thread: one OpenMP thread and the given CPU
    priority (`idle` falls back to the lowest nice value where SCHED_IDLE does not exist).

    Threads that already run keep their thread count (the training thread keeps its cores), but
    torch also records 1 as the default that threads created later start with."""
    torch.set_num_threads(1)
    lower_priority(priority)


def lower_priority(priority: str) -> None:
    """Give the calling thread the CPU priority `priority` (`enter_background`'s, without its thread count:
    for a thread that runs no torch operator)."""
    if priority != "idle":
        return
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread (Linux)
    elif hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, 0, 19)
