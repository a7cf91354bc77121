"""Each strategy's checkpoint overhead, failure-independent loss and loss per failure on a `Setting`.

Training traffic (NCCL, at line rate) keeps the node's NIC busy a fraction u of each iteration;
a bulk checkpoint transfer runs at `nic_efficiency` x line rate in the rest while training runs,
and in all of it while training waits (a stall).

A failure's cost is split into what does not scale with the failed scope (`Calibration.restart_s`:
detect, replace, relaunch) and what does: the relaunched nodes' re-join (`rejoin_s` x log2(nodes)),
state reads and recomputation. Every strategy also loses `zero_loss_<strategy>` of a
failure-free run (`simulator.calibrated`).

- gemini: a dense checkpoint to remote CPU memory over the NIC, overlapped with the next iteration:
  stall = max(0, (bytes - idle x T) / full). Interval: the oracle, the k maximising the run's ETTR for
  its MTBF (`simulator.oracle`). A failure: global restart + the failed node
  reading its state back + (k/2 + 1) T of global rollback.
- checkfreq: a snapshot to local CPU memory over PCIe, then a persist of the whole cluster's state to
  Blob Storage; interval: the smallest k whose overhead is at most 3%. A failure: global restart +
  reading the state from Blob + (k/2 + 1) T + the newest checkpoint's persist lag.
- moc: every iteration, all non-expert state + a fraction f of the experts, overlapped with the next
  iteration at the bandwidth B that gives its first fraction (1/8) its stated overhead o0:
  B = bytes(1/8) / ((1 + o0) T), stall = max(0, bytes(f) / B - T); f changes with Dynamic-K
  (`simulator.run`). Without a stated o0 (the scale presets), B is the NIC's bulk rate. A failure:
  global restart + state read + 1.5 T.
- moevement: Algorithm 1's window at the profiled snapshot bandwidth (`simulator.profile`). A failure:
  localized restart + fetching the W snapshots + the paper's expected recovery (§3.6, E[R] ~ 3/2 W T):
  W conversion iterations (frozen operators skip weight gradients: 1/3 of their FLOPs) + (W - 1) / 2
  catch-up iterations, each a full iteration T, + T / 2 aborted. (Upstream logging makes the recovery
  local, a local restart; §3.6 states its replay in whole iterations.)
Copies to host memory overlap training at no cost (a per-second copy interference fitted to zero on
the 2H and 1H rows and was removed); what a strategy loses beyond its stall is its `zero_loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from baselines.intervals import checkfreq_interval
from moevement.checkpoint.schedule import find_window_size, slot_size_for, snapshot_sizes
from simulator.calibrated import CHECKFREQ_CAP, GEMINI_REMOTE_COPIES, MOC_START_FRACTION, Calibration
from simulator.frozen import Ablation, ordered_operators, stage_frozen_fractions
from simulator.oracle import oracle_interval
from simulator.profile import nic_busy, snapshot_bandwidth
from simulator.setting import Setting
from simulator.testbed import GPUS_PER_NODE

FULL = Ablation()


@dataclass(frozen=True)
class Cost:
    """A strategy's steady overhead (fraction of T), failure-independent loss (fraction of the run) and
    seconds lost per failure, of which `restart_s` does not scale with the failed scope."""

    strategy: str
    overhead: float
    recovery_s: float
    interval: int | None = None
    window: int | None = None
    stall_s: float = 0.0  # per checkpoint
    zero_loss: float = 0.0
    restart_s: float = 0.0  # the scope-independent part of recovery_s


@dataclass(frozen=True)
class NodeNetwork:
    full: float  # bytes/s
    busy: float  # fraction of an iteration training traffic occupies

    @property
    def idle(self) -> float:
        return self.full * (1 - self.busy)


def node_network(setting: Setting, cal: Calibration) -> NodeNetwork:
    """Bulk checkpoint traffic at `nic_efficiency` of the line rate; training (NCCL) occupies it at line rate."""
    return NodeNetwork(cal.nic_efficiency * setting.node_nic_bw, nic_busy(setting))


def network_stall_s(nbytes: float, net: NodeNetwork, iteration_s: float) -> float:
    """Stall of a copy overlapped with one iteration on the idle NIC, finished at full speed."""
    return max(0.0, (nbytes - net.idle * iteration_s) / net.full)


MOC_REPLAY_ITERATIONS = 1.5  # MoC's recomputation per failure: one iteration plus half an aborted one


def periodic_recovery_s(fixed_s: float, interval: int, iteration_s: float) -> float:
    """A periodic checkpoint's loss per failure: the fixed part and (k/2 + 1) iterations of global rollback."""
    return fixed_s + (interval / 2 + 1) * iteration_s


def moevement_recovery_s(
    restart_s: float, fetch_s: float, frozen: list[float], replay_s: float, iteration_s: float
) -> float:
    """MoEvement's loss per failure: the restart, fetching the snapshots, W = len(frozen) conversion
    iterations (a frozen share f of an iteration's operators skips its weight gradient, 1/3 of their
    FLOPs), (W - 1) / 2 catch-up iterations, each `replay_s`, and half an aborted iteration."""
    conversion = sum(replay_s * (1 - f / 3) for f in frozen)
    return restart_s + fetch_s + conversion + (len(frozen) - 1) / 2 * replay_s + iteration_s / 2


