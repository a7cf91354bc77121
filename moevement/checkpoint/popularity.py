"""Expert popularity from router load statistics, and the rule for when to reorder operators.

Popularity is tracked per routed-expert operator (`<moe prefix>.experts.<e>`) from the per-layer
statistics the MoE layers accumulate each iteration: routed-token counts and summed gate
probabilities. Policies:
  count     routed tokens in the last window (default)
  soft      summed gate probabilities in the last window
  ema       exponential moving average of the per-iteration share of a layer's tokens
  capacity  routed tokens relative to the layer's mean load (the capacity of a balanced router)
  fixed     none: operators keep the model's order (the ablation of the paper's Figure 13)
Operators are reordered when, for more than 25% of experts, the policy's share of its layer moved
by more than 10% since the order was last set (docs/design.md §2); the caller applies the new order at
the next window boundary.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal, get_args

import torch

Policy = Literal["count", "soft", "ema", "capacity", "fixed"]
POLICIES: tuple[str, ...] = get_args(Policy)
CHANGE = 0.10  # relative change of an expert's share that counts as "changed"
FRACTION = 0.25  # share of experts that must change to trigger a reorder


Layers = tuple[tuple[str, int], ...]  # MoE layers observed together: (prefix, experts) in observation order


class PopularityTracker:
    """Router statistics summed over a window, stacked: one (layers x experts) double tensor per set of layers,
    on the device the statistics come from. Observing an iteration costs a few device ops and never waits for
    the device; the statistics reach the host once per window (`current`)."""

    def __init__(self, policy: str = "count", ema_decay: float = 0.9):
        if policy not in POLICIES:
            raise ValueError(f"unknown ordering policy {policy!r} (allowed: {', '.join(POLICIES)})")
        self.policy, self.ema_decay = policy, ema_decay
        self.window_tokens: dict[Layers, torch.Tensor] = {}
        self.window_soft: dict[Layers, torch.Tensor] = {}
        self.ema: dict[Layers, torch.Tensor] = {}
        self.reference: dict[str, float] | None = None  # popularity the current order was built from

    def observe(self, tokens: dict[str, torch.Tensor], gate_probs: dict[str, torch.Tensor]) -> None:
        """Add one iteration's statistics, keyed by MoE-layer prefix (`layers.3.moe`)."""
        if tokens:
            layers, counts = _stacked(tokens)
            _accumulate(self.window_tokens, layers, counts)
            share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
            old = self.ema.get(layers)
            self.ema[layers] = share if old is None else self.ema_decay * old + (1 - self.ema_decay) * share
        if gate_probs:
            _accumulate(self.window_soft, *_stacked(gate_probs))

    def current(self) -> dict[str, float]:
        """This policy's popularity per expert operator over the statistics seen since `end_window` (none for
        `fixed`, so its order never changes)."""
        if self.policy == "fixed":
            return {}
        source = {
            "count": self.window_tokens,
            "soft": self.window_soft,
            "ema": self.ema,
            "capacity": self.window_tokens,
        }[self.policy]
        out = {}
        for layers, stacked in source.items():
            for (layer, n_experts), row in zip(layers, stacked.cpu(), strict=True):
                values = row[:n_experts]
                if self.policy == "capacity":
                    values = values / values.mean().clamp(min=1e-12)
                out.update({f"{layer}.experts.{e}": float(v) for e, v in enumerate(values.tolist())})
        return out

    def end_window(self) -> bool:
        """Close the statistics window; True (and adopt it as the reference) when a reorder is due.

        A window without statistics changes nothing. The `ema` average spans windows by design.
        """
        now = self.current()
        if not now:
            return False
        due = self.reference is None or changed_fraction(self.reference, now) > FRACTION
        if due:
            self.reference = now
        self.window_tokens, self.window_soft = {}, {}
        return due

    def drop_window(self) -> None:
        """Close the statistics window without looking at it (an order that cannot matter: one slot)."""
        self.window_tokens, self.window_soft = {}, {}

    def popularity(self) -> dict[str, float]:
        """The popularity the current order is built from (empty before any statistics)."""
        return dict(self.reference or {})


def changed_fraction(before: dict[str, float], after: dict[str, float]) -> float:
    """Fraction of experts whose share of their layer changed by more than CHANGE (relative)."""
    a, b = _layer_shares(before), _layer_shares(after)
    names = a.keys() | b.keys()
    if not names:
        return 0.0
    return sum(abs(b.get(n, 0.0) - a.get(n, 0.0)) > CHANGE * a.get(n, 0.0) for n in names) / len(names)


def _layer_shares(values: dict[str, float]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for name, v in values.items():
        totals[_layer(name)] += v
    return {name: v / totals[_layer(name)] if totals[_layer(name)] else 0.0 for name, v in values.items()}


def _layer(expert_op: str) -> str:
    return expert_op.rsplit(".experts.", 1)[0]


def _stacked(per_layer: dict[str, torch.Tensor]) -> tuple[Layers, torch.Tensor]:
    """One row per layer, as doubles (integer counts stay exact), zero-padded to the widest layer."""
    rows = [v.detach().reshape(-1) for v in per_layer.values()]
    width = max(r.numel() for r in rows)
    padded = [r if r.numel() == width else torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows]
    layers = tuple((layer, r.numel()) for layer, r in zip(per_layer, rows, strict=True))
    return layers, torch.stack(padded).double()


def _accumulate(window: dict[Layers, torch.Tensor], layers: Layers, values: torch.Tensor) -> None:
    old = window.get(layers)
    window[layers] = values if old is None else old + values
