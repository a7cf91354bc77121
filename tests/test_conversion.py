"""Sparse-to-dense conversion (`moevement/recovery/conversion.py`) in one process, operator by operator.

A tiny MoE trains with the real sparse checkpointer (W = 3 from iteration 3 on: windows 3-5, 6-8, 9-11),
with clipping and a learning rate that changes every iteration. Before iteration FAILED = 11 its memory is
wiped (window 9 in flight is dropped) and `Conversion.replay` rebuilds it from the persisted window 6-8 and
the logged scalars: conversion 6..8, catch-up 9..10. At the start of every replayed iteration t each
operator is compared, bit for bit, with state_t of the run that never failed: an active operator's FP32
weights, buffers and AdamW state; a frozen one's compute weights (fp32 here). At the end every operator
holds state_11.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.operators import Operator
from moevement.recovery.conversion import Conversion, ReplayPlan, ReplayStats, TrainerHooks
from moevement.recovery.fetch import RecoveryError
from moevement.recovery.replay import wipe_operators
from moevement.topology import Topology
from parallelisms.pipeline import lm_loss
from tests.test_moevement_engine import ARGS, full_state, tiny_engine
from trainer.optim import apply_clip, clip_grad_norm, set_lr
from trainer.step import take_expert_load

FAILED = 11
MAX_NORM = 0.5  # small enough that iterations clip: the replay must use the logged coefficient


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """The conversion asks the process group for its rank (replay threads): a real one-rank gloo group."""
    if dist.is_initialized():
        pytest.skip("needs its own one-rank process group")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Iteration t's (inputs, labels), a function of t alone."""
    x = torch.randint(0, ARGS["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(t))
    return x, x.roll(-1, 1)


@dataclass
class Run:
    """A run that trained iterations 1..last with the checkpointer on; `states[t]` is state_t (t <= last+1)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    engine: SparseCheckpointer
    states: dict[int, dict[str, torch.Tensor]]
    initial: dict[str, torch.Tensor]  # every operator tensor's initial value, by global name


def train(rank_dir, last: int, **engine_options) -> Run:
    """`tiny_engine(rank_dir, **engine_options)` trained for iterations 1..last."""
    model, optimizer, engine = tiny_engine(rank_dir, **engine_options)
    initial = {name: ref.local().clone() for op in engine.ops for name, ref in op.params.items()}
    states = {}
    for t in range(1, last + 1):
        engine.begin(t)
        states[t] = full_state(model, optimizer)
        loss = lm_loss(model(batch(t)[0]), batch(t)[1])
        loss.backward()
        _, clip_coef = clip_grad_norm(list(model.parameters()), MAX_NORM)
        set_lr(optimizer, 1e-2 / t)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.end(t, {"loss": loss.item(), "clip_coef": clip_coef, "lr": 1e-2 / t}, *take_expert_load(model))
    states[last + 1] = full_state(model, optimizer)
    return Run(model, optimizer, engine, states, initial)


def differences(ops: list[Operator], optimizer, reference: dict[str, torch.Tensor], frozen: set[str]) -> list[str]:
    """`<operator>: <tensor>` for every tensor of `ops` that is not bitwise `reference`'s (a frozen
    operator's compute weights, the others' full FP32 state), and `<operator>: frozen=<flag>` for an
    operator whose frozen flag is not as `frozen` says."""
    out = []
    for op in ops:
        tensors = op.compute_tensors() if op.name in frozen else op.master_tensors(optimizer)
        out += [f"{op.name}: {name}" for name, value in tensors if not torch.equal(value, reference[name])]
        if op.frozen != (op.name in frozen):
            out.append(f"{op.name}: frozen={op.frozen}")
    return out


def frozen_by_iteration(engine: SparseCheckpointer) -> dict[int, set[str]]:
    """{t0 + i: the operators frozen at t0 + i} for the slots i of the persisted window."""
    t0, window = engine.persisted.rollback_point(), engine.persisted.window[1] if engine.persisted.window else 0
    return {t0 + i: set(engine.persisted.snapshot(i)[0].frozen) for i in range(window)}


def recording_hooks(run: Run, frozen: dict[int, set[str]], seen: dict[int, list[str]]) -> TrainerHooks:
    """The loop's hooks for a replay of `run`; at the start of every replayed iteration t they record in
    `seen[t]` what differs from the fault-free state_t (`frozen[t]`: the operators frozen at t)."""

    def forward_backward(t, scope, inputs, labels, boundary):
        seen[t] = differences(run.engine.ops, run.optimizer, run.states[t], frozen.get(t, set()))
        lm_loss(run.model(inputs), labels).backward()

    def optimizer_step(logged: dict) -> None:
        apply_clip([p.grad for p in run.model.parameters() if p.grad is not None], logged["clip_coef"])
        set_lr(run.optimizer, logged["lr"])
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        take_expert_load(run.model)

    return TrainerHooks(batch, lambda t: None, forward_backward, optimizer_step, lambda: run.initial, print)


def conversion_of(run: Run, hooks: TrainerHooks, topology: Topology, frozen_weight_grad: bool = False) -> Conversion:
    """`run`'s conversion, replaying with the training's thread count whatever the kernels' mode."""
    threads = torch.get_num_threads()
    return Conversion(
        run.engine,
        run.optimizer,
        topology,
        hooks,
        None,
        torch.device("cpu"),
        threads,
        frozen_weight_grad=frozen_weight_grad,
    )


def replay_after_failure(
    run: Run, scalars: dict[int, dict] | None = None, frozen_weight_grad: bool = False
) -> dict[int, list[str]]:
    """Wipe the run's memory before iteration `last+1` and convert its persisted window (replaying up to
    `last`) with the logged scalars (or `scalars`); returns, per replayed iteration, what differed from the
    fault-free state at its start, then (under key `last+1`) what differs after the replay."""
    engine, optimizer = run.engine, run.optimizer
    end = max(run.states)
    engine.abort_window()
    wipe_operators(engine.ops, optimizer)
    t0 = engine.persisted.rollback_point()
    window = engine.persisted.window[1] if engine.persisted.window else 0
    seen: dict[int, list[str]] = {}
    hooks = recording_hooks(run, frozen_by_iteration(engine), seen)
    conversion = conversion_of(run, hooks, Topology.single(), frozen_weight_grad)
    if not window:
        conversion.load_initial_state()
    logged = scalars or engine.persisted.scalars(t0, end)
    assert conversion.replay(ReplayPlan(t0, end, window, {0}, engine.persisted.snapshot, logged, {}), ReplayStats())
    seen[end] = differences(engine.ops, optimizer, run.states[end], set())
    return seen


def test_each_operator_is_exact_at_every_replayed_iteration(tmp_path):
    run = train(tmp_path / "rank0", FAILED - 1)
    assert run.engine.persisted.window == (6, 3)
    assert min(s["clip_coef"] for s in run.engine.persisted.scalars(6, FAILED).values()) < 1
    seen = replay_after_failure(run)
    assert sorted(seen) == list(range(6, FAILED + 1))
    assert {t: diffs for t, diffs in seen.items() if diffs} == {}  # {iteration: ["operator: tensor", ...]}


def test_frozen_operators_that_compute_their_weight_gradient_still_replay_exactly(tmp_path):
    """The ablation switch (`fault.frozen_weight_grad`): frozen operators run their weight-gradient products
    and drop the result; no operator differs at any replayed iteration."""
    run = train(tmp_path / "rank0", FAILED - 1)
    seen = replay_after_failure(run, frozen_weight_grad=True)
    assert sorted(seen) == list(range(6, FAILED + 1))
    assert {t: diffs for t, diffs in seen.items() if diffs} == {}


def test_a_wrong_logged_update_shows_in_exactly_the_operators_it_trained(tmp_path):
    """The comparison localizes: with iteration 7's logged learning rate doubled, the first difference is
    at the start of 8, in the operators active at 7 (slots 0 and 1); slot 2's operators, loaded at 8 from
    their snapshot, are still exact there."""
    run = train(tmp_path / "rank0", FAILED - 1)
    headers = [run.engine.persisted.snapshot(i)[0] for i in range(3)]
    scalars = run.engine.persisted.scalars(6, FAILED)
    scalars[7] = {**scalars[7], "lr": 2 * scalars[7]["lr"]}
    seen = replay_after_failure(run, scalars)
    assert seen[6] == seen[7] == []
    trained_at_7 = {*headers[0].active, *headers[1].active}
    assert {diff.split(":")[0] for diff in seen[8]} == trained_at_7, seen[8]
    assert seen[FAILED], "a wrong update must leave the converted state wrong"


def test_a_failure_before_the_first_window_replays_from_the_initial_state(tmp_path):
    """Before iteration 3 nothing is persisted: every operator restarts from its initial value and the
    replay of 1..2 (no snapshot to load) is exact at every iteration."""
    run = train(tmp_path / "rank0", 2)
    assert run.engine.persisted.window is None
    seen = replay_after_failure(run)
    assert sorted(seen) == [1, 2, 3] and {t: diffs for t, diffs in seen.items() if diffs} == {}


def test_a_snapshot_of_another_model_is_refused_naming_its_operator(tmp_path):
    run = train(tmp_path / "rank0", FAILED - 1)
    snapshot = run.engine.persisted.snapshot

    def foreign(slot: int):
        header, tensors = snapshot(slot)
        return dataclasses.replace(header, active=[*header.active, "layers.7.moe.experts.0"]), tensors

    run.engine.persisted.snapshot = foreign
    with pytest.raises(RecoveryError, match=r"iteration 6 names operators .*\(layers\.7\.moe\.experts\.0\)"):
        replay_after_failure(run)
