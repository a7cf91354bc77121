"""Expert parallelism: 2 real gloo processes (ep = dp = 2) against a single-process reference."""

from __future__ import annotations

import copy
import gc
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models import ModelArgs, MoE, build_model
from models.experts import named_tensors
from models.moe import load_balancing_loss
from parallelisms.expert_parallel import apply_expert_parallel, local_expert_ids

WORLD = 2
ARGS = dict(
    family="deepseek",
    dim=16,
    n_heads=2,
    n_routed_experts=8,
    top_k=2,
    n_shared_experts=1,
    expert_hidden_dim=24,
    shared_expert_hidden_dim=24,
    aux_loss_coef=0.01,
    vocab_size=64,
)


def test_aux_loss_dp_decomposition():
    """dp ranks, T tokens each, a replicated router W: with l_r = lbl(scores_r, global counts) / dp,
    mean_r l_r == lbl(all scores) and the dp-average of the per-rank grads d l_r / dW == d lbl(all) / dW."""
    torch.manual_seed(0)
    dp, t, dim, e, k = 4, 10, 6, 8, 2
    x = torch.randn(dp * t, dim, dtype=torch.float64)
    weight = torch.randn(e, dim, dtype=torch.float64, requires_grad=True)
    scores = (x @ weight.T).softmax(-1)
    counts = torch.bincount(scores.topk(k, -1).indices.flatten(), minlength=e)
    global_loss = load_balancing_loss(scores, counts, k)
    (global_grad,) = torch.autograd.grad(global_loss, weight, retain_graph=True)
    per_rank = [load_balancing_loss(s, counts, k) / dp for s in scores.split(t)]
    rank_grads = [torch.autograd.grad(loss, weight, retain_graph=True)[0] for loss in per_rank]
    torch.testing.assert_close(torch.stack(per_rank).mean(), global_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.stack(rank_grads).mean(0), global_grad, rtol=1e-10, atol=1e-14)
    assert not torch.allclose(rank_grads[0], global_grad)  # the per-rank grads alone are not the global one


def test_single_process_is_noop():
    torch.manual_seed(0)
    model = build_model(ModelArgs(**ARGS, n_layers=2))
    names = [n for n, _ in model.named_parameters()]
    apply_expert_parallel(model, None, None)
    assert [n for n, _ in model.named_parameters()] == names
    assert "global_load" not in vars(model.layers["0"].moe)
    assert list(local_expert_ids(8, 1, 2)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="divisible"):
        local_expert_ids(8, 0, 3)


def _check_global_load(rank: int, world: int) -> None:
    """Each replica's own counts and gate sums through `global_load` over the dp group."""
    moe = MoE(ModelArgs(**ARGS))
    apply_expert_parallel(moe, None, dist.group.WORLD)
    generator = torch.Generator().manual_seed(rank)
    counts, gate_sums = torch.randint(0, 50, (8,), generator=generator), torch.rand(8, generator=generator) * 40
    g_counts, g_gate_sums, replicas = moe.global_load(counts, gate_sums)
    inputs = torch.stack([counts.double(), gate_sums.double()])
    dist.all_reduce(inputs)  # float64 sums of integers and of float32 values: exact here
    first = g_gate_sums.clone()
    dist.broadcast(first, src=0)
    assert replicas == world and torch.equal(g_counts, inputs[0].long())
    assert (g_gate_sums.double() - inputs[1]).abs().max() < 1e-5, g_gate_sums
    assert torch.equal(g_gate_sums, first), "the same bits on every replica"


def test_load_statistics_are_summed_over_the_data_parallel_group_alike_on_every_replica(tmp_path):
    """Guarantee: popularity orders agree inside a data-parallel group, for every ordering policy: the token
    counts and gate-probability sums each replica's routers saw are summed over the group (2 real gloo
    processes), the sums in fixed point so every replica holds the same bits."""
    mp.spawn(_worker, args=(WORLD, str(tmp_path / "store"), "load"), nprocs=WORLD, join=True)


def _loss_and_grads(layer, x, w, n_tokens):
    """Forward in train mode, backward of sum(out * w) / n_tokens; returns (out, x.grad)."""
    layer.zero_grad(set_to_none=True)
    layer.reset_load_stats()
    x = x.clone().requires_grad_(True)
    out = layer(x)
    ((out * w).sum() / n_tokens).backward()
    return out.detach(), x.grad


