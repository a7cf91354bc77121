"""MoEvement planning: Algorithm 1 (window size, schedule), expert popularity, operator registry."""

import dataclasses
import gc
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from models import ModelArgs, build_model
from models.experts import named_tensors
from moevement.checkpoint.popularity import PopularityTracker, changed_experts, layer_shares
from moevement.checkpoint.schedule import (
    WindowPlan,
    byte_slots,
    byte_window_size,
    find_window_size,
    generate_schedule,
    order_operators,
    slot_size_for,
    snapshot_sizes,
)
from moevement.operators import OPTIMIZER_KEYS, build_registry
from tests.tiny_moe import ARGS as TINY_ARGS
from trainer.config import operator_count
from trainer.model_operators import stacked_operators

L1, L2 = "layers.1.moe", "layers.2.moe"


# ---- Algorithm 1: FindWindowSize ------------------------------------------------------------------


def test_snapshot_sizes_hand_case():
    # slots [0,1] [2]: SS_0 = fp32 0+1 + compute 2 = 24 + 2; SS_1 = fp32 2 = 12
    assert snapshot_sizes([[0, 1], [2]], [12, 12, 12], [2, 2, 2]) == [26, 12]


@pytest.mark.parametrize(
    "bandwidth, expected",
    [
        # 6 operators, fp32=12, compute=2; all slots full -> max snapshot is SS_0 = 12k + 2(6-k):
        # k=6: 72, k=5: 62, k=4: 52, k=3: 42, k=2: 32, k=1: 22
        (30, (6, 1)),  # only k=1 (22) fits
        (35, (3, 2)),  # k=2 (32) fits, k=3 (42) does not
        (42, (2, 3)),  # budget equal to the largest snapshot fits (<=)
        (41.5, (3, 2)),
        (1000, (1, 6)),  # everything in one slot
        (1, (6, 1)),  # nothing fits: one per slot
    ],
)
def test_find_window_size_uniform(bandwidth, expected):
    assert find_window_size([12] * 6, [2] * 6, 1.0, bandwidth) == expected


def test_find_window_size_budget_is_iteration_times_bandwidth():
    assert find_window_size([12] * 6, [2] * 6, 0.5, 84) == (2, 3)  # budget 42: k=3 fits exactly
    assert find_window_size([12] * 6, [2] * 6, 2.0, 16) == (3, 2)  # budget 32: k=2 fits exactly
    assert find_window_size([12] * 6, [2] * 6, 0.25, 84) == (6, 1)  # budget 21 < 22: fallback


def test_find_window_size_heterogeneous():
    fp32, compute = [10, 40, 10, 10], [1, 4, 1, 1]
    # k=4: 70. k=3: [0,1,2][3] -> 60+1=61, 10. k=2: [0,1][2,3] -> 50+2=52, 20.
    # k=1: 10+6=16, 40+2=42, 10+1=11, 10 -> max 42 (the big operator's own slot dominates)
    assert find_window_size(fp32, compute, 1.0, 70) == (1, 4)
    assert find_window_size(fp32, compute, 1.0, 61) == (2, 3)
    assert find_window_size(fp32, compute, 1.0, 60) == (2, 2)
    assert find_window_size(fp32, compute, 1.0, 52) == (2, 2)
    assert find_window_size(fp32, compute, 1.0, 51) == (4, 1)
    assert find_window_size(fp32, compute, 1.0, 41) == (4, 1)  # nothing fits: fallback
    assert find_window_size([], [], 1.0, 1.0) == (1, 1)


def _random_sizes(gen: torch.Generator, n: int) -> tuple[list[int], list[int]]:
    """(fp32, compute) bytes of n operators: compute 1-19, FP32 state 2-7x that."""
    compute = torch.randint(1, 20, (n,), generator=gen).tolist()
    return [c * int(torch.randint(2, 8, (1,), generator=gen)) for c in compute], compute


def _fits(fp32: list[float], compute: list[float], budget: float, k: int) -> bool:
    """Whether every window of k active operators fits the budget (the brute-force definition)."""
    return all(sum(fp32[s : s + k]) + sum(compute[s + k :]) <= budget for s in range(0, len(fp32), k))


