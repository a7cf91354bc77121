"""Each strategy's checkpoint overhead and loss per failure on a `Setting`, from its own mechanism.

Training traffic (NCCL, at line rate) keeps the node's NIC busy a fraction u of each iteration;
checkpoint traffic (host-to-host point-to-point) runs at `nic_efficiency` x 80 Gb/s in the rest
while training runs, and in all of it while training waits (a stall).

- gemini: a dense checkpoint to remote CPU memory over the NIC, overlapped with the next iteration:
  stall = max(0, (bytes - idle x T) / full). Interval: the oracle, the k maximising the run's ETTR for
  its MTBF (`baselines.intervals.oracle_interval`). A failure: global restart + the failed node
  reading its state back + (k/2 + 1) T of global rollback.
- checkfreq: a snapshot to local CPU memory over PCIe, then a persist of the whole cluster's state to
  Blob Storage at 40 Gb/s; interval: the smallest k whose overhead is at most 3%. A failure: global
  restart + reading the state from Blob + (k/2 + 1) T + the newest checkpoint's persist lag.
- moc: every iteration, all non-expert state + a fraction f of the experts, overlapped with the next
  iteration at the bandwidth B that gives its first fraction (1/8) its stated overhead o0:
  B = bytes(1/8) / ((1 + o0) T), stall = max(0, bytes(f) / B - T); f changes with Dynamic-K
  (`simulator.run`). A failure:
  global restart + state read + 1.5 T; it also loses `moc_loss_scale` x the round-robin staleness in
  iterations of expert updates.
- moevement: Algorithm 1's window at a bandwidth of min(PCIe, idle / 8) per GPU (a snapshot must
  reach its remote copy within the iteration, or the replicas fall behind). A failure: localized
  restart + fetching the W snapshots + W conversion iterations (frozen operators skip weight
  gradients: 1/3 of their FLOPs) + (W - 1) / 2 catch-up iterations, each one stage's share of an
  iteration (no bubble), + T / 2 aborted.
Every strategy's copies to host memory cost `copy_interference` x their PCIe time.
"""

from __future__ import annotations

from dataclasses import dataclass

from baselines.intervals import checkfreq_interval, oracle_interval
from moevement.checkpoint.schedule import find_window_size, snapshot_sizes
from simulator.calibrated import (
    CHECKFREQ_CAP,
    GEMINI_REMOTE_COPIES,
    MOC_START_FRACTION,
    MOEVEMENT_REMOTE_COPIES,
    Calibration,
)
from simulator.frozen import Ablation, ordered_operators, stage_frozen_fractions
from simulator.setting import Setting
from simulator.testbed import BLOB_BW, GPUS_PER_NODE, NODE_NIC_BW, PCIE_BW

FULL = Ablation()
MAX_BUSY = 0.95  # training traffic never leaves the NIC less than 5% idle (T is stated, not derived from it)


@dataclass(frozen=True)
class Cost:
    """A strategy's steady overhead (fraction of T) and seconds lost per failure."""

    strategy: str
    overhead: float
    recovery_s: float
    interval: int | None = None
    window: int | None = None
    stall_s: float = 0.0  # per checkpoint


@dataclass(frozen=True)
class NodeNetwork:
    full: float  # bytes/s
    busy: float  # fraction of an iteration training traffic occupies

    @property
    def idle(self) -> float:
        return self.full * (1 - self.busy)


def node_network(setting: Setting, cal: Calibration) -> NodeNetwork:
    """Checkpoint traffic at `nic_efficiency` of the line rate; training (NCCL) occupies it at line rate."""
    busy = setting.nic_train_bytes / NODE_NIC_BW / setting.iteration_s
    return NodeNetwork(cal.nic_efficiency * NODE_NIC_BW, min(MAX_BUSY, busy))


def copy_cost_s(cal: Calibration, gpu_bytes: float) -> float:
    """Training time lost to one GPU copying `gpu_bytes` to host memory."""
    return cal.copy_interference * gpu_bytes / PCIE_BW


def network_stall_s(nbytes: float, net: NodeNetwork, iteration_s: float) -> float:
    """Stall of a copy overlapped with one iteration on the idle NIC, finished at full speed."""
    return max(0.0, (nbytes - net.idle * iteration_s) / net.full)


