"""The window planner's order and W with the router statistics kept on their device (moevement/checkpoint/
planner.py, popularity.py): the same decisions as when every window read its statistics on the host and
ordered before Algorithm 1, and no read at all for a window of one slot.

The oracle, `RuleAsBefore`, is the rule as the planner applied it before W came first: at each window
boundary the policy's popularity of the closed window in host floats, the reorder rule in Python, the order
rebuilt when due, then Algorithm 1 over the operators' sizes in that order. Windows alternate between one
slot and several, and the statistics switch between two load patterns, so that an order set by a one-slot
window's statistics is the one a later window of several slots uses."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from models import ModelArgs, build_model
from moevement.checkpoint.options import SparseOptions
from moevement.checkpoint.planner import WindowPlanner
from moevement.checkpoint.schedule import find_window_size, generate_schedule, order_operators, slot_size_for
from moevement.operators import build_registry, optimizer_tensors
from tests.tiny_moe import ARGS, tiny_engine
from trainer.model_operators import stacked_operators

DECAY = 0.5
BANDWIDTH = 1.0  # bytes/s: iteration_s below is the budget of a snapshot in bytes
# (one slot?, the load pattern of the window's iterations); the profile's iterations show pattern "A"
WINDOWS = [(True, "B"), (False, "B"), (True, "A"), (True, "A"), (False, "A"), (False, "B"), (True, "B"), (False, "A")]
PATTERNS = {"A": [1, 2, 3, 4], "B": [4, 3, 2, 1]}


def statistics(pattern: str, layers: list[str], rng: random.Random) -> tuple[dict, dict]:
    """One iteration's (routed-token counts, gate-probability sums) per layer: the pattern's loads within +-3%."""
    tokens, probs = {}, {}
    for i, layer in enumerate(layers):
        load = [w * (1 + i) * 1000 * rng.uniform(0.97, 1.03) for w in PATTERNS[pattern]]
        tokens[layer] = torch.tensor([round(x) for x in load], dtype=torch.int64)
        probs[layer] = torch.tensor([x / sum(load) for x in load], dtype=torch.float32)
    return tokens, probs


class RuleAsBefore:
    """The oracle: the planner's order and W as decided before (see the module docstring)."""

    def __init__(self, policy: str, names: list[str], experts: list[bool]):
        self.policy, self.names, self.experts = policy, names, experts
        self.order, self.reference = list(names), None
        self.tokens, self.soft, self.ema = defaultdict(float), defaultdict(float), {}
        self.decisions: list[tuple[int, bool]] = []  # (W, due) per window

    def observe(self, tokens: dict, probs: dict) -> None:
        for layer, counts in tokens.items():
            total = max(float(counts.sum()), 1.0)
            for e, v in enumerate(counts.tolist()):
                name = f"{layer}.experts.{e}"
                self.tokens[name] += v
                old = self.ema.get(name)
                self.ema[name] = v / total if old is None else DECAY * old + (1 - DECAY) * (v / total)
        for layer, p in probs.items():
            for e, v in enumerate(p.double().tolist()):
                self.soft[f"{layer}.experts.{e}"] += v

    def now(self) -> dict[str, float]:
        if self.policy == "capacity":
            totals = defaultdict(float)
            for n, v in self.tokens.items():
                totals[layer_of(n)] += v
            return {n: v / max(totals[layer_of(n)] / 4, 1e-12) for n, v in self.tokens.items()}
        return dict({"count": self.tokens, "soft": self.soft, "ema": self.ema}[self.policy])

    def plan(self, sizes: dict, iteration_s: float, max_window: int) -> tuple[int, list[str]]:
        now = self.now()
        self.tokens, self.soft = defaultdict(float), defaultdict(float)
        due = bool(now) and (self.reference is None or changed_fraction(self.reference, now) > 0.25)
        if due:
            self.reference, self.order = now, order_operators(self.names, self.experts, now)
        fp32, compute = [sizes[n][0] for n in self.order], [sizes[n][1] for n in self.order]
        window = min(max_window, find_window_size(fp32, compute, iteration_s, BANDWIDTH)[0])
        self.decisions.append((window, due))
        return window, fp32


def changed_fraction(before: dict[str, float], after: dict[str, float]) -> float:
    """The rule as it was: the fraction of experts whose share of their layer moved by more than 10%."""
    a, b = layer_shares(before), layer_shares(after)
    names = a.keys() | b.keys()
    return sum(abs(b.get(n, 0.0) - a.get(n, 0.0)) > 0.1 * a.get(n, 0.0) for n in names) / len(names)


