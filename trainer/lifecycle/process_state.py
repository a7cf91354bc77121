"""What one trainer process carries across its generations: everything else is rebuilt in each one.

A survivor of a death replaced in place builds a new job (groups, model, strategy) for the next
generation in the same process (`trainer/lifecycle/generations.py`); what must outlive those jobs is
here, in one object the start plan carries (`StartPlan.process`). Training thread only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from moevement.storage.host_memory import JobLock
from parallelisms.distributed import connect_torchrun_store
from trainer.lifecycle.fault_bounds import FaultBounds
from trainer.lifecycle.startup import Startup


@dataclass(eq=False)
class ProcessState:
    startup: Startup  # when the process started and reached each stage of this generation's set-up
    sigterm_at: float | None = None  # SIGTERM reached the process: every later generation's guard stops at once
    locks: dict[Path, JobLock] = field(default_factory=dict)  # host-state locks held for the process's lifetime
    bounds: FaultBounds | None = None  # the config's fault bounds, once it is loaded (`fault_bounds`, train.py)
    store: dist.Store | None = None  # torchrun's store, once the process joined a generation under torchrun
    # what a warm standby built before its activation (a `trainer.run.prebuilt.Prebuilt`, which the lifecycle
    # only carries), until setup takes it
    prebuilt: object | None = None

    def join_store(self) -> dist.Store | None:
        """torchrun's store for this process's joins (`init_distributed`): connected at its first, then the
        same for every later generation (rank 0 may host it); None without torchrun."""
        if self.store is None and "RANK" in os.environ:
            self.store = connect_torchrun_store()
        return self.store

    def take_prebuilt(self) -> object | None:
        """What the standby built, once: the first generation's setup takes it on (its modules are then that
        generation's); a later generation builds afresh."""
        prebuilt, self.prebuilt = self.prebuilt, None
        return prebuilt
