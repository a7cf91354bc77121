"""Each strategy's checkpoint overhead and expected loss per failure on a preset, and its ETTR.

Failures strike uniformly inside an iteration: every strategy loses the aborted iteration (T / 2 on
average) and pays `restart_s`; a checkpoint of state_t is usable once iteration t has finished.
- gemini / checkfreq / moc, interval k: global rollback, (k + 1) / 2 completed iterations redone by
  the whole pipeline on average: E[R] = fixed + (k / 2 + 1) T. Stall per checkpoint max(0, copy - T).
  gemini: k ETTR-optimal (`formula.best_interval`) unless given. checkfreq: smallest k with
  overhead <= 3%; it also waits when a disk persist outlasts k iterations, loads from disk, and its
  newest checkpoint is durable only `persist` s later (that much more lost). moc: every iteration,
  all non-expert state + K_pec experts per MoE layer (round robin; PLT = lost expert updates / all).
- moevement, window W from Algorithm 1 (`moevement.checkpoint.schedule.find_window_size`) unless
  given: the failed stage's data-parallel group fetches the W snapshots and replays W conversion +
  (W - 1) / 2 catch-up iterations on average, each M (t_f + t_b) + T_sync + T_update (one stage, no
  bubble); during conversion (W - 1) / (2W) of the work is frozen on average and skips its weight
  gradients, 1/3 of its FLOPs. Overhead = max(0, largest snapshot - T) / T.
- none: a failure loses everything, so ETTR is 0 with failures (1 without).
Snapshots go to host memory and to `replicas` peers in the NIC's idle time: bandwidth
min(host link, NIC (1 - busy) / replicas, snapshot cap); a peer fetch runs at min(host link, NIC)
(training has stopped, and the cap, like `benchmarks.ettr`'s, holds only during training). Each GPU saves
what it holds: 12 bytes/param of FP32 state; sparse snapshots add 2 bytes/param of bf16 weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from baselines.intervals import checkfreq_interval, checkfreq_overhead
from moevement.checkpoint.schedule import find_window_size, slot_size_for, snapshot_sizes
from simulator.cluster import COMPUTE_BYTES, FP32_STATE_BYTES, Preset, StageModel, stage_model
from simulator.formula import best_interval, paper_ettr

STRATEGIES = ("none", "moevement", "gemini", "checkfreq", "moc")


@dataclass(frozen=True)
class StrategyResult:
    strategy: str
    ettr: float
    overhead: float
    recovery_s: float  # E[R]: seconds lost per failure
    interval: int | None = None
    window: int | None = None
    plt: float | None = None  # moc: fraction of routed-token expert updates lost


@dataclass(frozen=True)
class Scenario:
    """A preset's derived quantities that every strategy uses."""

    preset: Preset
    stage: StageModel
    iteration_s: float
    snapshot_bw: float
    fetch_bw: float
    dense_bytes: float  # FP32 state of one GPU

    @classmethod
    def of(cls, preset: Preset) -> Scenario:
        st, hw = stage_model(preset), preset.hw
        idle = max(0.0, 1 - st.nic_s / st.iteration_s)
        snap = min(hw.host_bw, hw.nic_bw * idle / max(1, preset.layout.replicas), hw.snapshot_cap_bw)
        return cls(preset, st, st.iteration_s, snap, min(hw.host_bw, hw.nic_bw), FP32_STATE_BYTES * st.params)

    def stall_s(self, nbytes: float) -> float:
        return max(0.0, nbytes / self.snapshot_bw - self.iteration_s)


def _moevement(sc: Scenario, mtbf_s: float, window: int | None) -> StrategyResult:
    st, t = sc.stage, sc.iteration_s
    fp32 = [FP32_STATE_BYTES * p for p in st.operators]
    comp = [COMPUTE_BYTES * p for p in st.operators]
    n = len(fp32)
    if window is None:
        window, o_active = find_window_size(fp32, comp, t, sc.snapshot_bw)
    else:
        o_active = slot_size_for(n, window)
    slots = [range(i * o_active, min(n, (i + 1) * o_active)) for i in range(window)]
    sizes = snapshot_sizes(slots, fp32, comp)
    overhead = sc.stall_s(max(sizes)) / t
    replay = window * st.replay_s((window - 1) / (2 * window)) + (window - 1) / 2 * st.replay_s()
    recovery = sc.preset.hw.restart_s + sum(sizes) / sc.fetch_bw + replay + t / 2
    return StrategyResult("moevement", paper_ettr(overhead, recovery, mtbf_s), overhead, recovery, window=window)


def _gemini(sc: Scenario, mtbf_s: float, interval: int | None) -> StrategyResult:
    t, stall = sc.iteration_s, sc.stall_s(sc.dense_bytes)
    fixed = sc.preset.hw.restart_s + sc.dense_bytes / sc.fetch_bw
    k = interval or best_interval(stall, t, fixed, mtbf_s)
    overhead, recovery = stall / (k * t), fixed + (k / 2 + 1) * t
    return StrategyResult("gemini", paper_ettr(overhead, recovery, mtbf_s), overhead, recovery, interval=k)


def _checkfreq(sc: Scenario, mtbf_s: float, interval: int | None) -> StrategyResult:
    t, stall = sc.iteration_s, sc.stall_s(sc.dense_bytes)
    persist = load = sc.dense_bytes / sc.preset.hw.disk_bw  # write and read back at disk speed
    k = interval or checkfreq_interval(stall, persist, t)
    overhead = checkfreq_overhead(k, stall, persist, t)
    durable_lag = min(persist, k * t)  # the newest checkpoint is not on disk yet
    recovery = sc.preset.hw.restart_s + load + (k / 2 + 1) * t + durable_lag
    return StrategyResult("checkfreq", paper_ettr(overhead, recovery, mtbf_s), overhead, recovery, interval=k)


def _moc(sc: Scenario, mtbf_s: float, interval: int | None) -> StrategyResult:
    st, t, m = sc.stage, sc.iteration_s, sc.preset.model
    k_pec = min(m.experts, sc.preset.moc_k_pec or max(1, m.experts // 8))
    k = interval or 1
    nbytes = FP32_STATE_BYTES * (st.nonexpert_params + st.expert_params * k_pec / m.experts)
    overhead = sc.stall_s(nbytes) / (k * t)
    recovery = sc.preset.hw.restart_s + sc.dense_bytes / sc.fetch_bw + (k / 2 + 1) * t
    stale = (m.experts / k_pec - 1) / 2 * k  # extra iterations of expert updates lost per failure
    plt = 0.0 if math.isinf(mtbf_s) else min(1.0, stale * t * (1 + overhead) / mtbf_s)
    return StrategyResult("moc", paper_ettr(overhead, recovery, mtbf_s), overhead, recovery, interval=k, plt=plt)


def _none(sc: Scenario, mtbf_s: float, period: int | None) -> StrategyResult:
    return StrategyResult("none", 1.0 if math.isinf(mtbf_s) else 0.0, 0.0, math.inf)


_EVALUATORS = {"none": _none, "moevement": _moevement, "gemini": _gemini, "checkfreq": _checkfreq, "moc": _moc}


def simulate(
    preset: Preset,
    mtbf_s: float,
    strategies: Sequence[str] = STRATEGIES,
    interval: int | None = None,
    window: int | None = None,
) -> list[StrategyResult]:
    """One result per strategy; `interval` fixes gemini/checkfreq/moc's k, `window` moevement's W."""
    sc = Scenario.of(preset)
    return [_EVALUATORS[s](sc, mtbf_s, window if s == "moevement" else interval) for s in strategies]
