"""How long the lifecycle waits before it calls something a fault: every bound derived from `[fault]`, once.

`fault_bounds(cfg.fault)` is taken once the config is loaded (train.py) and carried in the process's state
(`ProcessState.bounds`); each user reads the bound it needs here instead of deriving it again. Layers
below the trainer get plain seconds (`parallelisms.distributed.init_distributed`, the replication group's
`group_timeout_s`). A rank shell, which has no config object, derives its hang bound from the same keys
with the same rule (`verdict.hang_bound`). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import FaultConfig

# A later in-place generation's join is bounded by this many times `fault.timeout_s`: a peer that died
# while the previous generation started may have left the others waiting for it in that generation's group
# creation, which fails only after `fault.timeout_s`.
LATER_GENERATION_JOIN_FACTOR = 2


@dataclass(frozen=True)
class FaultBounds:
    timeout_s: float  # fault.timeout_s: a collective or point-to-point operation without progress fails
    later_join_s: float  # a later in-place generation's join (`LATER_GENERATION_JOIN_FACTOR` x timeout_s)
    node_loss_s: float  # fault.node_loss_s: a node whose trainers said nothing for this long is lost

    @classmethod
    def of(cls, timeout_s: float, node_loss_s: float) -> FaultBounds:
        return cls(timeout_s, LATER_GENERATION_JOIN_FACTOR * timeout_s, node_loss_s)


def fault_bounds(fault: FaultConfig) -> FaultBounds:
    """The bounds of the config's `[fault]` section."""
    return FaultBounds.of(fault.timeout_s, fault.node_loss_s)
