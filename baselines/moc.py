"""MoC-System's partial expert checkpointing (PEC), the baseline `checkpoint.strategy = "moc"`.

Each checkpoint holds the full FP32 state of every non-expert operator and of `K_pec` routed
experts per MoE layer. Experts are chosen *sequentially* (a cursor advances by `K_pec` per
checkpoint, so every expert is saved once every `ceil(E / K_pec)` checkpoints) and *interleaved*:
MoE layer `j` starts `j * E / ep` experts further on, so consecutive layers save experts that
live on different expert-parallel ranks and the save work is spread over the EP group.

Recovery restores every operator from its newest save, stale experts included, and replays
nothing: the updates an expert received since its save are lost. The proportion of lost tokens
(PLT) counts them from the per-expert routed-token counts. Dynamic-K (MoC-System §5.3): after each
recovery, `K_pec` doubles while the run's aggregated PLT exceeds a threshold (3.75% by default), up to
all experts. Its first `K_pec` is MoC-System's adaptive configuration (`adaptive_k`): the most experts
whose snapshot, taken every iteration, the iteration's forward and backward still hide.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from moevement.operators import Operator


def adaptive_k(
    non_expert_bytes: float, expert_bytes: float, n_experts: int, bytes_per_s: float, overlap_s: float
) -> int:
    """MoC-System's adaptive K_snapshot (§5.3): the largest K in 1..`n_experts` whose snapshot (the
    `non_expert_bytes` and K / `n_experts` of the routed `expert_bytes`) copies at `bytes_per_s` within
    `overlap_s`, the forward and backward it overlaps; 1 where even one expert per layer does not fit.
    An uncapped copy (`bytes_per_s` 0) fits every expert."""
    if bytes_per_s <= 0:
        return n_experts
    spare_s = overlap_s - non_expert_bytes / bytes_per_s
    per_expert_s = expert_bytes / n_experts / bytes_per_s
    fits = math.floor(spare_s / per_expert_s + 1e-9) if per_expert_s > 0 else n_experts
    return max(1, min(n_experts, fits))


def moc_selection(cursor: int, moe_layers: int, n_experts: int, ep: int, k: int) -> list[list[int]]:
    """Experts saved by the checkpoint at `cursor` (the sum of earlier checkpoints' K), per MoE layer position."""
    k = min(k, n_experts)
    stride = n_experts // ep  # experts per EP rank: layer j starts on the next rank's experts
    return [[(cursor + j * stride + i) % n_experts for i in range(k)] for j in range(moe_layers)]


class PartialExpertSelector:
    """Which operators each MoC checkpoint saves; the same on every rank (global expert indices)."""

    def __init__(self, ops: list[Operator], moe_layers: list[int], n_experts: int, ep: int, k: int):
        self.ops, self.n_experts, self.ep, self.k = ops, n_experts, ep, min(k, n_experts)
        self.position = {layer: j for j, layer in enumerate(sorted(moe_layers))}  # global MoE layer -> position
        self.cursor = 0

    def next_checkpoint(self) -> list[str]:
        """Operator names of the next checkpoint (non-expert + this rank's selected experts); advances."""
        chosen = moc_selection(self.cursor, len(self.position), self.n_experts, self.ep, self.k)
        self.cursor += self.k
        return [op.name for op in self.ops if op.kind != "expert" or op.expert in chosen[self.position[op.layer]]]

    def double(self) -> None:
        self.k = min(2 * self.k, self.n_experts)


class LostTokens:
    """Per-expert routed-token counts by iteration, to account what a stale-expert restore loses.

    `observe(t, counts)` records iteration t's counts (global over data parallelism) per expert
    operator; `account(t_c, saved_at)` returns (lost, processed): the tokens routed to each expert
    from its restored save up to the rollback iteration t_c, and every token routed so far
    (recomputed iterations included, so PLT = lost / processed stays a proportion). History at
    or after t_c is dropped (those iterations run again). After a restart the history holds one entry per
    checkpoint interval, keyed by its first iteration (`MocState.resumed`), which `account` reads alike."""

    def __init__(self) -> None:
        self.history: dict[int, dict[str, float]] = {}
        self.processed = 0.0

    def observe(self, iteration: int, counts: dict[str, float]) -> None:
        self.history[iteration] = counts
        self.processed += sum(counts.values())

    def account(self, rollback_to: int, saved_at: dict[str, int]) -> tuple[float, float]:
        lost = sum(
            n
            for t, counts in self.history.items()
            if t < rollback_to
            for op, n in counts.items()
            if t >= saved_at.get(op, 1)
        )  # never saved: lost since the start
        self.history = {t: c for t, c in self.history.items() if t < rollback_to}
        return lost, self.processed

    def since(self, first: int) -> dict[str, float]:
        """Tokens routed to each expert from iteration `first` on."""
        out: dict[str, float] = defaultdict(float)
        for t, counts in self.history.items():
            if t >= first:
                for op, n in counts.items():
                    out[op] += n
        return dict(out)


def expert_counts(tokens: dict[str, torch.Tensor], local_experts: set[str]) -> dict[str, float]:
    """{expert operator name: routed tokens} from `take_expert_load`'s {MoE module name: counts}, local experts only."""
    out: dict[str, float] = defaultdict(float)
    for module, counts in tokens.items():
        for e, n in enumerate(counts.tolist()):
            name = f"{module}.experts.{e}"
            if name in local_experts:
                out[name] += n
    return dict(out)
