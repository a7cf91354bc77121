"""The paper's scale study (§5.4, Figure 11): every strategy's ETTR on the paper's four clusters.

    python -m simulator --paper [--no-figure] [--json] [--out DIR]

The clusters are `simulator.presets.PAPER_PRESETS` (32B-671B on 512-16,384 GPUs); each runs through
the one calibrated model (`simulator.model`: the testbed's node, the mechanisms and constants fitted
on Table 3's 2H and 1H rows, a 12-hour run with Poisson failures) at MTBFs of 60, 30 and 10 minutes.
The paper's figures compared against: 671B at 10 minutes, MoEvement 0.86 and Gemini 0.55; MoEvement
at least 0.91 at a 1-hour MTBF at every scale. `--paper-tables` prints the same rows beside them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from simulator.calibrated import FITTED, Calibration
from simulator.cluster import GB, Preset
from simulator.colours import colour
from simulator.model import NO_OVERRIDES, STRATEGIES, Overrides, predict_setting, preset_setting, speedup
from simulator.panels import ettr_panels, save_panels
from simulator.presets import PAPER_PRESETS
from simulator.profile import snapshot_bandwidth

MTBFS_MIN = (60.0, 30.0, 10.0)
CURVE_MTBFS_MIN = (120.0, 90.0, 60.0, 45.0, 30.0, 20.0, 15.0, 10.0)
STUDY_STRATEGIES = STRATEGIES
PAPER_REPORTED: dict[tuple[str, float], dict[str, float]] = {("671B-16384", 10.0): {"moevement": 0.86, "gemini": 0.55}}
PAPER_MIN_ETTR_1H = 0.91  # MoEvement at a 1-hour MTBF, every scale
STUDY_FIGURE = "simulated_ettr_vs_mtbf.png"  # its file name in the run's output directory
FIG11_FIGURE = "paper_fig11_simulated.png"


@dataclass(frozen=True)
class StudyRow:
    """One preset at one MTBF: ETTR per strategy, MoEvement's window and Gemini's interval."""

    preset: str
    gpus: int
    iteration_s: float
    mtbf_min: float
    ettr: dict[str, float]
    window: int
    gemini_interval: int

    @property
    def speedup(self) -> float:
        return speedup(self.ettr["moevement"], self.ettr["gemini"])


def scale_study(
    presets: Iterable[Preset] = PAPER_PRESETS.values(),
    mtbfs_min=MTBFS_MIN,
    cal: Calibration = FITTED,
    overrides: Overrides = NO_OVERRIDES,
) -> list[StudyRow]:
    """Every preset at every MTBF through `simulator.model`."""
    rows, cal = [], overrides.calibration(cal)
    for preset in presets:
        s = preset_setting(preset, overrides)
        for mtbf in mtbfs_min:
            res = {r.strategy: r for r in predict_setting(s, mtbf * 60, cal=cal)}
            ettr = {name: r.ettr for name, r in res.items()}
            window, k = res["moevement"].window, res["gemini"].interval
            rows.append(StudyRow(preset.name, s.gpus, s.iteration_s, mtbf, ettr, window, k))
    return rows


def layout_table(presets: Iterable[Preset] = PAPER_PRESETS.values()) -> str:
    """Markdown: each preset's layout, iteration time, per-node state and MoEvement's snapshot bandwidth."""
    columns = ["preset", "params (B)", "GPUs", "stages x pipelines x ep", "M", "iteration (s)"]
    columns += ["FP32 state/node (GB)", "snapshot B/GPU (GB/s)"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for p in presets:
        s, lay = preset_setting(p), p.layout
        lines.append(
            f"| {p.name} | {p.model.total_params() / 1e9:.1f} | {lay.gpus} | {lay.pp} x {lay.pipelines} x {lay.ep} "
            f"| {lay.micro_batches} | {s.iteration_s:.2f} | {s.node_state_bytes / GB:.1f} "
            f"| {snapshot_bandwidth(s) / GB:.3f} |"
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


def plot_fig11(cal: Calibration, path: str, paper: dict[str, float], min_1h: float) -> None:
    """One panel per cluster: ETTR against MTBF for MoEvement and Gemini; the paper's 671B / 10-minute
    points as black crosses and its 1-hour MoEvement floor as a dotted line."""
    rows = scale_study(mtbfs_min=CURVE_MTBFS_MIN, cal=cal)
    presets = list(dict.fromkeys(r.preset for r in rows))
    fig, axes = ettr_panels(len(presets), 3.3)
    for ax, name in zip(axes, presets):
        mine = [r for r in rows if r.preset == name]
        for s in ("moevement", "gemini"):
            ax.plot([r.mtbf_min for r in mine], [r.ettr[s] for r in mine], "o-", color=colour(s), label=s, ms=3)
        if name == "671B-16384":
            ax.plot([10.0, 10.0], [paper["moevement"], paper["gemini"]], "kx", ms=8, label="paper (671B, 10 min)")
        ax.axhline(min_1h, color="tab:blue", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_xticks([10, 20, 30, 60, 120], ["10", "20", "30", "60", "120"])
        ax.set_title(f"{name} (T {mine[0].iteration_s:.0f} s)", fontsize=9)
    save_panels(fig, axes, "simulated ETTR", path, 0.1)
