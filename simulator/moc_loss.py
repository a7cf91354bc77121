"""What one MoC failure loses: iterations' worth of expert updates (MoC-System's lost tokens).

MoC-System's two-level recovery (§5.1): healthy nodes restore from their in-memory snapshots, but
the restarted node has lost its memory and loads its experts from persistent storage, where an
expert is as new as the last persist that carried it. Round robin saves expert e at persists
= e mod period (period = 1 / fraction), one persist every `moc_loss_scale` iterations, so an
expert restored at phase p is moc_loss_scale x ((p - e) mod period) iterations stale; the loss per
failure is that staleness averaged over experts weighted by token share (uniform:
moc_loss_scale (period - 1) / 2).

`moc_loss_scale` is thus MoC's persist interval in iterations. Back-to-back persists of the whole
cluster's state over Blob Storage would put it at 4-16 on the testbed (`persist_interval`: state /
40 Gb/s / T per model); the fit uses one value for every model, as the per-model values fit the 2H
and 1H rows several times worse: MoE-LLaVa's and GPT-MoE's (4 and 9 iterations) never escalate at
1H, where Table 3's MoC has.
"""

from __future__ import annotations

from collections.abc import Sequence

from simulator.calibrated import Calibration
from simulator.setting import Setting
from simulator.skew import round_robin_staleness


def persist_interval(s: Setting) -> float:
    """Iterations a back-to-back persist of the whole cluster's state over the storage bandwidth takes."""
    return s.cluster_state_bytes / s.blob_bw / s.iteration_s


def moc_lost_iterations(
    cal: Calibration, fraction: float, iteration: int, shares: Sequence[Sequence[float]] | None
) -> float:
    """Iterations' worth of expert updates one failure loses at expert fraction `fraction`."""
    period = max(1, round(1 / fraction))
    if shares is None:
        return cal.moc_loss_scale * (period - 1) / 2
    phase = int(iteration / max(1.0, cal.moc_loss_scale))  # persists so far
    stale = [round_robin_staleness(p, period, phase) for p in shares]
    return cal.moc_loss_scale * sum(stale) / len(stale)
