"""What Algorithm 1 needs to pick MoEvement's window, as the trainer profiles it: the iteration time, each
operator's FP32-state and compute-weight bytes on one GPU, and the bandwidth a snapshot can use.

The snapshot bandwidth per GPU is the smaller of the GPU's copy bandwidth to host memory and its share
of the node's idle NIC at line rate over the r peers each snapshot is replicated to (a snapshot must
reach its replicas within its iteration, or they fall behind), capped by `snapshot_cap_bw`; r = 2 is
§4's default (Table 6's CPU memory shows two copies in all, i.e. r = 1: `replicas=1` gives that W).

For the paper's testbed every input is a stated number (`snapshot_bandwidth` on a `Setting`): T from
Table 3's overhead cells, state bytes from Table 2's models, PCIe Gen4 x16 and the 80 Gb/s node NIC
from §5.1; no fitted constant enters W. A measured profile (`WindowProfile`, JSON, read by
`python -m simulator --window-profile FILE`) goes through the same formula and the trainer's
`find_window_size`:

    {"iteration_s": 2.8, "fp32_bytes": [...], "compute_bytes": [...], "copy_gbs": 25.0,
     "nic_gbps": 80.0, "nic_busy": 0.3, "gpus_per_node": 8, "replicas": 2}

(`nic_gbps` null: the copy bandwidth alone, as in a single-node run; operators in Algorithm 1's order.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from moevement.checkpoint.schedule import find_window_size
from simulator.calibrated import MOEVEMENT_REPLICAS
from simulator.setting import Setting
from simulator.testbed import GPUS_PER_NODE

MAX_BUSY = 0.95  # training never leaves the NIC less than 5% idle (T is stated, not derived from traffic)


def per_gpu_bandwidth(copy_bw: float, nic_bw: float, busy: float, gpus: int, replicas: int, cap: float) -> float:
    """Bytes/s per GPU: min(copy, idle line rate / (gpus x replicas), cap)."""
    return min(copy_bw, nic_bw * (1 - min(MAX_BUSY, busy)) / (gpus * max(1, replicas)), cap)


def nic_busy(s: Setting) -> float:
    """The share of an iteration training traffic keeps the node's NIC busy at line rate."""
    return min(MAX_BUSY, s.nic_train_bytes / s.node_nic_bw / s.iteration_s)


def snapshot_bandwidth(s: Setting, replicas: int = MOEVEMENT_REPLICAS) -> float:
    """The bandwidth Algorithm 1 sees on `s`."""
    return per_gpu_bandwidth(s.pcie_bw, s.node_nic_bw, nic_busy(s), GPUS_PER_NODE, replicas, s.snapshot_cap_bw)


@dataclass(frozen=True)
class WindowProfile:
    """A profiled GPU: iteration time, per-operator bytes (Algorithm 1's order) and its links."""

    iteration_s: float
    fp32_bytes: tuple[float, ...]
    compute_bytes: tuple[float, ...]
    copy_gbs: float
    nic_gbps: float | None = None
    nic_busy: float = 0.0
    gpus_per_node: int = GPUS_PER_NODE
    replicas: int = MOEVEMENT_REPLICAS

    @classmethod
    def from_json(cls, data: str | dict[str, Any]) -> WindowProfile:
        """ValueError naming a missing key or an operator list of unequal lengths."""
        d = json.loads(data) if isinstance(data, str) else data
        try:
            fp32, comp = tuple(map(float, d["fp32_bytes"])), tuple(map(float, d["compute_bytes"]))
            nic = d.get("nic_gbps")
            profile = cls(
                float(d["iteration_s"]),
                fp32,
                comp,
                float(d["copy_gbs"]),
                None if nic is None else float(nic),
                float(d.get("nic_busy", 0.0)),
                int(d.get("gpus_per_node", GPUS_PER_NODE)),
                int(d.get("replicas", MOEVEMENT_REPLICAS)),
            )
        except KeyError as err:
            raise ValueError(f"window profile: missing key {err}") from None
        if len(fp32) != len(comp) or not fp32:
            raise ValueError("window profile: fp32_bytes and compute_bytes need one entry per operator")
        return profile

    def bandwidth(self) -> float:
        nic = math.inf if self.nic_gbps is None else self.nic_gbps * 1e9 / 8
        return per_gpu_bandwidth(self.copy_gbs * 1e9, nic, self.nic_busy, self.gpus_per_node, self.replicas, math.inf)

    def window(self) -> tuple[int, int]:
        """(W, O_active) from the trainer's `find_window_size` at `bandwidth()`."""
        return find_window_size(list(self.fp32_bytes), list(self.compute_bytes), self.iteration_s, self.bandwidth())
