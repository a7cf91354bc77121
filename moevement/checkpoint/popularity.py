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
by more than 10% since the order was last set (docs/design/state-and-snapshots.md); the caller applies the new order at
the next window boundary.

Everything stays on the statistics' device: observing an iteration and closing a window (the reorder rule
included: the reference popularity is replaced on the device where the rule says so) never wait for it.
The host reads the popularity once, for all layers, when an order is built from it (`popularity`), which a
window needs only where its order can matter (more than one slot).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

Policy = Literal["count", "soft", "ema", "capacity", "fixed"]
POLICIES: tuple[str, ...] = get_args(Policy)
CHANGE = 0.10  # relative change of an expert's share that counts as "changed"
FRACTION = 0.25  # share of experts that must change to trigger a reorder


Layers = tuple[tuple[str, int], ...]  # MoE layers observed together: (prefix, experts) in observation order
Stacked = dict[Layers, torch.Tensor]  # one (layers x widest layer's experts) double tensor per set of layers


class PopularityTracker:
    """Router statistics summed over a window, stacked (`Stacked`, zero-padded rows), on the device the
    statistics come from, and the reference popularity the current order is built from (`reference`, the
    policy's values of the window that last triggered a reorder, and their shares of their layers).

    Training thread only. `observe` and `close_window` are device ops that never wait for the device;
    `popularity` reads the reference on the host (one read)."""

    def __init__(self, policy: str = "count", ema_decay: float = 0.9):
        if policy not in POLICIES:
            raise ValueError(f"unknown ordering policy {policy!r} (allowed: {', '.join(POLICIES)})")
        self.policy, self.ema_decay = policy, ema_decay
        self.window_tokens: Stacked = {}
        self.window_soft: Stacked = {}
        self.ema: Stacked = {}
        self.reference: Stacked | None = None  # None: no statistics yet, the order is the model's
        self.reference_shares: Stacked = {}
        self.unread = False  # whether a window closed since `popularity` last read the reference
        self.width_columns: Stacked = {}  # `capacity`: each row's number of experts, where layers differ

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

    def close_window(self) -> None:
        """Close the statistics window and apply the reorder rule to it on the device: the first window with
        statistics becomes the reference; a later one replaces it when more than FRACTION of the experts'
        shares moved by more than CHANGE. A window without statistics changes nothing; the `ema` average
        spans windows by design. Nothing is read on the host."""
        now = self._window_values()
        self.window_tokens, self.window_soft = {}, {}
        if not now:
            return
        shares = {layers: layer_shares(values) for layers, values in now.items()}
        if self.reference is None or self.reference.keys() != now.keys():  # other layers: a new reference
            self.reference, self.reference_shares = now, shares
        else:
            due = reorder_due(self.reference_shares, shares, sum(n for layers in now for _, n in layers))
            self.reference = {k: torch.where(due, now[k], self.reference[k]) for k in now}
            self.reference_shares = {k: torch.where(due, shares[k], self.reference_shares[k]) for k in now}
        self.unread = True

    def popularity(self) -> dict[str, float]:
        """The popularity the order is built from, by expert operator (empty before any statistics): the
        reference read on the host, once for all layers (this waits for the device)."""
        self.unread = False
        if not self.reference:
            return {}
        values = torch.cat([stacked.flatten() for stacked in self.reference.values()]).cpu().tolist()
        out, offset = {}, 0
        for layers, stacked in self.reference.items():
            width = stacked.shape[1]
            for row, (layer, n_experts) in enumerate(layers):
                start = offset + row * width
                out.update({f"{layer}.experts.{e}": values[start + e] for e in range(n_experts)})
            offset += stacked.numel()
        return out

    def _window_values(self) -> Stacked:
        """This policy's popularity per expert over the statistics seen since the last `close_window` (none for
        `fixed`, so its order never changes)."""
        if self.policy == "capacity":  # tokens over the layer's mean load (padding holds no tokens)
            return {
                k: v / (v.sum(dim=1, keepdim=True) / self._widths(k, v)).clamp(min=1e-12)
                for k, v in self.window_tokens.items()
            }
        return {"count": self.window_tokens, "soft": self.window_soft, "ema": self.ema}.get(self.policy, {})

    def _widths(self, layers: Layers, values: torch.Tensor) -> torch.Tensor | int:
        """Each row's number of experts: the row width, or where layers differ in width a column of them on the
        statistics' device (made once per set of layers)."""
        if all(n == values.shape[1] for _, n in layers):
            return values.shape[1]
        if layers not in self.width_columns:
            widths = torch.tensor([[n] for _, n in layers], dtype=values.dtype)
            self.width_columns[layers] = widths.to(values.device)
        return self.width_columns[layers]


def layer_shares(values: torch.Tensor) -> torch.Tensor:
    """Each expert's share of its layer (row), 0 in a layer without any."""
    total = values.sum(dim=1, keepdim=True)
    return torch.where(total != 0, values / total, 0.0)


def changed_experts(before: Stacked, after: Stacked) -> torch.Tensor:
    """How many experts' shares (`layer_shares`) moved by more than CHANGE of their value in `before`: a 0-dim
    tensor on the statistics' device (padding, 0 in both, never counts)."""
    return sum(((after[k] - before[k]).abs() > CHANGE * before[k]).sum() for k in after)


def reorder_due(before: Stacked, after: Stacked, experts: int) -> torch.Tensor:
    """Whether more than FRACTION of the `experts` experts changed (`changed_experts`): a 0-dim bool tensor."""
    return changed_experts(before, after).double() > FRACTION * experts


def _stacked(per_layer: dict[str, torch.Tensor]) -> tuple[Layers, torch.Tensor]:
    """One row per layer, as doubles (integer counts stay exact), zero-padded to the widest layer."""
    rows = [v.detach().reshape(-1) for v in per_layer.values()]
    width = max(r.numel() for r in rows)
    padded = [r if r.numel() == width else torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows]
    layers = tuple((layer, r.numel()) for layer, r in zip(per_layer, rows, strict=True))
    return layers, torch.stack(padded).double()


def _accumulate(totals: Stacked, layers: Layers, values: torch.Tensor) -> None:
    """Add an iteration's `values` to the open window's `totals`."""
    old = totals.get(layers)
    totals[layers] = values if old is None else old + values
