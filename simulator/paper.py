"""The paper's scale study (§5.4, Appendix C): every strategy's ETTR on the paper's four clusters.

    python -m simulator --paper [--no-figure] [--json] [--out DIR]

From the paper: the four clusters (`simulator.presets`: stages x pipelines x 8-way expert
parallelism, models of 32B-671B parameters), the ETTR formula (`simulator.formula`), the iteration
model (`simulator.cluster`), MTBFs of 60, 30 and 10 minutes and the figures compared against
(671B, 10 minutes: MoEvement 0.86, Gemini 0.55; MoEvement at least 0.91 at a 1-hour MTBF at every
scale). Everything else is an assumption of this simulator:

- model shapes (`simulator.presets`): DeepSeekMoE 145B and DeepSeek-V3 (671B) as published; 32B
  and 67B grown from DeepSeekMoE 16B's recipe, as no public DeepSeek-MoE model has those sizes.
- micro-batches M = global batch / (pipelines x ep), one 4096-token sequence each: 15360 sequences
  (DeepSeek-V3's batch) for 671B, 4608 (DeepSeekMoE's 4.5K) for the others.
- per-GPU state: 12 B/param (FP32 master + Adam m, v) of every parameter a GPU holds, not sharded
  over data parallelism (DeepSpeed pipeline + expert parallelism without ZeRO); the paper gives no
  per-GPU size. 19.7 GB per GPU for 671B.
- layer placement: every stage costs the bottleneck's ceil(layers / stages) layers; embeddings and
  the output head sit on no stage (simplification).
- host link: 25 GB/s GPU -> pinned host per GPU. PCIe Gen5 x16 carries 64 GB/s a direction; about
  25 when a node's 8 GPUs copy at once (estimate).
- network: a 400 Gb/s NIC per GPU (50 GB/s, collectives at 40 GB/s, ~80%); all-to-all inside the
  NVLink domain at 150 GB/s (estimates for H100/H800 nodes).
- collective latency alpha: 30 us (all-to-all) and 50 us (data parallel) for any group size, where
  the paper has alpha(p); the bandwidth terms dominate at these message sizes.
- compute: 989 TFLOP/s dense BF16 at 35% MFU; HBM 3.35 TB/s for the optimizer step (H100/H800 SXM
  peaks; the MFU is an estimate for large MoE training).
- restart: 60 s per failure for every strategy (relaunch, communicator set-up, reload: an
  estimate; the paper states none).
- replication: each snapshot goes to 2 peers in the NIC's idle time (Gemini-style redundancy).
- CheckFreq's disk: 1 GB/s per GPU; MoC's K_pec: experts / 8 (estimates).
- E[R] of an interval strategy counts one iteration more than the paper's half interval (see
  `simulator.formula`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from simulator.cluster import GB, Preset
from simulator.colours import colour
from simulator.panels import ettr_panels, save_panels
from simulator.presets import PAPER_PRESETS
from simulator.strategies import Scenario, simulate

MTBFS_MIN = (60.0, 30.0, 10.0)
STUDY_STRATEGIES = ("moevement", "gemini", "checkfreq", "moc")
PAPER_REPORTED: dict[tuple[str, float], dict[str, float]] = {("671B-16384", 10.0): {"moevement": 0.86, "gemini": 0.55}}
PAPER_MIN_ETTR_1H = 0.91  # MoEvement at a 1-hour MTBF, every scale
STUDY_FIGURE = "simulated_ettr_vs_mtbf.png"  # its file name in the run's output directory


@dataclass(frozen=True)
class StudyRow:
    """One preset at one MTBF: ETTR per strategy, MoEvement's window and Gemini's interval."""

    preset: str
    mtbf_min: float
    ettr: dict[str, float]
    window: int
    gemini_interval: int

    @property
    def speedup(self) -> float:
        """MoEvement's training speed over Gemini's: the ratio of their ETTRs."""
        return self.ettr["moevement"] / self.ettr["gemini"] if self.ettr["gemini"] > 0 else float("inf")


def scale_study(presets: Iterable[Preset] = PAPER_PRESETS.values(), mtbfs_min=MTBFS_MIN) -> list[StudyRow]:
    """Every preset at every MTBF."""
    rows = []
    for preset in presets:
        for mtbf in mtbfs_min:
            res = {r.strategy: r for r in simulate(preset, mtbf * 60, STUDY_STRATEGIES)}
            ettr = {s: r.ettr for s, r in res.items()}
            rows.append(StudyRow(preset.name, mtbf, ettr, res["moevement"].window, res["gemini"].interval))
    return rows


def layout_table(presets: Iterable[Preset] = PAPER_PRESETS.values()) -> str:
    """Markdown: each preset's layout, iteration time and per-GPU state."""
    columns = ["preset", "params (B)", "GPUs", "stages x pipelines x ep", "M", "iteration (s)"]
    columns += ["FP32 state/GPU (GB)", "dense copy (s)"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for p in presets:
        sc, lay = Scenario.of(p), p.layout
        lines.append(
            f"| {p.name} | {p.model.total_params() / 1e9:.1f} | {lay.gpus} | {lay.pp} x {lay.pipelines} x {lay.ep} "
            f"| {lay.micro_batches} | {sc.iteration_s:.2f} | {sc.dense_bytes / GB:.1f} "
            f"| {sc.dense_bytes / sc.snapshot_bw:.2f} |"
        )
    return "\n".join(lines)


def study_table(rows: Sequence[StudyRow]) -> str:
    """Markdown: ETTR per strategy, W, Gemini's k, MoEvement's speedup and the paper's figure where it has one."""
    columns = ["preset", "MTBF (min)", *STUDY_STRATEGIES, "W", "gemini k", "speedup", "paper"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in rows:
        paper = PAPER_REPORTED.get((r.preset, r.mtbf_min), {})
        cited = " / ".join(f"{s} {v:.2f}" for s, v in paper.items())
        cited = f"moevement >= {PAPER_MIN_ETTR_1H:.2f}" if r.mtbf_min == 60.0 else cited
        values = " | ".join(f"{r.ettr[s]:.3f}" for s in STUDY_STRATEGIES)
        lines.append(
            f"| {r.preset} | {r.mtbf_min:g} | {values} | {r.window} | {r.gemini_interval} "
            f"| {r.speedup:.2f}x | {cited} |"
        )
    return "\n".join(lines)


def plot_study(rows: Sequence[StudyRow], path: Path) -> None:
    """One panel per model, grouped bars of ETTR per MTBF; the paper's reported points as black marks."""
    presets = list(dict.fromkeys(r.preset for r in rows))
    fig, axes = ettr_panels(len(presets), 3.4)
    width = 0.8 / len(STUDY_STRATEGIES)
    for ax, name in zip(axes, presets):
        mine = [r for r in rows if r.preset == name]
        for i, strategy in enumerate(STUDY_STRATEGIES):
            xs = [j + (i - (len(STUDY_STRATEGIES) - 1) / 2) * width for j in range(len(mine))]
            ax.bar(xs, [r.ettr[strategy] for r in mine], width, label=strategy, color=colour(strategy))
            for x, r in zip(xs, mine):
                reported = PAPER_REPORTED.get((name, r.mtbf_min), {}).get(strategy)
                if reported is not None:
                    ax.plot([x], [reported], "kx", markersize=8, label="paper" if strategy == "moevement" else None)
        ax.set_xticks(range(len(mine)), [f"{r.mtbf_min:g}" for r in mine])
        ax.set_title(name, fontsize=10)
    save_panels(fig, axes, "simulated ETTR", str(path), 0.08)