def test_find_window_size_matches_brute_force():
    """Largest fitting O_active against an independent snapshot computation, on random sizes."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        fp32, compute = _random_sizes(gen, n)
        budget = float(torch.randint(1, 3 * sum(fp32), (1,), generator=gen))
        k = max([k for k in range(1, n + 1) if _fits(fp32, compute, budget, k)], default=1)
        assert find_window_size(fp32, compute, 1.0, budget) == (math.ceil(n / k), k)


# ---- slots cut by bytes (checkpoint.slots = "bytes") ----------------------------------------------


def _cuts(n: int, window: int):
    """Every way to cut n operators into at most `window` consecutive non-empty slots (as index lists)."""
    import itertools

    for k in range(1, min(n, window) + 1):
        for bounds in itertools.combinations(range(1, n), k - 1):
            edges = (0, *bounds, n)
            yield [list(range(a, b)) for a, b in zip(edges, edges[1:])]


def test_byte_window_size_hand_cases():
    # uniform fp32=12, compute=2, budget 30: [0] 22, [1,2] 12+12+2*3=30, [3,4] 24+2=26, [5] 12 -> 4 (count: 6)
    assert byte_window_size([12] * 6, [2] * 6, 1.0, 30) == 4
    assert find_window_size([12] * 6, [2] * 6, 1.0, 30)[0] == 6
    # the big operator (40 + 2 after it) exceeds 41 alone: its own slot; the others pack around it
    assert byte_window_size([10, 40, 10, 10], [1, 4, 1, 1], 1.0, 41) == 3
    assert byte_window_size([10, 40, 10, 10], [1, 4, 1, 1], 1.0, 1000) == 1


def test_byte_window_size_is_the_fewest_fitting_slots():
    gen = torch.Generator().manual_seed(1)
    for _ in range(60):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        fp32, compute = _random_sizes(gen, n)
        budget = int(torch.randint(max(fp32) + sum(compute), 3 * sum(fp32), (1,), generator=gen))
        best = min(len(cut) for cut in _cuts(n, n) if max(snapshot_sizes(cut, fp32, compute)) <= budget)
        assert byte_window_size(fp32, compute, 1.0, budget) == best
        assert byte_window_size(fp32, compute, 1.0, budget) <= find_window_size(fp32, compute, 1.0, budget)[0]


def test_byte_slots_minimise_the_largest_snapshot_and_cover_every_operator_once():
    gen = torch.Generator().manual_seed(2)
    for _ in range(60):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        window = int(torch.randint(1, 11, (1,), generator=gen))
        fp32, compute = _random_sizes(gen, n)
        names = [f"op{i}" for i in range(n)]
        slots = byte_slots(names, fp32, compute, window)
        assert len(slots) == window and [x for slot in slots for x in slot] == names
        got = max(snapshot_sizes([[names.index(x) for x in slot] for slot in slots], fp32, compute))
        assert got == min(max(snapshot_sizes(cut, fp32, compute)) for cut in _cuts(n, window))


# ---- Algorithm 1: GenerateSchedule, WindowPlan ----------------------------------------------------


def test_generate_schedule_slots():
    ops = ["a", "b", "c", "d", "e"]
    assert generate_schedule(ops, 2, 3) == (("a", "b"), ("c", "d"), ("e",))
    assert generate_schedule(ops, 2, 4) == (("a", "b"), ("c", "d"), ("e",), ())  # trailing empty slot
    assert generate_schedule(ops, 5, 1) == (tuple(ops),)
    with pytest.raises(ValueError):
        generate_schedule(ops, 2, 2)  # 4 places for 5 operators
    with pytest.raises(ValueError):
        generate_schedule(ops, 0, 10)


def test_slot_size_for_covers_every_operator_once():
    for n in range(1, 41):
        names = [f"op{i}" for i in range(n)]
        for window in range(1, n + 4):
            o_active = slot_size_for(n, window)
            slots = generate_schedule(names, o_active, window)
            assert len(slots) == window and all(len(s) <= o_active for s in slots)
            assert [name for s in slots for name in s] == names, (n, window)
    assert slot_size_for(10, 3) == 4 and slot_size_for(3, 10) == 1


def test_window_plan():
    plan = WindowPlan(10, (("a", "b"), ("c",), ("d", "e")))
    assert (plan.window_size, plan.end) == (3, 13)
    assert [plan.slot_at(i) for i in (10, 11, 12)] == [0, 1, 2]
    for outside in (9, 13):
        with pytest.raises(ValueError):
            plan.slot_at(outside)
    assert plan.frozen_after(0) == ("c", "d", "e")
    assert plan.frozen_after(1) == ("d", "e")
    assert plan.frozen_after(2) == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.start = 0
    # a window longer than its operators need ends in empty slots (a pipeline stage with few operators)
    sparse = WindowPlan(0, (("a",), (), ("b",)) + ((),) * 5)
    assert [sparse.frozen_after(slot) for slot in range(sparse.window_size)] == [("b",), ("b",)] + [()] * 6
    assert sparse == WindowPlan(0, (("a",), (), ("b",)) + ((),) * 5)  # the cached bound is no field


def test_order_operators():
    names = ["layers.1", "e0", "e1", "router", "e2", "e3", "head"]
    experts = [False, True, True, False, True, True, False]
    popularity = {"e0": 5.0, "e1": 2.0, "e2": 2.0, "router": -1.0}  # e3 missing -> 0
    assert order_operators(names, experts, popularity) == ["e3", "e1", "e2", "e0", "layers.1", "router", "head"]
    assert order_operators(names, experts, {}) == ["e0", "e1", "e2", "e3", "layers.1", "router", "head"]


# ---- popularity --------------------------------------------------------------------------------------


def experts(prefix, values):
    return {f"{prefix}.experts.{e}": float(v) for e, v in enumerate(values)}


def observed(policy, **kwargs):
    """A tracker that saw two iterations of layer 1 (and soft statistics for layer 2)."""
    tracker = PopularityTracker(policy, **kwargs)
    tracker.observe({L1: torch.tensor([1, 2, 3, 4])}, {L2: torch.tensor([0.5, 0.25, 0.25, 0.0])})
    tracker.observe({L1: torch.tensor([1, 0, 0, 3])}, {L2: torch.tensor([0.25, 0.25, 0.25, 0.25])})
    return tracker


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("count", experts(L1, [2, 2, 3, 7])),  # summed tokens
        ("soft", experts(L2, [0.75, 0.5, 0.5, 0.25])),  # summed gate probabilities
        ("ema", experts(L1, [0.175, 0.1, 0.15, 0.575])),  # .5*[.1,.2,.3,.4] + .5*[.25,0,0,.75]
        ("capacity", experts(L1, [4 / 7, 4 / 7, 6 / 7, 2.0])),  # tokens / mean load 3.5
    ],
)
def test_policies(policy, expected):
    """A first window's statistics become the popularity the order is built from."""
    tracker = observed(policy, ema_decay=0.5)
    tracker.close_window()
    current = tracker.popularity()
    assert current.keys() == expected.keys()
    for name, value in expected.items():
        assert current[name] == pytest.approx(value), name