def layer_shares(values: dict[str, float]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for name, v in values.items():
        totals[layer_of(name)] += v
    return {n: v / totals[layer_of(n)] if totals[layer_of(n)] else 0.0 for n, v in values.items()}


def layer_of(expert: str) -> str:
    return expert.rsplit(".experts.", 1)[0]


def tiny_planner(policy: str) -> tuple[WindowPlanner, list]:
    """A planner (Algorithm 1, `policy`) over the tiny MoE's operators after one optimizer step, the copy
    bandwidth fixed; and the optimizer's state tensors."""
    torch.manual_seed(0)
    model = build_model(ModelArgs(**ARGS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.zeros(1, 4, dtype=torch.int64)).float().mean().backward()
    optimizer.step()
    ops = build_registry(model, stacked_operators(model))
    cfg = SparseOptions(window=0, max_window=4, ordering=policy, ema_decay=DECAY)
    planner = WindowPlanner(cfg, ops, optimizer, torch.float32, torch.device("cpu"), 1, None)
    planner.profile.measured_bandwidth = BANDWIDTH
    return planner, optimizer_tensors(optimizer)


def uneven_sizes(planner: WindowPlanner) -> dict[str, tuple[int, int]]:
    """Operator sizes where experts differ: Algorithm 1's W depends on which experts come first."""
    return {
        name: ((1000 * (1 + i % 3), 250 * (1 + i % 3)) if expert else (3000, 750))
        for i, (name, expert) in enumerate(zip(planner.registry_order, planner.is_expert, strict=True))
    }


@pytest.mark.parametrize("alike", [True, False], ids=["experts-alike", "experts-uneven"])
@pytest.mark.parametrize("policy", ["count", "soft", "ema", "capacity"])
def test_order_and_window_as_decided_before(tmp_path, policy, alike):
    planner, state = tiny_planner(policy)
    sizes = planner._op_bytes(state) if alike else uneven_sizes(planner)
    planner._op_bytes = lambda _state: sizes
    oracle = RuleAsBefore(policy, planner.registry_order, planner.is_expert)
    layers = sorted({layer_of(n) for n, e in zip(planner.registry_order, planner.is_expert, strict=True) if e})
    several = sum(f for f, _ in sizes.values()) / 2.5  # a budget that needs a few slots; one slot: every byte
    rng, iteration = random.Random(1), 3
    for _ in range(2):  # the profile's iterations
        observed = statistics("A", layers, rng)
        planner.observe(*observed)
        oracle.observe(*observed)
    for index, (one_slot, pattern) in enumerate(WINDOWS):
        budget = 1e12 if one_slot else several
        planner.profile.iteration_s = budget
        plan = planner.plan(iteration, index, index > 0, tmp_path, state)
        window, fp32 = oracle.plan(sizes, budget, planner.cfg.max_window)
        assert plan.window_size == window and (window == 1) == one_slot, index
        assert planner.last_inputs.fp32_bytes == tuple(fp32)  # what metrics.profile writes
        if window > 1:
            assert plan.slots == generate_schedule(oracle.order, slot_size_for(len(oracle.order), window), window)
        else:
            assert sorted(plan.slots[0]) == sorted(planner.registry_order)
        for _ in range(window):
            observed = statistics(pattern, layers, rng)
            planner.observe(*observed)
            oracle.observe(*observed)
        iteration += window
    if policy == "count":  # a reorder due at a one-slot window, then a window of several slots not due
        pairs = zip(oracle.decisions, oracle.decisions[1:])
        assert any(w0 == 1 and due0 and w1 > 1 and not due1 for (w0, due0), (w1, due1) in pairs), oracle.decisions


def test_windows_of_one_slot_read_no_statistics(tmp_path):
    """Statistics on the meta device (no values: any host read raises) through windows of one slot chosen by
    Algorithm 1; the first window of several slots is where the order is read, once."""
    planner, state = tiny_planner("count")
    meta = {"layers.1.moe": torch.zeros(4, dtype=torch.int64, device="meta")}
    for index in range(4):
        planner.observe(meta, {})
        planner.profile.iteration_s = 1e12
        assert planner.plan(3 + index, index, index > 0, tmp_path, state).window_size == 1
    assert planner.tracker.unread
    planner.observe(meta, {})
    planner.profile.iteration_s = sum(planner._op_bytes(state)[n][0] for n in planner.registry_order) / 2.5
    with pytest.raises(NotImplementedError):  # the read: meta tensors have no values
        planner.plan(7, 4, True, tmp_path, state)


@pytest.mark.parametrize("opts", [{"window": 1}, {"window": 0, "ordering": "fixed"}])
def test_where_the_order_cannot_change_no_statistics_are_kept(tmp_path, opts):
    """A fixed W = 1 (one slot), or the fixed policy: an engine's training loop keeps no router statistics."""
    model, optimizer, engine = tiny_engine(tmp_path / "rank0", **opts)
    planner = engine.planner
    planner.observe({"layers.1.moe": torch.ones(4, dtype=torch.int64)}, {})
    assert planner.order_fixed and planner.tracker.window_tokens == {} and planner.tracker.ema == {}
    engine.close()
