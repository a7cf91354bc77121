"""Activation checkpointing (parallelisms/activation_checkpoint.py) and torch.compile (parallelisms/compile.py) of
the transformer blocks, applied from outside the model.

Checkpointing must be invisible in the bits: training with checkpointed blocks (dropout on, every kind of
auxiliary loss) ends with exactly the state, load statistics and auxiliary losses of training without, and a
MoEvement replay whose frozen operators run under checkpointing rebuilds the fault-free states operator by
operator. The real deaths with checkpointed and compiled blocks are in tests/test_real_deaths.py."""

from __future__ import annotations

import pytest
import torch

from models import ModelArgs, build_model
from moevement.recovery.conversion import ReplayPlan, ReplayStats
from moevement.recovery.replay import wipe_operators
from moevement.topology import Topology
from parallelisms.activation_checkpoint import apply_activation_checkpoint, checkpointed_layers, is_checkpointed
from parallelisms.compile import COMPILED_PARTS, apply_compile, compiled_parts, is_compiled
from parallelisms.pipeline import lm_loss
from tests import helpers
from tests.helpers import DEBUG_CONFIG, ROOT, base_args, final_line, run_cli, step_losses
from tests.tiny_moe import (
    ARGS,
    FAILED,
    batch,
    conversion_of,
    differences,
    frozen_by_iteration,
    recording_hooks,
    train_run,
)
from trainer.config import ConfigError, load_config
from trainer.step import take_expert_load


def tiny(mode: str = "none", **overrides) -> torch.nn.Module:
    """The tests' tiny MoE (seed 0: layer 0 dense, layers 1-2 MoE) with `mode`'s blocks checkpointed."""
    torch.manual_seed(0)
    model = build_model(ModelArgs(**{**ARGS, **overrides}))
    apply_activation_checkpoint(model, mode)
    return model


@pytest.mark.parametrize(
    ("mode", "checkpointed"), [("none", []), ("full", [0, 1, 2]), ("selective", [0, 2])], ids=lambda v: str(v)
)
def test_checkpointed_blocks_keep_their_names_and_run_their_forward_again_in_backward(mode, checkpointed):
    """`full` checkpoints every block, `selective` those of even layer id; a checkpointed block's attention runs
    twice per forward and backward (the recomputation), fewer tensors are kept for backward, and the parameter
    and buffer names are those of the plain model."""
    model = tiny(mode)
    assert [int(k) for k, block in model.layers.items() if is_checkpointed(block)] == checkpointed
    assert list(model.state_dict()) == list(tiny().state_dict())
    calls = dict.fromkeys(range(3), 0)
    for key, block in model.layers.items():
        block.attention.register_forward_hook(lambda *_, layer=int(key): calls.__setitem__(layer, calls[layer] + 1))
    saved = []
    x, y = batch(1)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = lm_loss(model(x), y)
    loss.backward()
    assert calls == {i: 2 if i in checkpointed else 1 for i in range(3)}
    plain = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t) or t, lambda t: t):
        lm_loss(tiny()(x), y)
    assert (len(saved) < len(plain)) == bool(checkpointed), (len(saved), len(plain))


