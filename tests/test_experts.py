"""Stacked routed experts computed by grouped GEMM (models/experts.py) against the per-expert computation.

On CPU, ``torch._grouped_mm`` runs one GEMM per group on the same operands as the per-expert ``F.linear``
products, so with the elementwise ``silu(h1) * h3`` done on the same whole tensor, forward, input gradient
and weight gradient are equal bit for bit (compared exactly). An expert-by-expert loop (``expert``) applies
the activation chunk by chunk, and a vectorised elementwise kernel rounds the elements of a chunk's
ragged tail (computed by its scalar path) differently in the last bit: equal within 1e-6.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

import models.experts
from models import ModelArgs, build_model
from models.experts import GroupedExperts, grouped_mm, stacked_experts, unstack
from trainer.checkpoint.state import named_training_state

COUNTS = [5, 0, 3, 8, 1, 0, 4, 2]  # empty groups included


def experts_and_input(dim: int, hidden: int, dtype=torch.float32):
    torch.manual_seed(0)
    experts = GroupedExperts(len(COUNTS), dim, hidden).to(dtype)
    x = torch.randn(sum(COUNTS), dim, dtype=dtype, requires_grad=True)
    return experts, x, torch.tensor(COUNTS)


def per_expert(experts: GroupedExperts, x: torch.Tensor) -> torch.Tensor:
    """The reference: every product by ``F.linear`` of one expert's rows with its slice of the stacked weights."""

    def each(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(r, w[e]) for e, r in enumerate(rows.split(COUNTS))])

    return each(experts.w2, F.silu(each(experts.w1, x)) * each(experts.w3, x))


def grads(out: torch.Tensor, experts: GroupedExperts, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    params = [experts.w1, experts.w2, experts.w3]
    return list(torch.autograd.grad(out, [x, *params], grad))


@pytest.mark.parametrize("dim, hidden", [(16, 12), (6, 3)], ids=["grouped_mm", "unaligned-fallback"])
def test_grouped_experts_equal_the_per_expert_computation(dim, hidden):
    experts, x, counts = experts_and_input(dim, hidden)
    out, ref = experts(x, counts), per_expert(experts, x)
    assert torch.equal(out, ref)
    grad = torch.randn_like(out)
    for mine, theirs in zip(grads(out, experts, x, grad), grads(ref, experts, x, grad), strict=True):
        assert torch.equal(mine, theirs)
    loop = torch.cat([experts.expert(e, rows) for e, rows in enumerate(x.split(COUNTS))])
    torch.testing.assert_close(out, loop, rtol=0, atol=1e-6)


def test_bf16_through_sgemm_equals_the_upcast_per_expert_products():
    """CPU bf16 without native bf16 GEMM (parallelisms.precision): each product in fp32, rounded to bf16."""
    experts, x, counts = experts_and_input(16, 8, torch.bfloat16)
    experts.fp32_gemm = True
    out = experts(x, counts)
    bounds = [0, *torch.tensor(COUNTS).cumsum(0).tolist()]
    rows = [x[s:e].float() for s, e in zip(bounds, bounds[1:])]

    def linear(a, w):  # what _Fp32GemmLinear does for an nn.Linear
        return F.linear(a.float(), w.float()).to(torch.bfloat16)

    ref = torch.cat(
        [linear(F.silu(linear(r, experts.w1[e])) * linear(r, experts.w3[e]), experts.w2[e]) for e, r in enumerate(rows)]
    )
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    out.sum().backward()
    assert experts.w1.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16


def test_frozen_experts_get_no_weight_gradient_and_the_others_the_same_one():
    experts, x, counts = experts_and_input(16, 12)
    grad = torch.randn(x.shape)
    trained = grads(experts(x, counts), experts, x, grad)
    frozen = [1, 3, 6]
    for e in frozen:
        experts.set_frozen(e, True)
    replayed = grads(experts(x, counts), experts, x, grad)
    assert torch.equal(replayed[0], trained[0])  # the input gradient flows through frozen experts alike
    for mine, theirs in zip(replayed[1:], trained[1:], strict=True):
        for e in range(len(COUNTS)):
            assert torch.equal(mine[e], torch.zeros_like(mine[e]) if e in frozen else theirs[e])
    for e in range(len(COUNTS)):
        experts.set_frozen(e, True)
    out = experts(x, counts)
    assert torch.autograd.grad(out, [experts.w1], grad, allow_unused=True) == (None,)  # all frozen: no product


def test_the_weight_gradient_gemm_skips_frozen_experts_rows(monkeypatch):
    """The weight-gradient GEMM of a replay runs over the active experts' rows only (its FLOPs drop)."""
    experts, x, counts = experts_and_input(16, 12)
    seen = []

    def spy(a, b, offsets):
        seen.append((tuple(a.shape), tuple(b.shape)))
        return grouped_mm(a, b, offsets)

    monkeypatch.setattr(models.experts, "grouped_mm", spy)
    for e in (0, 2, 3):  # 16 of the 23 rows
        experts.set_frozen(e, True)
    experts(x, counts).sum().backward()
    weight_grads = [a for a, b in seen if len(b) == 2]  # [K, rows] @ [rows, M]
    assert [rows for _, rows in weight_grads] == [sum(COUNTS) - 16] * 3


def test_each_expert_is_named_and_initialised_as_a_tensor_of_its_own():
    experts = GroupedExperts(4, 8, 4, first_id=4)
    holder = torch.nn.Module()
    holder.experts = experts
    stacked = stacked_experts(holder)
    assert stacked["experts.w2"][1] == [f"experts.{e}.w2.weight" for e in (4, 5, 6, 7)]
    pieces = unstack("experts.w2", experts.w2, stacked)
    assert [name for name, _ in pieces][0] == "experts.4.w2.weight" and torch.equal(pieces[2][1], experts.w2[2])
    assert unstack("other", experts.w1, stacked) == [("other", experts.w1)]


def test_the_gathered_training_state_holds_each_expert_in_storage_of_its_own():
    """A rank's whole state by name (for comparisons; pickled when gathered); a slice of the stacked weights
    would carry the whole stack's storage, once per expert."""
    torch.manual_seed(0)
    model = build_model(ModelArgs(family="gpt", vocab_size=64, dim=16, n_layers=1, n_heads=2, n_routed_experts=8,
                                  expert_hidden_dim=8, top_k=2, max_seq_len=16, n_dense_layers=0))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (1, 16))).sum().backward()
    optimizer.step()
    state = named_training_state(model, optimizer)
    expert = state["layers.0.moe.experts.5.w1.weight"]
    assert torch.equal(expert, model.layers["0"].moe.experts.w1[5])
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in state.values())
    assert len(pickle.dumps(expert)) < 2 * expert.numel() * expert.element_size() + 1000
