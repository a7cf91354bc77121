"""The simulator's constants that are not hardware facts, and their values fitted on Table 3's 2H and 1H rows.

    python -m simulator.fit        # refits them, prints what it fitted and writes it to fit.txt

Every other input is a hardware or workload fact (`simulator.testbed`) or a stated design constant
of a strategy (below). What each fitted constant stands for:

- nic_efficiency: the share of a node's 80 Gb/s that checkpoint and training traffic achieve.
- copy_interference: seconds of training lost per second a GPU spends copying to host memory over
  PCIe (snapshots, upstream logs): copies and compute share the GPU's memory system and the PCIe link.
- persist_interference: seconds of training lost per second CheckFreq persists to Blob Storage
  (its background writer competes for host CPU and PCIe).
- local_restart_s: the fixed cost of a localized recovery (detect, replace the node, restart the
  failed data-parallel group).
- global_restart_s: the fixed cost of a global restart of the 96-GPU cluster; at n GPUs it grows as
  local + (global - local) log2(n) / log2(96) (every rank re-joins; rendezvous and communicator
  set-up are tree-shaped), a stated form, not fitted.
- moc_loss_scale: iterations of a failed run's expert updates lost per iteration of round-robin
  staleness (the failed node restores from its persisted, older partial checkpoint).

Design constants, from the papers: MoEvement and Gemini each keep two copies of a checkpoint in CPU
memory, the local one and one remote (Table 6: Gemini 26 B/param = 2 x 13, MoEvement's sparse
checkpoints 29 B/param = 2 x 14.6; §4's "r = 2 peers" would be three copies, which Table 6 does not
show), so each snapshot crosses the NIC once; CheckFreq caps its
overhead at 3% (§5.2); MoC starts at 12.5% of experts (Fig. 10c), doubles K whenever the
accumulated proportion of lost tokens passes 3.75% (MoC-System's Dynamic-K). MoC's checkpoint path
is not a fitted constant either: its bandwidth is what makes the 12.5% checkpoint cost Table 3's
MoC overhead cell (an input, like the other overhead cells: `simulator.testbed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MOEVEMENT_REMOTE_COPIES = 1
GEMINI_REMOTE_COPIES = 1
CHECKFREQ_CAP = 0.03
MOC_START_FRACTION = 1 / 8
MOC_PLT_BUDGET = 0.0375
CALIBRATION_GPUS = 96


@dataclass(frozen=True)
class Calibration:
    nic_efficiency: float
    copy_interference: float
    persist_interference: float
    local_restart_s: float
    global_restart_s: float
    moc_loss_scale: float

    def global_restart_at(self, gpus: int) -> float:
        """Global restart at `gpus` GPUs: the fitted 96-GPU cost, its excess over a local one growing as log2(n)."""
        excess = self.global_restart_s - self.local_restart_s
        return self.local_restart_s + excess * math.log2(gpus) / math.log2(CALIBRATION_GPUS)


# `python -m simulator.fit`, 2026-11-25 (its output, with every residual: its directory's fit.txt).
FITTED = Calibration(
    nic_efficiency=0.26588,
    copy_interference=1.18753,
    persist_interference=0.171069,
    local_restart_s=12.1211,
    global_restart_s=151.694,
    moc_loss_scale=12.1306,
)