def trained(mode: str, steps: int = 3, **overrides) -> dict[str, object]:
    """Every parameter, AdamW state tensor, load statistic and auxiliary loss of the tiny MoE (dropout 0.1)
    after `steps` AdamW steps with `mode`'s blocks checkpointed."""
    model = tiny(mode, dropout=0.1, router_z_loss_coef=1e-3, **overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict[str, object] = {}
    for t in range(1, steps + 1):
        torch.manual_seed(100 + t)  # the dropout masks of iteration t
        x, y = batch(t)
        lm_loss(model(x), y).backward()
        out[f"aux/{t}"] = [moe.last_aux_loss.clone() for moe in model.moe_layers().values()]
        tokens, gate_probs = take_expert_load(model)
        out.update({f"tokens/{t}/{k}": v for k, v in tokens.items()})
        out.update({f"gate_probs/{t}/{k}": v for k, v in gate_probs.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out.update({f"param/{name}": p.detach().clone() for name, p in model.named_parameters()})
    for p, state in optimizer.state.items():
        out.update({f"adam/{id(p)}/{k}": v for k, v in state.items()})
    return out


def bitwise_equal(a: object, b: object) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(map(bitwise_equal, a, b))
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("aux_loss_type", ["batch", "seq", "global"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_training_with_checkpointed_blocks_is_bit_for_bit_training_without(mode, aux_loss_type):
    """Dropout on (the recomputation draws the same masks), a balance loss of every kind and the router z-loss:
    weights, AdamW state, load statistics and auxiliary losses are exactly those of the run without checkpointing
    (`global` registers each layer once in the model-wide balance loss: the recomputation does not again)."""
    plain, checkpointed = trained("none", aux_loss_type=aux_loss_type), trained(mode, aux_loss_type=aux_loss_type)
    adam, adam_c = ([k for k in run if k.startswith("adam/")] for run in (plain, checkpointed))  # by parameter order
    assert len(adam) == len(adam_c) == len(list(tiny().parameters())) * 3
    assert all(bitwise_equal(plain[a], checkpointed[c]) for a, c in zip(adam, adam_c))
    named = sorted(k for k in plain if not k.startswith("adam/"))
    assert named == sorted(k for k in checkpointed if not k.startswith("adam/"))
    assert [k for k in named if not bitwise_equal(plain[k], checkpointed[k])] == []


@pytest.fixture
def one_rank_group():
    """The conversion asks the process group for its rank (replay threads): a real one-rank gloo group."""
    with helpers.one_rank_group():
        yield


def test_a_replay_with_frozen_operators_in_checkpointed_blocks_rebuilds_the_states_of_training_without(
    tmp_path, one_rank_group
):
    """The tiny MoE trains without checkpointing to iteration 10 (window 6-8 persisted); its memory is wiped and,
    now with every block checkpointed, `Conversion.replay` converts 6..8 (frozen operators: no weight gradient)
    and catches up 9..10: at the start of every replayed iteration each operator is bitwise the fault-free
    state (tests/test_conversion.py runs the same replay without checkpointing)."""
    run = train_run(tmp_path / "rank0", FAILED - 1)
    assert apply_activation_checkpoint(run.model, "full") == [0, 1, 2]
    engine, end = run.engine, max(run.states)
    engine.abort_window()
    wipe_operators(engine.ops, run.optimizer)
    t0, window_size = engine.persisted.rollback_point(), engine.persisted.span.size
    frozen = frozen_by_iteration(engine)
    assert (t0, window_size) == (6, 3) and any(frozen.values())
    seen: dict[int, list[str]] = {}
    conversion = conversion_of(run, recording_hooks(run, frozen, seen), Topology.single())
    plan = ReplayPlan(t0, end, window_size, {0}, engine.persisted.snapshot, engine.persisted.scalars(t0, end), {})
    assert conversion.replay(plan, ReplayStats())
    seen[end] = differences(engine.ops, run.optimizer, run.states[end], set())
    assert sorted(seen) == list(range(6, FAILED + 1))
    assert {t: diffs for t, diffs in seen.items() if diffs} == {}


@pytest.mark.slow
def test_a_run_with_checkpointed_blocks_ends_with_the_digest_of_the_run_without():
    """train.py end to end (`--training.activation_checkpoint full`, dropout on): the same `step=` losses and
    the same final state digest as the run without."""
    args = (*base_args(4), "--model.dropout", "0.1")
    plain = run_cli(*args).stdout
    checkpointed = run_cli(*args, "--training.activation_checkpoint", "full").stdout
    assert step_losses(checkpointed) == step_losses(plain) and len(step_losses(plain)) == 4
    assert final_line(checkpointed) == final_line(plain)


def test_an_unknown_checkpointing_mode_is_one_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"^config key 'training.activation_checkpoint' must be one of none, full"):
        load_config(str(ROOT / DEBUG_CONFIG), ["--training.activation_checkpoint", "half"])
    with pytest.raises(ValueError, match="training.activation_checkpoint='half'"):
        checkpointed_layers([0, 1], "half")


def test_compile_compiles_each_blocks_attention_and_dense_ffns_in_place(monkeypatch):
    """`training.compile`: the attention and the dense or shared-expert SwiGLU of every block are compiled in place
    (lazily: nothing runs here); the routed experts and the router stay eager, and the names are unchanged."""
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", False)  # apply_compile sets it
    model = tiny("full")
    names = list(model.state_dict())
    assert apply_compile(model) == 6  # 3 attentions, layer 0's dense FFN, layers 1-2's shared experts
    assert torch._dynamo.config.fail_on_recompile_limit_hit  # a part never falls back to eager mid-run
    assert COMPILED_PARTS == ("attention", "feed_forward", "moe.shared_experts")
    for block in model.layers.values():
        assert len(compiled_parts(block)) == 2 and all(map(is_compiled, compiled_parts(block)))
        if block.moe is not None:
            assert not is_compiled(block.moe) and not is_compiled(block.moe.experts)
            assert not is_compiled(block.moe.router)
    assert list(model.state_dict()) == names