def test_observing_and_closing_windows_never_read_the_statistics_on_the_host():
    """On a GPU a read would wait for the device (its optimizer step): statistics and the reorder rule stay
    where the statistics are until an order is built from them (meta tensors have no values, so any host
    read would raise)."""
    for policy in ("count", "soft", "ema", "capacity"):
        tracker = PopularityTracker(policy)
        for _ in range(3):
            for _ in range(2):
                tokens = {L1: torch.zeros(4, dtype=torch.int64, device="meta"), L2: torch.zeros(2, device="meta")}
                tracker.observe(tokens, {L1: torch.zeros(4, device="meta")})
            tracker.close_window()
        held = [*tracker.reference.values(), *tracker.reference_shares.values(), *tracker.ema.values()]
        assert tracker.unread and {t.device.type for t in held} == {"meta"}, policy
        with pytest.raises(NotImplementedError):  # the one read, where an order is built
            tracker.popularity()


def test_layers_of_different_widths_keep_their_own_experts():
    tracker = PopularityTracker("capacity")
    tracker.observe({L1: torch.tensor([1, 2, 3, 6]), L2: torch.tensor([4, 0])}, {})
    tracker.close_window()
    assert tracker.popularity() == experts(L1, [1 / 3, 2 / 3, 1.0, 2.0]) | experts(L2, [2.0, 0.0])


def test_the_fixed_policy_keeps_the_models_order_whatever_the_load():
    tracker = observed("fixed")
    tracker.close_window()
    assert tracker.reference is None and not tracker.unread and tracker.popularity() == {}
    counted = observed("count")  # the same statistics reorder under a popularity policy
    counted.close_window()
    assert counted.unread and counted.popularity() == experts(L1, [2, 2, 3, 7])


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown ordering policy"):
        PopularityTracker("random")


def shares(l1, l2):
    """Shares of two 4-expert layers, stacked as the tracker stacks them."""
    return {((L1, 4), (L2, 4)): layer_shares(torch.tensor([l1, l2], dtype=torch.float64))}


