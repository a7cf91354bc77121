"""The simulator's constants that are not hardware facts, and their values fitted on Table 3's 2H and 1H rows.

    python -m simulator.fit        # refits them, prints what it fitted and writes it to fit.txt

Every other input is a hardware or workload fact (`simulator.testbed`, `simulator.profile`) or a
stated design constant of a strategy (below). Each fitted constant, its meaning and the range in
which it is physically plausible (`PLAUSIBLE`: the fit stays inside it and says which ends bind):

- nic_efficiency (0.1-1): the share of a node's line rate that a bulk host-to-host transfer of a
  whole node's state achieves (Gemini's remote checkpoint, a recovery's reads). Gemini's stated
  overheads (Fig. 1a's 2.5x, 11-15% at 10M) need it well below 1.
- persist_interference (0-1): seconds of training lost per second CheckFreq persists to Blob Storage.
- restart_s (5-300): the per-failure cost that does not scale with the failed scope: detecting the
  failure, replacing the node, relaunching its processes.
- rejoin_s (0-60): the scope-scaled part of a restart, per log2(nodes) the recovery relaunches
  (every relaunched rank re-joins; rendezvous and communicator set-up are tree-shaped, a stated form,
  not fitted): a global restart relaunches every node, MoEvement's localized one only the replacement
  (the failed stage's data-parallel peers roll back in place), so its restart is `restart_s` alone.
- zero_loss_{checkfreq,gemini,moc,moevement} (0-0.08): the fraction of a failure-free run a strategy
  loses beyond its stated per-iteration overhead (warm-up, persistence and stalls the overhead cell
  does not count). Table 3's rows extrapolate to ETTRs 0-6% below 1 / (1 + overhead) at zero
  failures; these constants carry that gap, fitted on 2H and 1H only (two MTBFs alone barely separate
  it from a long fixed restart; `simulator.fit` weighs each strategy's cells by how well the model fits
  them, so MoC's misfit does not decide it for all).
- moc_loss_scale (4-16): MoC's persist interval in iterations: a restarted node restores its experts
  from storage, as stale as the persist schedule (`simulator.moc_loss`; the range is a whole
  checkpoint over the testbed's 40 Gb/s storage link, per model).

Design constants, from the papers: Gemini keeps one remote copy of a checkpoint (Table 6: 26 B/param
= 2 x 13); MoEvement replicates each snapshot to r = 2 peers (§4's default), so its per-GPU snapshot
bandwidth is the idle NIC's per-GPU share over 2 (`simulator.profile`); CheckFreq caps its overhead
at 3% (§5.2); MoC starts at 12.5% of experts (Fig. 10c), doubles K whenever the accumulated proportion
of lost tokens passes 3.75% (MoC-System's Dynamic-K). MoC's checkpoint bandwidth is what makes the
12.5% checkpoint cost Table 3's MoC overhead cell (an input, like the other overhead cells).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GEMINI_REMOTE_COPIES = 1
MOEVEMENT_REPLICAS = 2
CHECKFREQ_CAP = 0.03
MOC_START_FRACTION = 1 / 8
MOC_PLT_BUDGET = 0.0375


@dataclass(frozen=True)
class Calibration:
    nic_efficiency: float
    persist_interference: float
    restart_s: float
    rejoin_s: float
    zero_loss_checkfreq: float
    zero_loss_gemini: float
    zero_loss_moc: float
    zero_loss_moevement: float
    moc_loss_scale: float

    def restart_at(self, scope_nodes: int) -> float:
        """Restart of a failure that relaunches `scope_nodes` nodes: fixed + rejoin x log2(nodes)."""
        return self.restart_s + self.rejoin_s * math.log2(max(1, scope_nodes))


# Each constant's plausible range (see the module docstring); the fit reports any value outside it.
PLAUSIBLE: dict[str, tuple[float, float]] = {
    "nic_efficiency": (0.1, 1.0),
    "persist_interference": (0.0, 1.0),
    "restart_s": (5.0, 300.0),
    "rejoin_s": (0.0, 60.0),
    "zero_loss_checkfreq": (0.0, 0.08),
    "zero_loss_gemini": (0.0, 0.08),
    "zero_loss_moc": (0.0, 0.08),
    "zero_loss_moevement": (0.0, 0.08),
    "moc_loss_scale": (4.0, 16.0),
}

# `python -m simulator.fit` (its output, with every residual: its directory's fit.txt).
FITTED = Calibration(
    nic_efficiency=0.335024,
    persist_interference=0.15576,
    restart_s=5.0,
    rejoin_s=30.9162,
    zero_loss_checkfreq=0.0138671,
    zero_loss_gemini=0.0249634,
    zero_loss_moc=0.000803232,
    zero_loss_moevement=0.0191214,
    moc_loss_scale=11.3315,
)
