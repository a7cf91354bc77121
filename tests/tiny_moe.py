"""The tiny MoE the in-process tests train (seed 0, 3 layers, 4 experts), its sparse checkpointer, and a run
of it that records every iteration's state for operator-by-operator comparison.

`train_run` trains it with the real sparse checkpointer (W = 3 from iteration 3 on: windows 3-5, 6-8, 9-11),
with clipping and a learning rate that changes every iteration; `recording_hooks` and `conversion_of` replay
it through the real `Conversion`, recording at the start of every replayed iteration what differs from the
state of the run that never failed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from models import ModelArgs, build_model
from moevement.checkpoint.binding import CheckpointedModel, CheckpointerPlace
from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.checkpoint.options import SparseOptions
from moevement.operators import Operator
from moevement.recovery.conversion import Conversion, TrainerHooks
from moevement.topology import Topology
from parallelisms.pipeline import lm_loss
from trainer.checkpoint.state import named_training_state
from trainer.model_operators import stacked_operators
from trainer.optim import apply_clip, clip_grad_norm, set_lr
from trainer.step import take_expert_load

ARGS = dict(
    family="deepseek",
    vocab_size=64,
    dim=32,
    n_layers=3,
    n_heads=4,
    n_dense_layers=1,
    dense_hidden_dim=64,
    n_routed_experts=4,
    n_shared_experts=1,
    expert_hidden_dim=16,
    shared_expert_hidden_dim=16,
    top_k=2,
    max_seq_len=32,
    aux_loss_coef=0.01,
)


def options(**overrides) -> SparseOptions:
    """The tests' sparse options: W = 3, two replicas, host state kept, `overrides` on top."""
    return SparseOptions(**{"window": 3, "keep_host_state": True, **overrides})


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """A synchronous copy of every parameter and optimizer tensor, named as snapshot entries are."""
    return {name: t.clone() for name, t in named_training_state(model, optimizer).items()}


def tiny_engine(
    rank_dir: Path,
    compute_dtype=torch.float32,
    topology: Topology | None = None,
    rank_dirs=None,
    job_meta: dict | None = None,
    staged: bool = False,
    **opts,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, SparseCheckpointer]:
    """The tiny MoE (seed 0), its AdamW and a checkpointer of it with `options(**opts)`: of one rank, or of
    this rank of `topology` (`rank_dirs(r)`: rank r's host directory, for same-node replicas), its snapshots
    carrying `job_meta`. `staged`: snapshots take a GPU's path (issued from the training thread through a
    staging ring, device checksums), run on the CPU."""
    torch.manual_seed(0)
    model = build_model(ModelArgs(**ARGS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    state = CheckpointedModel(model, optimizer, compute_dtype, torch.device("cpu"), stacked_operators(model))
    place = CheckpointerPlace(topology or Topology.single(), rank_dir, job_meta, rank_dirs)
    engine = SparseCheckpointer(options(**opts), state, place)
    engine.buffers.staged = staged
    return model, optimizer, engine


FAILED = 11
MAX_NORM = 0.5  # small enough that iterations clip: the replay must use the logged coefficient


def iteration(engine, model, optimizer, t: int, data: torch.Generator, after_step=None) -> dict[str, torch.Tensor]:
    """Iteration `t` of the tiny MoE under `engine` on a batch drawn from `data` (`after_step()` called between its
    optimizer step and `end`); the state before its step (`full_state`)."""
    engine.begin(t)
    before = full_state(model, optimizer)
    x = torch.randint(0, 64, (4, 16), generator=data)
    lm_loss(model(x), x.roll(-1, 1)).backward()
    optimizer.step()
    optimizer.zero_grad()
    if after_step is not None:
        after_step()
    engine.end(t, {"loss": 0.0, "clip_coef": 1.0}, *take_expert_load(model))
    return before


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


def train_run(rank_dir, last: int, **engine_options) -> Run:
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
    t0, window_size = engine.persisted.rollback_point(), engine.persisted.span.size if engine.persisted.span else 0
    return {t0 + i: set(engine.persisted.snapshot(i)[0].frozen) for i in range(window_size)}


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
