"""MoEvement's operator order and the FLOPs its frozen operators skip during sparse-to-dense conversion.

Algorithm 1's OrderOperators puts routed experts first, least popular first (so popular ones stay
frozen longest), the other operators last. During conversion iteration j (0-based) the operators of
slots after j are frozen; a frozen operator skips its weight gradient, 1/3 of its FLOPs (§3.5). An
expert's FLOPs are proportional to its token share: `Operator.flops` x E x share.

`Ablation` switches off Figure 13's steps: frozen operators skipping their weight gradient,
popularity reordering, and upstream logging (without it, recovery is a global rollback of every
stage from the sparse checkpoint, with the pipeline bubble, after a global restart).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from simulator.setting import Operator


@dataclass(frozen=True)
class Ablation:
    skip_bweight: bool = True
    reorder: bool = True
    localized: bool = True


def _share(op: Operator, shares: Sequence[Sequence[float]] | None, gpu: int, per_gpu: int) -> float:
    """E x the token share of `op` on GPU `gpu` of the stage (1 for uniform popularity)."""
    if op.expert is None or shares is None:
        return 1.0
    layer, j = op.expert
    p = shares[layer % len(shares)]
    return len(p) * p[(gpu * per_gpu + j) % len(p)]


def _per_gpu(ops: Sequence[Operator]) -> int:
    return sum(1 for o in ops if o.expert is not None and o.expert[0] == 0) or 1


def ordered_operators(
    ops: Sequence[Operator], shares: Sequence[Sequence[float]] | None, reorder: bool, gpu: int = 0
) -> list[Operator]:
    """Experts (ascending popularity when `reorder`, else in index order), then the other operators;
    each expert's `flops` weighted by its share on GPU `gpu`."""
    per_gpu = _per_gpu(ops)
    experts = [
        Operator(o.fp32, o.compute, o.flops * _share(o, shares, gpu, per_gpu), o.expert)
        for o in ops
        if o.expert is not None
    ]
    if reorder:
        experts.sort(key=lambda o: o.flops)
    return experts + [o for o in ops if o.expert is None]


def frozen_fractions(ops: Sequence[Operator], slots: Sequence[Sequence[int]]) -> list[float]:
    """Per conversion iteration j, the FLOP share of operators in slots after j (ops already ordered)."""
    total = sum(o.flops for o in ops) or 1.0
    return [sum(ops[i].flops for later in slots[j + 1 :] for i in later) / total for j in range(len(slots))]


def stage_frozen_fractions(
    ops: Sequence[Operator], shares: Sequence[Sequence[float]] | None, reorder: bool, slots: Sequence[Sequence[int]]
) -> list[float]:
    """`frozen_fractions` averaged over the GPUs of the stage, each ordering its own experts."""
    experts = len(shares[0]) if shares else 1
    gpus = max(1, experts // _per_gpu(ops)) if shares else 1
    per_gpu = [frozen_fractions(ordered_operators(ops, shares, reorder, g), slots) for g in range(gpus)]
    return [sum(f[j] for f in per_gpu) / gpus for j in range(len(slots))]
