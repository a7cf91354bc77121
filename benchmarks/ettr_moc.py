"""MoC in `benchmarks.ettr` as MoC-System specifies it (§5.3), and its lost tokens charged.

Adaptive configuration: MoC checkpoints every iteration (`checkpoint.interval = auto`), each checkpoint the
non-expert state and K_pec routed experts per MoE layer, K_pec the most whose snapshot the iteration it
overlaps still hides at the run's snapshot bandwidth cap (`baselines.moc.adaptive_k`), the smallest such
K over the stages (one K for every rank). The overlapped time is the first reference's iteration T; it
includes the optimizer step, which the copy does not overlap, so the snapshot may outlast the forward and
backward by at most that step (no F&B time alone is measured). Dynamic-K then doubles K_pec after each
recovery while the run's aggregated PLT exceeds 3.75% (the trainer's `GlobalRollback`).

Charged: a lost token's update must be trained again, which costs the run its own time per routed token
(wall seconds over every routed token it processed, recomputed ones included, as PLT counts them):
`ettr_charged = useful / (wall + lost x wall / processed) = ettr / (1 + PLT)`.
"""

from __future__ import annotations

import dataclasses

from baselines.moc import adaptive_k
from benchmarks.ettr_runs import RunTotals
from models.experts import GroupedExperts
from trainer.config import Config
from trainer.estimates.training_state_bytes import rank_parts

STATE_BYTES = 12  # per parameter in a snapshot: FP32 master weight + AdamW's two moments
PLT_BUDGET = 0.0375  # MoC-System's (§3.1.2): accuracy holds while PLT stays at or below it


def stage_bytes(cfg: Config, pp: int) -> list[tuple[float, float]]:
    """Per pipeline stage, (non-expert, routed-expert) snapshot bytes of its FP32 state."""
    cfg = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, pp=pp))
    out = []
    for stage in range(pp):
        experts = other = 0
        for part in rank_parts(cfg, stage):
            for module in part.modules():
                count = sum(p.numel() for p in module.parameters(recurse=False))
                experts, other = (
                    (experts + count, other) if isinstance(module, GroupedExperts) else (experts, other + count)
                )
        out.append((STATE_BYTES * other, STATE_BYTES * experts))
    return out


def first_k(cfg: Config, pp: int, cap_gbps: float, overlap_s: float) -> int:
    """MoC's adaptive K_pec: the smallest over the stages of the most experts per layer whose snapshot copies
    within `overlap_s` at `cap_gbps` (Gbit/s per rank)."""
    rate = cap_gbps * 1e9 / 8
    n = cfg.model.n_routed_experts
    return min(adaptive_k(other, experts, n, rate, overlap_s) for other, experts in stage_bytes(cfg, pp))


def routed_per_iteration(cfg: Config) -> int:
    """Expert assignments one iteration routes: every token of the global batch to top_k experts in each MoE
    layer (what MoC's PLT counts as processed)."""
    m, t = cfg.model, cfg.training
    moe_layers = sum(1 for layer in range(m.n_layers) if m.is_moe_layer(layer))
    return t.batch_size * t.seq_len * m.top_k * moe_layers


def charged(totals: RunTotals, ettr: float, routed: int) -> dict[str, float]:
    """MoC's final PLT over the whole run (lost / every routed assignment of every iteration it ran) and its
    ETTR with each lost token charged as the run's time per routed token."""
    processed = routed * (totals.iterations + totals.recomputed)
    plt = totals.lost_tokens / processed if processed else 0.0
    return {"plt": plt, "ettr_charged": ettr / (1 + plt)}