def overlapped_stall_s(copy_s: float, iteration_s: float) -> float:
    """Stall of a checkpoint copy that takes `copy_s` alone and overlaps one iteration of training."""
    return max(0.0, copy_s - iteration_s)


def global_restart_s(s: Setting, cal: Calibration) -> float:
    return cal.restart_at(s.nodes)


def gemini_cost(s: Setting, cal: Calibration, mtbf_s: float, interval: int | None = None) -> Cost:
    net, t = node_network(s, cal), s.iteration_s
    stall = network_stall_s(GEMINI_REMOTE_COPIES * s.node_state_bytes, net, t)
    per_ckpt = stall
    fixed = global_restart_s(s, cal) + s.node_state_bytes / net.full
    k = interval or oracle_interval(per_ckpt, t, fixed, mtbf_s)
    recovery = periodic_recovery_s(fixed, k, t)
    return Cost("gemini", per_ckpt / (k * t), recovery, k, None, stall, cal.zero_loss_gemini, cal.restart_s)


def checkfreq_cost(s: Setting, cal: Calibration, interval: int | None = None) -> Cost:
    t, gpu_bytes = s.iteration_s, s.node_state_bytes / GPUS_PER_NODE
    persist = s.cluster_state_bytes / s.blob_bw
    stall = max(0.0, gpu_bytes / s.pcie_bw - t) + cal.persist_interference * persist
    k = interval or checkfreq_interval(stall, persist, t, CHECKFREQ_CAP)
    overhead = (stall + max(0.0, persist - k * t)) / (k * t)
    recovery = periodic_recovery_s(global_restart_s(s, cal) + persist, k, t) + min(persist, k * t)
    return Cost("checkfreq", overhead, recovery, k, None, stall, cal.zero_loss_checkfreq, cal.restart_s)


def moc_bytes(s: Setting, fraction: float) -> float:
    """A node's MoC checkpoint: all non-expert state and `fraction` of the experts'."""
    return s.node_state_bytes * (1 - s.expert_state_share + s.expert_state_share * fraction)


def moc_bandwidth(s: Setting, cal: Calibration) -> float:
    """MoC's checkpoint bandwidth per node: the one that gives its first K the stated overhead, else the
    NIC's bulk rate (the share of an iteration the NIC is idle, all of it while training waits)."""
    if s.moc_start_overhead is not None:
        return moc_bytes(s, MOC_START_FRACTION) / ((1 + s.moc_start_overhead) * s.iteration_s)
    return node_network(s, cal).full


def moc_overhead(s: Setting, fraction: float, cal: Calibration | None = None) -> float:
    """MoC's per-iteration overhead when it checkpoints `fraction` of the experts every iteration
    (`cal` is needed only where the setting states no first-K overhead)."""
    if s.moc_start_overhead is None and cal is None:
        raise ValueError(f"{s.name}: MoC needs its overhead at the first K or a calibration")
    bandwidth = moc_bandwidth(s, cal)  # type: ignore[arg-type]
    return overlapped_stall_s(moc_bytes(s, fraction) / bandwidth, s.iteration_s) / s.iteration_s


def moc_recovery_s(s: Setting, cal: Calibration) -> float:
    fixed = global_restart_s(s, cal) + s.node_state_bytes / node_network(s, cal).full
    return fixed + MOC_REPLAY_ITERATIONS * s.iteration_s


def moevement_cost(
    s: Setting,
    cal: Calibration,
    shares: list[list[float]] | None = None,
    ablation: Ablation = FULL,
    window: int | None = None,
) -> Cost:
    """Algorithm 1's window (or `window`, forced) on the operators in popularity order; recovery
    localized unless ablated."""
    net, t, bw = node_network(s, cal), s.iteration_s, snapshot_bandwidth(s)
    ops = ordered_operators(s.operators, shares, ablation.reorder)
    fp32, comp = [o.fp32 for o in ops], [o.compute for o in ops]
    if window is None:
        window, o_active = find_window_size(fp32, comp, t, bw)
    else:
        o_active = slot_size_for(len(ops), window)
        window = math.ceil(len(ops) / o_active)
    slots = [range(i * o_active, min(len(ops), (i + 1) * o_active)) for i in range(window)]
    sizes = snapshot_sizes(slots, fp32, comp)
    stall = max(0.0, max(sizes) / bw - t)
    frozen = (
        stage_frozen_fractions(s.operators, shares, ablation.reorder, slots)
        if ablation.skip_bweight
        else [0.0] * window
    )
    restart = cal.restart_at(1) if ablation.localized else global_restart_s(s, cal)
    fetch = sum(sizes) * GPUS_PER_NODE / net.full
    recovery = moevement_recovery_s(restart, fetch, list(frozen), t, t)
    return Cost("moevement", stall / t, recovery, None, window, stall, cal.zero_loss_moevement, cal.restart_s)