def gemini_cost(s: Setting, cal: Calibration, mtbf_s: float, interval: int | None = None) -> Cost:
    net, t = node_network(s, cal), s.iteration_s
    stall = network_stall_s(GEMINI_REMOTE_COPIES * s.node_state_bytes, net, t)
    per_ckpt = stall + copy_cost_s(cal, s.node_state_bytes / GPUS_PER_NODE)
    fixed = cal.global_restart_at(s.gpus) + s.node_state_bytes / net.full
    k = interval or oracle_interval(per_ckpt, t, fixed, mtbf_s)
    return Cost("gemini", per_ckpt / (k * t), fixed + (k / 2 + 1) * t, interval=k, stall_s=stall)


def checkfreq_cost(s: Setting, cal: Calibration) -> Cost:
    t, gpu_bytes = s.iteration_s, s.node_state_bytes / GPUS_PER_NODE
    persist = s.cluster_state_bytes / BLOB_BW
    stall = max(0.0, gpu_bytes / PCIE_BW - t) + copy_cost_s(cal, gpu_bytes) + cal.persist_interference * persist
    k = checkfreq_interval(stall, persist, t, CHECKFREQ_CAP)
    overhead = (stall + max(0.0, persist - k * t)) / (k * t)
    recovery = cal.global_restart_at(s.gpus) + persist + (k / 2 + 1) * t + min(persist, k * t)
    return Cost("checkfreq", overhead, recovery, interval=k, stall_s=stall)


def moc_bytes(s: Setting, fraction: float) -> float:
    """A node's MoC checkpoint: all non-expert state and `fraction` of the experts'."""
    return s.node_state_bytes * (1 - s.expert_state_share + s.expert_state_share * fraction)


def moc_overhead(s: Setting, fraction: float) -> float:
    """MoC's per-iteration overhead when it checkpoints `fraction` of the experts every iteration."""
    if s.moc_start_overhead is None:
        raise ValueError(f"{s.name}: MoC needs its overhead at the first K (a testbed input)")
    bandwidth = moc_bytes(s, MOC_START_FRACTION) / ((1 + s.moc_start_overhead) * s.iteration_s)
    return max(0.0, moc_bytes(s, fraction) / bandwidth - s.iteration_s) / s.iteration_s


def moc_recovery_s(s: Setting, cal: Calibration) -> float:
    return cal.global_restart_at(s.gpus) + s.node_state_bytes / node_network(s, cal).full + 1.5 * s.iteration_s


def moevement_bandwidth(s: Setting, cal: Calibration) -> float:
    """Per-GPU snapshot bandwidth Algorithm 1 sees: PCIe, or the GPU's share of the idle NIC per remote copy."""
    return min(PCIE_BW, node_network(s, cal).idle / (GPUS_PER_NODE * MOEVEMENT_REMOTE_COPIES))


def moevement_cost(
    s: Setting, cal: Calibration, shares: list[list[float]] | None = None, ablation: Ablation = FULL
) -> Cost:
    """Algorithm 1's window on the operators in popularity order; recovery localized unless ablated."""
    net, t, bw = node_network(s, cal), s.iteration_s, moevement_bandwidth(s, cal)
    ops = ordered_operators(s.operators, shares, ablation.reorder)
    fp32, comp = [o.fp32 for o in ops], [o.compute for o in ops]
    window, o_active = find_window_size(fp32, comp, t, bw)
    slots = [range(i * o_active, min(len(ops), (i + 1) * o_active)) for i in range(window)]
    sizes = snapshot_sizes(slots, fp32, comp)
    stall = max(0.0, max(sizes) / bw - t)
    copies = copy_cost_s(cal, sum(sizes) / window + s.log_bytes_gpu)
    frozen = (
        stage_frozen_fractions(s.operators, shares, ablation.reorder, slots)
        if ablation.skip_bweight
        else [0.0] * window
    )
    replay_t = s.stage_iteration_s if ablation.localized else t
    restart = cal.local_restart_s if ablation.localized else cal.global_restart_at(s.gpus)
    conversion = sum(replay_t * (1 - f / 3) for f in frozen)
    fetch = sum(sizes) * GPUS_PER_NODE / net.full
    recovery = restart + fetch + conversion + (window - 1) / 2 * replay_t + t / 2
    return Cost("moevement", (stall + copies) / t, recovery, window=window, stall_s=stall)