def test_changed_experts_thresholds():
    before = shares([10, 18, 18, 18], [1, 1, 1, 1])
    # expert 0: 10/64 -> 11/64 is exactly +10% (not changed; 64ths keep the float maths exact);
    # expert 1: 18 -> 17 is -5.6%
    assert changed_experts(before, shares([11, 17, 18, 18], [1, 1, 1, 1])) == 0
    # just over 10%: 1 changed of 8
    assert changed_experts(before, shares([11.01, 16.99, 18, 18], [1, 1, 1, 1])) == 1
    # +20% and -11.1% in layer 1, layer 2 shares unchanged although scaled by 7
    assert changed_experts(before, shares([12, 16, 18, 18], [7, 7, 7, 7])) == 2
    assert changed_experts(before, before) == 0
    assert changed_experts(shares([0, 0, 0, 0], [1, 0, 0, 0]), shares([0, 0, 0, 0], [1, 0, 0, 0])) == 0


def test_closing_a_window_reorders_on_large_changes_only():
    tracker = PopularityTracker("count")
    ref = [100, 180, 180, 180]
    tracker.observe({L1: torch.tensor(ref)}, {})
    tracker.close_window()  # the first window always sets the order
    assert tracker.popularity() == experts(L1, ref)
    assert tracker.window_tokens == {}  # window statistics were reset
    # +11% and -6.1%: 1 of 4 experts changed = 0.25, not more than 0.25
    tracker.observe({L1: torch.tensor([111, 169, 180, 180])}, {})
    tracker.close_window()
    assert tracker.popularity() == experts(L1, ref)  # reference kept
    # +20% and -11.1%: 2 of 4 = 0.5 against the reference
    tracker.observe({L1: torch.tensor([60, 80, 90, 90])}, {})
    tracker.observe({L1: torch.tensor([60, 80, 90, 90])}, {})
    tracker.close_window()
    assert tracker.popularity() == experts(L1, [120, 160, 180, 180])
    tracker.close_window()  # a window without statistics changes nothing and reads nothing
    assert not tracker.unread and tracker.popularity() == experts(L1, [120, 160, 180, 180])


# ---- operator registry ----------------------------------------------------------------------------


def tiny(family):
    return build_model(ModelArgs(**{**TINY_ARGS, "family": family, "max_seq_len": 64}))


@pytest.mark.parametrize("family", ["deepseek", "qwen"])
def test_registry_partitions_parameters(family):
    model = tiny(family)
    ops = build_registry(model, stacked_operators(model))

    def moe(layer):
        return (
            [(f"layers.{layer}", "block"), (f"layers.{layer}.moe.router", "router")]
            + [(f"layers.{layer}.moe.experts.{e}", "expert") for e in range(4)]
            + [(f"layers.{layer}.moe", "shared_expert")]
        )

    expected = [("tok_embeddings", "embedding"), ("layers.0", "block"), *moe(1), *moe(2), ("head", "head")]
    assert [(op.name, op.kind) for op in ops] == expected
    owned = [name for op in ops for name in op.params]
    tensors = dict(named_tensors(model))  # each routed expert's slice of the stacked weights under its own name
    assert sorted(owned) == sorted(tensors)  # every tensor in exactly one operator
    assert all(ref.local().data_ptr() == tensors[name].data_ptr() for op in ops for name, ref in op.params.items())
    by_name = {op.name: op for op in ops}
    assert set(by_name["head"].params) == {"norm.weight", "output.weight"}
    assert (by_name["layers.2.moe.experts.3"].layer, by_name["layers.2.moe.experts.3"].expert) == (2, 3)
    assert set(by_name["layers.1.moe.experts.0"].params) == {f"layers.1.moe.experts.0.w{i}.weight" for i in (1, 2, 3)}
    shared = set(by_name["layers.1.moe"].params)
    assert ("layers.1.moe.shared_expert_gate.weight" in shared) == (family == "qwen")
    assert "layers.1.moe.shared_experts.w1.weight" in shared
    assert "layers.1.moe.router.gate.weight" in by_name["layers.1.moe.router"].params


