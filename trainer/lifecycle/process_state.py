"""What one trainer process carries across its generations: everything else is rebuilt in each one.

A survivor of a death replaced in place builds a new job (groups, model, strategy) for the next
generation in the same process (`trainer/lifecycle/generations.py`); what must outlive those jobs is
here, in one object the start plan carries (`StartPlan.process`). Training thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moevement.storage.host_memory import JobLock
from trainer.lifecycle.fault_bounds import FaultBounds
from trainer.lifecycle.startup import Startup


@dataclass(eq=False)
class ProcessState:
    startup: Startup  # when the process started and reached each stage of this generation's set-up
    sigterm_at: float | None = None  # SIGTERM reached the process: every later generation's guard stops at once
    locks: dict[Path, JobLock] = field(default_factory=dict)  # host-state locks held for the process's lifetime
    bounds: FaultBounds | None = None  # the config's fault bounds, once it is loaded (`fault_bounds`, train.py)
    # what a warm standby built before its activation (a `trainer.run.prebuilt.Prebuilt`, which the lifecycle
    # only carries), until setup takes it
    prebuilt: object | None = None

    def take_prebuilt(self) -> object | None:
        """What the standby built, once: the first generation's setup takes it on (its modules are then that
        generation's); a later generation builds afresh."""
        prebuilt, self.prebuilt = self.prebuilt, None
        return prebuilt
