"""Model tests: shapes, routing maths, aux-loss gradient, capacity, pipeline split, init, determinism."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from models import ModelArgs, MoE, Transformer, build_model, count_params, stored_shapes
from models.experts import GroupedExperts
from models.ffn import SwiGLU
from models.moe import load_balancing_loss

SHARED = {"deepseek": 2, "qwen": 1, "gpt": 0}


def tiny(family: str = "deepseek", **overrides) -> ModelArgs:
    """A debug-sized shape: 4 layers, layer 0 dense, 8 experts top-2."""
    args = dict(
        family=family,
        vocab_size=260,
        dim=32,
        n_layers=4,
        n_heads=4,
        max_seq_len=64,
        n_dense_layers=1,
        dense_hidden_dim=64,
        n_routed_experts=8,
        n_shared_experts=SHARED.get(family, 0),
        expert_hidden_dim=16,
        shared_expert_hidden_dim=24,
        top_k=2,
    )
    args.update(overrides)
    return ModelArgs(**args)


def tokens(batch: int = 2, seqlen: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 260, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def lm_loss(logits: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), toks[:, 1:].flatten())


def small_moe(gate_weight, family: str = "gpt", **overrides) -> MoE:
    """An MoE layer over dim = gate_weight.shape[1] with a fixed router gate."""
    gate_weight = torch.tensor(gate_weight)
    n_experts, dim = gate_weight.shape
    args = ModelArgs(
        family=family,
        dim=dim,
        n_heads=1,
        n_routed_experts=n_experts,
        expert_hidden_dim=4,
        n_shared_experts=SHARED[family],
        shared_expert_hidden_dim=4,
        **overrides,
    )
    torch.manual_seed(0)
    moe = MoE(args).train()
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate_weight)
    return moe


@pytest.mark.parametrize(
    "family, extra",
    [
        ("deepseek", dict(n_kv_heads=2)),
        ("qwen", dict(qkv_bias=True, norm_topk_prob=True)),
        ("gpt", dict(n_dense_layers=0, moe_every=2, tie_embeddings=True)),
    ],
)
def test_forward_backward_each_family(family, extra):
    torch.manual_seed(0)
    model = build_model(tiny(family, **extra)).train()
    toks = tokens()
    logits = model(toks)
    assert logits.shape == (2, 16, 260) and logits.dtype == torch.float32
    assert (model.output.weight is model.tok_embeddings.weight) == model.args.tie_embeddings
    lm_loss(logits, toks).backward()
    assert all(p.grad is not None for p in model.parameters())
    moe = next(iter(model.moe_layers().values()))
    shared_hidden = 0 if moe.shared_experts is None else moe.shared_experts.w1.out_features
    assert shared_hidden == SHARED[family] * model.args.shared_expert_hidden_dim
    assert (moe.shared_expert_gate is not None) == (family == "qwen")
    assert moe.last_aux_loss is not None and moe.tokens_per_expert.sum() == 2 * 16 * 2


def test_fused_shared_experts_are_the_sum_of_separate_experts():
    """DeepSeek-MoE's n shared experts, stored as one SwiGLU of n times the hidden units, compute the sum
    of n experts each holding its chunk of hidden units (equal up to the order of the summation)."""
    torch.manual_seed(0)
    fused = SwiGLU(16, 2 * 24)
    separate = [SwiGLU(16, 24) for _ in range(2)]
    with torch.no_grad():
        for j, expert in enumerate(separate):
            for w in ("w1", "w3"):
                getattr(expert, w).weight.copy_(getattr(fused, w).weight.chunk(2, dim=0)[j])
            expert.w2.weight.copy_(fused.w2.weight.chunk(2, dim=1)[j])
    x = torch.randn(10, 16)
    torch.testing.assert_close(fused(x), separate[0](x) + separate[1](x), rtol=0, atol=1e-6)


def test_chunked_loss_equals_the_whole_loss_and_never_keeps_every_logit():
    """``loss_chunk_tokens``: the head forms the logits a few tokens at a time, and again in backward; the loss
    and gradients equal the whole-logits ones up to the order of the summation (1e-6)."""
    torch.manual_seed(0)
    model = build_model(tiny()).train()
    toks = tokens()  # 32 tokens, vocabulary 260

    def loss_and_largest_saved(chunk: int) -> tuple[torch.Tensor, dict, int]:
        model.zero_grad(set_to_none=True)
        model.loss_chunk_tokens = chunk
        out, saved = model(toks), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = model.loss(out, toks)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, max(saved)

    whole, whole_grads, whole_saved = loss_and_largest_saved(0)
    chunked, chunked_grads, chunked_saved = loss_and_largest_saved(5)  # 7 chunks, the last of 2 tokens
    assert whole_saved >= 32 * 260 and chunked_saved < 5 * 260  # kept for backward: every logit, or a chunk's input
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_layer_layout_and_global_names():
    model = Transformer(tiny(n_layers=6, n_dense_layers=1, moe_every=2))
    assert list(model.moe_layers()) == ["2", "4"]
    assert model.layers["1"].moe is None and model.layers["1"].feed_forward is not None
    names = dict(model.named_parameters())
    assert names["layers.4.moe.experts.w2"].shape == (8, 32, 16) and "layers.0.feed_forward.w1.weight" in names
    stored = stored_shapes(model.args)  # each routed expert under its own name, as checkpoints hold it
    assert stored["layers.4.moe.experts.7.w2.weight"] == (32, 16) and "layers.4.moe.experts.w2" not in stored


def test_router_and_aux_loss_hand_computed():
    gate = [[2.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]])
    logits = [[sum(w * xi for w, xi in zip(row, xt)) for row in gate] for xt in x.tolist()]
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    expected_ids = [[0, 1], [1, 0], [0, 1], [2, 1]]
    counts = [3, 4, 1]
    mean_prob = [sum(p[i] for p in probs) / 4 for i in range(3)]
    expected_aux = 0.1 * 3 / (2 * 4) * sum(c * m for c, m in zip(counts, mean_prob))

    moe = small_moe(gate, top_k=2, aux_loss_coef=0.1)
    logits_out, scores, ids, weights = moe.router(x)
    torch.testing.assert_close(logits_out, torch.tensor(logits))
    assert ids.tolist() == expected_ids
    expected_w = torch.tensor([[probs[t][e] for e in expected_ids[t]] for t in range(4)])
    torch.testing.assert_close(weights, expected_w)
    moe.router.norm_topk_prob = True
    torch.testing.assert_close(moe.router(x)[3], expected_w / expected_w.sum(1, keepdim=True))
    moe.router.norm_topk_prob = False

    moe(x)
    assert moe.last_aux_loss.item() == pytest.approx(expected_aux, rel=1e-6)
    assert moe.tokens_per_expert.tolist() == counts
    torch.testing.assert_close(moe.gate_prob_sum, torch.tensor(probs).sum(0))
    moe.reset_load_stats()
    assert moe.tokens_per_expert.sum() == 0 and moe.gate_prob_sum.sum() == 0


@pytest.mark.parametrize("family", ["deepseek", "qwen"])
def test_moe_matches_per_token_reference(family):
    torch.manual_seed(1)
    moe = MoE(tiny(family, norm_topk_prob=True)).eval()
    x = torch.randn(10, 32)
    _, _, ids, weights = moe.router(x)
    expected = []
    for t in range(10):
        row = sum(w * moe.experts.expert(e, x[t]) for w, e in zip(weights[t], ids[t].tolist()))
        shared = moe.shared_experts(x[t])
        if family == "qwen":
            shared = torch.sigmoid(moe.shared_expert_gate(x[t])) * shared
        expected.append(row + shared)
    torch.testing.assert_close(moe(x), torch.stack(expected))


def test_aux_loss_gradient_reaches_router_without_being_in_output():
    torch.manual_seed(2)
    moe = MoE(tiny("gpt", aux_loss_coef=0.1)).train()
    moe.aux_grad_scale = 0.5
    x = torch.randn(12, 32)
    out = moe(x)
    (out * 0).sum().backward()  # the output carries no gradient: only the aux loss does
    gate = moe.router.gate.weight
    scores = F.linear(x, gate).softmax(-1)
    counts = torch.bincount(scores.topk(2, dim=-1).indices.flatten(), minlength=8)
    (expected,) = torch.autograd.grad(0.5 * 0.1 * load_balancing_loss(scores, counts, 2), gate)
    assert gate.grad.abs().sum() > 0
    torch.testing.assert_close(gate.grad, expected)


def test_capacity_drops_late_tokens_and_idle_experts_get_zero_grads():
    # Every token prefers expert 0; capacity = ceil(1.0 * 4 tokens * 1 / 2 experts) = 2.
    moe = small_moe([[1.0, 0.0], [-1.0, 0.0]], top_k=1, capacity_factor=1.0)
    x = torch.tensor([[1.0, 0.5], [2.0, -1.0], [0.5, 1.0], [1.0, 1.0]], requires_grad=True)
    out = moe(x)
    assert moe.tokens_per_expert.tolist() == [4, 0] and moe.dropped_tokens.item() == 2
    weight = torch.sigmoid(2 * x[:2, :1].detach())  # softmax over 2 experts with logits +-x0
    torch.testing.assert_close(out[:2], weight * moe.experts.expert(0, x[:2]))
    assert torch.equal(out[2:], torch.zeros(2, 2))
    out.sum().backward()
    for name, p in moe.experts.named_parameters():
        assert torch.equal(p.grad[1], torch.zeros_like(p[1])), name
        assert p.grad[0].abs().sum() > 0, name


def test_run_experts_uses_only_the_experts_present():
    torch.manual_seed(3)
    moe = MoE(tiny())
    x, counts = torch.randn(9, 32), torch.tensor([2, 0, 3, 1, 0, 1, 2, 0])
    full = moe.run_experts(x, counts)
    local = GroupedExperts(4, 32, 16, first_id=4)  # as an expert-parallel rank holding experts 4..7 would
    with torch.no_grad():
        for w in ("w1", "w2", "w3"):
            getattr(local, w).copy_(getattr(moe.experts, w)[4:])
    moe.experts = local
    torch.testing.assert_close(moe.run_experts(x[6:], counts[4:]), full[6:], rtol=0, atol=0)


def split(model: Transformer, cut: int) -> tuple[Transformer, Transformer]:
    """TorchTitan-style 2-stage split: layers [0, cut) and [cut, n_layers)."""
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    for key in list(model.layers):
        del (second if int(key) < cut else first).layers[key]
    first.norm = first.output = None
    second.tok_embeddings = None
    return first, second


def test_pipeline_split_composes_to_whole_model():
    torch.manual_seed(0)
    model = build_model(tiny(n_layers=4)).train()
    first, second = split(model, cut=2)
    names = lambda m: set(dict(m.named_parameters()))  # noqa: E731
    assert names(first) | names(second) == names(model) and not names(first) & names(second)
    toks = tokens()
    logits = model(toks)
    lm_loss(logits, toks).backward()
    hidden = first(toks)
    received = hidden.detach().requires_grad_()
    staged_logits = second(received)
    lm_loss(staged_logits, toks).backward()
    hidden.backward(received.grad)
    assert torch.equal(staged_logits, logits)
    staged = dict(first.named_parameters()) | dict(second.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(staged[name].grad, p.grad), name


def test_init_is_invariant_to_pipeline_split():
    args = tiny(n_layers=4)
    torch.manual_seed(7)
    whole = dict(build_model(args).named_parameters())
    with torch.device("meta"):
        stage = Transformer(args)
    del stage.layers["0"], stage.layers["1"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    torch.manual_seed(7)
    stage.init_weights()
    for name, p in stage.named_parameters():
        assert torch.equal(p, whole[name]), name
    torch.testing.assert_close(stage.rope_cos, build_model(args).rope_cos, rtol=0, atol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_count_params_on_meta_matches_real_model(tie):
    args = tiny(tie_embeddings=tie)
    model = build_model(args)
    total = sum(p.numel() for p in model.parameters())
    idle = sum(
        (args.n_routed_experts - args.top_k) * sum(p[0].numel() for p in moe.experts.parameters())
        for moe in model.moe_layers().values()
    )
    assert count_params(args) == (total, total - idle)


def test_training_is_bitwise_deterministic():
    def run() -> tuple[torch.Tensor, dict]:
        torch.manual_seed(0)
        model = build_model(tiny(dropout=0.1, capacity_factor=1.25)).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            toks = tokens(seed=step)
            lm_loss(model(toks), toks).backward()
            opt.step()
            opt.zero_grad()
        return model(tokens(seed=9)), model.state_dict()

    (logits_a, state_a), (logits_b, state_b) = run(), run()
    assert torch.equal(logits_a, logits_b)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(family="mixtral"), "model.family"),
        (dict(dim=30), "model.dim"),
        (dict(n_kv_heads=3), "model.n_kv_heads"),
        (dict(top_k=9), "model.top_k"),
        (dict(n_dense_layers=5), "model.n_dense_layers"),
        (dict(family="gpt", n_shared_experts=1), "model.n_shared_experts"),
        (dict(dropout=1.0), "model.dropout"),
        (dict(dim="32"), "model.dim"),
    ],
)
def test_validate_names_the_bad_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        tiny(**overrides).validate()


def test_sequence_level_aux_loss_and_z_loss_hand_computed():
    """DeepSeek's seq_aux: each sequence's own counts and mean scores, averaged over sequences; the z-loss
    is the mean squared logsumexp of the router logits; both train the router."""
    gate = [[2.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [-1.0, 0.0]]])  # 2 sequences of 2 tokens
    logits = [[sum(w * xi for w, xi in zip(row, xt)) for row in gate] for xt in x.reshape(4, 2).tolist()]
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    ids = [[0, 1], [1, 0], [0, 1], [2, 1]]  # top-2 of each token (as in the batch-level test)
    per_seq = []
    for seq in (0, 1):
        tokens = range(2 * seq, 2 * seq + 2)
        counts = [sum(ids[t].count(e) for t in tokens) for e in range(3)]
        mean = [sum(probs[t][e] for t in tokens) / 2 for e in range(3)]
        per_seq.append(3 / (2 * 2) * sum(c * m for c, m in zip(counts, mean)))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 4
    moe = small_moe(gate, top_k=2, aux_loss_coef=0.1, aux_loss_type="seq", router_z_loss_coef=0.01)
    moe(x).sum().backward()
    assert moe.last_aux_loss.item() == pytest.approx(0.1 * sum(per_seq) / 2 + 0.01 * z, rel=1e-6)
    assert moe.router.gate.weight.grad.abs().sum() > 0
    batch = small_moe(gate, top_k=2, aux_loss_coef=0.1)  # the batch-level loss of the same tokens differs
    batch(x)
    assert batch.last_aux_loss.item() != pytest.approx(moe.last_aux_loss.item(), rel=1e-3)


def test_top_1_routing_keeps_the_score_and_evaluation_drops_nothing():
    """At top_k=1 renormalising would make every weight 1: the router score is kept. With a capacity
    factor, evaluation keeps every assignment, so a sequence's output does not depend on the batch."""
    gate = [[1.0, 0.0], [-1.0, 0.0]]
    moe = small_moe(gate, top_k=1, norm_topk_prob=True, capacity_factor=1.0).eval()
    x = torch.tensor([[1.0, 0.5], [2.0, -1.0], [0.5, 1.0], [1.0, 1.0]])
    _, scores, _, weights = moe.router(x)
    torch.testing.assert_close(weights[:, 0], scores.max(dim=-1).values)
    together = moe(x)
    alone = torch.cat([moe(x[t : t + 1]) for t in range(4)])
    torch.testing.assert_close(together, alone)
    assert together[2:].abs().sum() > 0  # training would have dropped these two (capacity 2)


