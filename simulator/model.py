"""The one model behind every command: a scale-study preset (or a Table 2 testbed) through the calibrated
mechanisms (`simulator.mechanisms`) over a 12-hour run with Poisson failures (`simulator.run`).

    python -m simulator --preset 671B-16384 --mtbf-min 10     # `predict` on one preset
    python -m simulator --paper                               # `predict` on the four paper presets
    python -m simulator --paper-tables                        # the same for Figure 11, beside the paper

`Overrides` changes the hardware a command assumes (`--host-gbs`, `--nic-gbps`, `--snapshot-cap-gbs`)
and the fixed restart (`--restart-s`); without them every command prints the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from simulator.calibrated import FITTED, Calibration
from simulator.cluster import GB, Preset
from simulator.mechanisms import checkfreq_cost, gemini_cost, moevement_cost
from simulator.run import RunResult, finite, moc_run
from simulator.scale import from_preset
from simulator.setting import Setting
from simulator.testbed import RUN_S

STRATEGIES = ("moevement", "gemini", "checkfreq", "moc")
TABLE3_ORDER = ("checkfreq", "gemini", "moc", "moevement")
Shares = Sequence[Sequence[float]] | None


@dataclass(frozen=True)
class Overrides:
    """What-if changes to a setting's hardware and the calibrated restart (None: as assumed)."""

    host_gbs: float | None = None  # GPU -> host copy bandwidth, GB/s
    nic_gbps: float | None = None  # a node's NIC line rate, Gb/s
    snapshot_cap_gbs: float | None = None  # cap on snapshot copies while training runs, GB/s per GPU
    restart_s: float | None = None  # the scope-independent part of every restart, seconds

    def setting(self, s: Setting) -> Setting:
        changes = {
            "pcie_bw": None if self.host_gbs is None else self.host_gbs * GB,
            "node_nic_bw": None if self.nic_gbps is None else self.nic_gbps * GB / 8,
            "snapshot_cap_bw": None if self.snapshot_cap_gbs is None else self.snapshot_cap_gbs * GB,
        }
        return replace(s, **{k: v for k, v in changes.items() if v is not None})

    def calibration(self, cal: Calibration) -> Calibration:
        return cal if self.restart_s is None else replace(cal, restart_s=self.restart_s)


NO_OVERRIDES = Overrides()


def preset_setting(preset: Preset, overrides: Overrides = NO_OVERRIDES) -> Setting:
    """The bottleneck node of `preset` on the testbed's hardware, with `overrides` applied."""
    return overrides.setting(from_preset(preset))


def predict_setting(
    s: Setting,
    mtbf_s: float,
    strategies: Sequence[str] = STRATEGIES,
    interval: int | None = None,
    window: int | None = None,
    cal: Calibration = FITTED,
    shares: Shares = None,
    run_s: float = RUN_S,
) -> list[RunResult]:
    """Each strategy of `strategies` on `s` at `mtbf_s`; `interval` fixes Gemini's and CheckFreq's k,
    `window` MoEvement's W (MoC checkpoints every iteration); `shares`: expert popularity per MoE layer
    (None: uniform)."""
    runs = {
        "moevement": lambda: finite(moevement_cost(s, cal, shares, window=window), mtbf_s, run_s),
        "gemini": lambda: finite(gemini_cost(s, cal, mtbf_s, interval), mtbf_s, run_s),
        "checkfreq": lambda: finite(checkfreq_cost(s, cal, interval), mtbf_s, run_s),
        "moc": lambda: moc_run(s, cal, mtbf_s, shares, run_s),
    }
    return [runs[name]() for name in strategies]


def run_all(s: Setting, cal: Calibration, mtbf_s: float, shares: Shares = None) -> dict[str, RunResult]:
    """Every strategy on one setting and MTBF, by name (Table 3's order)."""
    return {r.strategy: r for r in predict_setting(s, mtbf_s, TABLE3_ORDER, cal=cal, shares=shares)}


def predict(
    preset: Preset,
    mtbf_s: float,
    strategies: Sequence[str] = STRATEGIES,
    interval: int | None = None,
    window: int | None = None,
    overrides: Overrides = NO_OVERRIDES,
) -> list[RunResult]:
    """`predict_setting` on `preset`'s bottleneck node with `overrides` and the fitted constants."""
    cal = overrides.calibration(FITTED)
    return predict_setting(preset_setting(preset, overrides), mtbf_s, strategies, interval, window, cal)


def speedup(moevement: float, gemini: float) -> float:
    """MoEvement's training speed over Gemini's: the ratio of their ETTRs."""
    return moevement / gemini if gemini > 0 else math.inf