def _worker(rank: int, world: int, store_path: str, checks: str) -> None:
    """One process of `world` running the `CHECKS[checks]` functions."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        for check in CHECKS[checks]:
            check(rank, world)
        gc.collect()  # the layers' bound seams hold the groups: free them before the groups go
    finally:
        dist.destroy_process_group()


def _check_moe_layer(rank: int, world: int) -> None:
    group = dist.group.WORLD  # ep = dp = world, as when ep is carved out of dp
    torch.manual_seed(0)
    ref = MoE(ModelArgs(**ARGS)).train()
    layer = copy.deepcopy(ref)
    apply_expert_parallel(layer, group, group)
    owned = local_expert_ids(8, rank, world)
    assert layer.experts.ids == owned and layer.experts.w1.shape[0] == len(owned)
    x_all, w_all = torch.randn(2 * world, 5, 16), torch.randn(2 * world, 5, 16)  # same on every rank
    rows = slice(2 * rank, 2 * rank + 2)
    t_local, t_all = x_all[rows].shape[0] * x_all.shape[1], x_all.shape[0] * x_all.shape[1]

    for aux_only in (False, True):  # aux_only: the loss ignores the output, only the aux loss trains the router
        w, w_ref = (0 * w_all[rows], 0 * w_all) if aux_only else (w_all[rows], w_all)
        ref_out, ref_xgrad = _loss_and_grads(ref, x_all, w_ref, t_all)
        out, xgrad = _loss_and_grads(layer, x_all[rows], w, t_local)
        # (a) outputs; gradients reach every rank's tokens (each rank's loss is dp x its share of the global one)
        torch.testing.assert_close(out, ref_out[rows], rtol=0, atol=1e-6)
        torch.testing.assert_close(xgrad / world, ref_xgrad[rows], rtol=0, atol=1e-6)
        # (b) aux loss: the mean over dp ranks is the loss over all tokens
        aux = layer.last_aux_loss.clone()
        dist.all_reduce(aux, group=group)
        torch.testing.assert_close(aux / world, ref.last_aux_loss, rtol=1e-6, atol=0)
        # (c) gradients: FSDP-style average over dp for replicated params; local experts' grads / dp
        ref_params = dict(ref.named_parameters())
        for name, param in layer.named_parameters():
            assert param.grad is not None, name
            grad, ref_grad = param.grad.clone(), ref_params[name].grad
            if name.startswith("experts."):  # stacked: this rank's experts only
                ref_grad = ref_grad[owned.start : owned.stop]
            else:
                dist.all_reduce(grad, group=group)
            torch.testing.assert_close(grad / world, ref_grad, rtol=0, atol=1e-5, msg=name)
        assert layer.router.gate.weight.grad.abs().sum() > 0
        # (d) load statistics are dp-global, the same bits on every rank
        assert torch.equal(layer.tokens_per_expert, ref.tokens_per_expert)
        torch.testing.assert_close(layer.gate_prob_sum, ref.gate_prob_sum, rtol=0, atol=1e-5)
        sums = [torch.empty_like(layer.gate_prob_sum) for _ in range(world)]
        dist.all_gather(sums, layer.gate_prob_sum, group=group)
        assert all(torch.equal(s, sums[0]) for s in sums)


def _check_transformer(rank: int, world: int) -> None:
    """Whole model with EP: global parameter names and the reference logits."""
    torch.manual_seed(1)
    args = ModelArgs(**ARGS, n_layers=2)
    ref = build_model(args).train()
    model = copy.deepcopy(ref)
    apply_expert_parallel(model, dist.group.WORLD, dist.group.WORLD)
    expert_names = {n for n, _ in named_tensors(model) if ".experts." in n}
    assert ("layers.1.moe.experts.5.w1.weight" in expert_names) == (rank == 1)
    assert len(expert_names) == 2 * 3 * 8 // world
    tokens = torch.randint(0, args.vocab_size, (2 * world, 6))
    rows = slice(2 * rank, 2 * rank + 2)
    torch.testing.assert_close(model(tokens[rows]), ref(tokens)[rows], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_expert_parallel_matches_single_process(tmp_path):
    mp.spawn(_worker, args=(WORLD, str(tmp_path / "store"), "layers"), nprocs=WORLD, join=True)


CHECKS = {"load": (_check_global_load,), "layers": (_check_moe_layer, _check_transformer)}