def test_global_balance_loss_gradient_equals_the_explicit_loss():
    """aux_loss_type = "global": one loss E * sum_e f_e P_e over every MoE layer's tokens together; the
    router gradients equal those of that loss written out and differentiated by autograd."""
    args = ModelArgs(family="qwen", n_shared_experts=1, n_layers=3, vocab_size=50, top_k=2)
    args.aux_loss_type, args.aux_loss_coef = "global", 0.5
    torch.manual_seed(0)
    model = build_model(args).train()
    tokens = torch.randint(0, 50, (2, 8))
    model(tokens).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n}
    value = sum(float(m.last_aux_loss) for m in model.moe_layers().values())

    model.zero_grad()
    scores = []
    for moe in model.moe_layers().values():
        moe.aux_loss_coef = 0.0  # the model's own loss off; the explicit one below instead
        moe.router.register_forward_hook(lambda _m, _i, out: scores.append(out[1]))
    out = model(tokens)
    counts = sum(torch.bincount(s.topk(2, dim=-1).indices.flatten(), minlength=8).float() for s in scores)
    prob_sums = sum(s.sum(dim=0) for s in scores)
    rows = sum(s.shape[0] for s in scores)
    explicit = 0.5 * 8 * (counts * prob_sums).sum() / rows**2
    (out.sum() + explicit).backward()
    assert value == pytest.approx(float(explicit.detach()), rel=1e-6)
    assert 0.5 * 2 * 0.9 < value < 0.5 * 2 * 1.5  # coef * top_k near balance, not a per-layer sum
    for name, grad in ours.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-6, atol=1e-9)
