"""What the sparse checkpointer reads from the configuration: the `[checkpoint]` keys of MoEvement.

The trainer's `CheckpointConfig` extends `SparseOptions` with the keys only it reads (strategy, dense
checkpoints, host directory, the interval baselines' keys), so one declaration serves the TOML file,
`train.py --help` (these comments are the keys' docs) and the code that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moevement.checkpoint.popularity import Policy
from moevement.storage.background import Priority


@dataclass
class SparseOptions:
    window: int = 0  # sparse window W; 0: chosen by Algorithm 1 from the profile
    # largest W Algorithm 1 may choose: a window's host memory grows with W (each snapshot carries the later
    # slots' compute weights) and a recovery replays up to 2W iterations; above it, snapshots stall the step
    max_window: int = 16
    # cut operators into slots by equal count (the paper) or by bytes: count | bytes
    slots: Literal["count", "bytes"] = "count"
    ordering: Policy = "count"  # operator popularity: count | soft | ema | capacity | fixed (the model's order)
    ema_decay: float = 0.9  # decay of the `ema` ordering policy
    replicas: int = 2  # peers holding a copy of each snapshot (capped by world size - 1)
    # cap on the snapshot copy rate to host memory, Gbit/s (0: none); on a GPU it only plans W (the copy is the DMA's)
    bandwidth_gbps: float = 0.0
    background_priority: Priority = "idle"  # CPU priority of the copy/replication/disk threads: idle | normal
    # a snapshot is copied and checksummed in chunks of about this many MiB: per chunk one copy call and one hash
    # (CPU) or one gather, device-to-host copy and device checksum (GPU). Fewer chunks hand the GIL back to a busy
    # training thread less often; a GPU's staging ring holds 2 of them; the bandwidth cap is enforced between them
    chunk_mb: int = 64
    # on a GPU, issue each snapshot's copy as one replayed CUDA graph instead of call by call (fewer launches on
    # the training thread; off by default until `make gpu-check` has measured it)
    copy_graph: bool = False
    keep_host_state: bool = False  # keep snapshots in host memory after a clean finish
    persist_dir: str = ""  # also write every `persist_every`-th persisted checkpoint to <persist_dir>/<job.name>
    persist_every: int = 1  # write every N-th persisted checkpoint to persist_dir
    profile_iters: int = 2  # iterations measured before the first window
    # what Algorithm 1 plans W on: "iteration" copies SS_t from the end of iteration t-1 (right after its optimizer
    # step) and plans on the time from the copy's start to step t, at the rate copies get beside training; "compute"
    # copies it from begin(t) and plans on forward + backward, at the bandwidth of a copy alone (the interval
    # baselines always copy from begin(t))
    overlap: Literal["iteration", "compute"] = "iteration"
    # snapshot buffers are never grown while a window needs them: at start-up the buffer files this rank's host
    # directory holds are mapped and, where the plan is known before training (a fixed window, an interval
    # baseline), its buffers are reserved; a window whose buffers are not yet ready waits (no snapshot) while a
    # background thread grows them. false: they grow on the training thread at the window's start
    prefault: bool = True
    reprofile_every: int = 0  # re-measure the copy bandwidth every N windows (0: only at start-up)
    # benchmarks, with window = 1: snapshots in every other block of this many iterations, none in the blocks
    # between (0: every iteration), so that one process measures their cost (ckpt_mb says which iterations)
    ab_blocks: int = 0

    @property
    def chunk_bytes(self) -> int:
        """`chunk_mb` in bytes."""
        return self.chunk_mb << 20