def _sizes_worker(rank: int, store_path: str, out_dir: str) -> None:
    """Two FSDP replicas of a model whose dimension 0 does not divide by 2: its operators' sizes."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from parallelisms.fsdp import _within_each_expert

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        # the embedding and head: 33 rows on rank 0, 32 on rank 1; stacked experts split evenly along dim 1
        model = build_model(ModelArgs(**{**TINY_ARGS, "vocab_size": 65}))
        stacked = stacked_operators(model)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)), shard_placement_fn=_within_each_expert)
        ops = build_registry(model, stacked)
        optimizer = torch.optim.AdamW(model.parameters())
        sizes = [[op.fp32_bytes(optimizer), op.compute_bytes(torch.bfloat16)] for op in ops]
        local = [sum(ref.local().numel() for ref in op.params.values()) for op in ops]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"sizes": sizes, "local": local}))
        del model, ops, optimizer
        gc.collect()  # FSDP's hooks hold the group: free them before the group goes
    finally:
        dist.destroy_process_group()


def test_operator_sizes_agree_across_replicas_of_uneven_shards(tmp_path):
    """Guarantee: the replicas of a data-parallel group plan the same slots: operator sizes count the largest
    shard any replica holds, so two FSDP replicas whose local parts differ by a row (2 real gloo processes)
    give every operator the same FP32 and compute bytes (which `checkpoint.slots = bytes` cuts by)."""
    import torch.multiprocessing as mp

    mp.spawn(_sizes_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["local"] != ranks[1]["local"], "the local parts differ"
    assert ranks[0]["sizes"] == ranks[1]["sizes"]


@pytest.mark.parametrize(
    "shape",
    [
        {"family": "deepseek"},
        {"family": "deepseek", "n_shared_experts": 0},
        {"family": "qwen", "n_shared_experts": 1},
        {"family": "gpt", "n_shared_experts": 0, "tie_embeddings": True},
        {"family": "deepseek", "n_layers": 5, "n_dense_layers": 1, "moe_every": 2},
    ],
)
def test_operator_count_is_what_the_registry_finds(shape):
    """`operator_count` (the config's bound on `checkpoint.window`) counts, without a model, the operators
    `build_registry` finds in the whole model."""
    args = ModelArgs(**{**TINY_ARGS, "max_seq_len": 64, **shape})
    model = build_model(args)
    assert operator_count(args) == len(build_registry(model, stacked_operators(model)))


def test_registry_rejects_unknown_tensor_and_undescribed_stacked_experts():
    model = nn.Module()
    model.foo = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="foo"):
        build_registry(model)
    with pytest.raises(ValueError, match="stacks several experts"):
        build_registry(tiny("deepseek"))


def test_operator_bytes_and_master_tensors():
    model = tiny("deepseek")
    ops = build_registry(model, stacked_operators(model))
    optimizer = torch.optim.AdamW(model.parameters())
    param_bytes = {op.name: sum(ref.local().numel() * 4 for ref in op.params.values()) for op in ops}
    for op in ops:
        assert op.fp32_bytes(optimizer) == 3 * param_bytes[op.name]  # AdamW moments assumed
        assert op.compute_bytes(torch.bfloat16) == 2 * op.numel() == param_bytes[op.name] // 2
        assert [n for n, _ in op.master_tensors(optimizer)] == list(op.params)
        assert [n for n, _ in op.compute_tensors()] == list(op.params)
    sum(p.square().sum() for p in model.parameters()).backward()
    optimizer.step()
    for op in ops:
        state = sum(
            t.numel() * t.element_size()
            for ref in op.params.values()
            for k in OPTIMIZER_KEYS
            if (t := ref.state(optimizer, k)) is not None
        )
        assert op.fp32_bytes(optimizer) == param_bytes[op.name] + state
        assert op.fp32_bytes(optimizer) == 3 * param_bytes[op.name] + 4 * len(op.params)  # fp32 step scalars
    expert = next(op for op in ops if op.name == "layers.1.moe.experts.0")
    names = [n for n, _ in expert.master_tensors(optimizer)]
    expected = list(expert.params) + [
        f"optim.{p}.{k}" for p in expert.params for k in ("exp_avg", "exp_avg_sq", "step")
    ]
    assert names == expected
    tensors = dict(expert.master_tensors(optimizer))
    w1 = "layers.1.moe.experts.0.w1.weight"
    stacked = model.layers["1"].moe.experts.w1  # expert 0 is its slice 0
    assert torch.equal(tensors[f"optim.{w1}.exp_avg_sq"], optimizer.state[stacked]["exp_avg_sq"][0])
    assert torch.equal(tensors[f"optim.{w1}.step"], optimizer.state[stacked]["step"])
    assert torch.equal(tensors[w1], stacked[0].detach())
