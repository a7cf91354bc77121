"""Localized recovery and whole-job restart, bit-exact against fault-free runs (docs/design/replay.md,
docs/design/recovery.md).

Every case launches real processes under torchrun with gloo. A fault run must print the same
`step=` loss for every iteration and the same final `state_digest` as the fault-free run of the
same layout; several failures share one run where their windows do not interact, so the suite
covers every case with few launches.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models import ModelArgs, build_model
from models.experts import GROUPED_MM_FLOPS
from moevement.operators import build_registry
from moevement.recovery.replay import frozen_slices_kept, set_frozen
from moevement.recovery.replay_threads import intra_op_threads, replay_threads
from parallelisms.pipeline import lm_loss
from tests.helpers import (
    BASE,
    INTERLEAVED,
    MOEVEMENT,
    PP2_DP2_EP2_BF16,
    PP4,
    assert_each_step_once,
    baseline,
    final_line,
    recoveries,
    recovery_work,
    run_cli,
    steps,
)
from tests.tiny_moe import ARGS as TINY_ARGS
from trainer.model_operators import stacked_operators


def localized(out: str) -> list[tuple]:
    """(step, ranks, scope, rollback_to, replayed) of each recovery in place (no restart) of a run."""
    return [(r.step, r.ranks, r.scope, r.rollback_to, r.replayed) for r in recoveries(out) if r.restart is None]


def assert_identical(out: str, reference: str) -> None:
    """Every iteration recorded once with the fault-free run's loss, and the fault-free run's final state."""
    assert_each_step_once(out, reference)
    assert final_line(out) == final_line(reference)


def fault_run(tmp_path, layout: list[str], nproc: int, *extra: str, torchrun: tuple[str, ...] = ()) -> str:
    return run_cli(
        *BASE,
        *layout,
        *MOEVEMENT,
        "--checkpoint.host_dir",
        str(tmp_path / "shm"),
        *extra,
        nproc=nproc,
        torchrun=torchrun,
    ).stdout


# In the default suite, bf16 and clipping recover bit-exactly under a real death
# (tests/test_real_deaths.py::test_sigkill_in_backward_is_replaced_in_place); expert and data parallelism's
# recovery joins the layout matrix (orderings, schedules, pp=4) in make test-all.
@pytest.mark.slow
def test_pp2_dp2_ep2_bf16_clipped_one_failure(tmp_path):
    """Bit-exact localized recovery with clipping, bf16, expert and data parallelism."""
    reference = baseline(PP2_DP2_EP2_BF16, 4)
    assert steps(reference)[7].value("grad_norm") > 0.5  # clipping is active (max_grad_norm 0.5)
    # slots cut by bytes: uneven operator counts per slot, the same exactness; replay with more threads
    # than training (3 against 1): the same bits (MKL_CBWR strict mode, moevement/recovery/replay_threads.py)
    out = fault_run(
        tmp_path, PP2_DP2_EP2_BF16, 4, "--fault.at", "8:1", "--checkpoint.slots", "bytes", "--fault.replay_threads", "3"
    )
    assert_identical(out, reference)
    # windows 3-5, 6-8: at 8 the newest persisted one starts at 3; the whole of stage 0 rolls back
    assert localized(out) == [(8, (1,), (0,), 3, 5)]
    work = recovery_work(out)
    roles = {w.rank: (w.role, w.forwards, w.backwards) for w in work}
    assert roles[1][0] == "failed" and roles[0][0] == "rolled-back"
    assert all(roles[r] == ("healthy", 0, 0) for r in (2, 3))  # the other stage re-executes nothing
    assert any(w.rank == 1 and w.threads == 3 and re.match(r"rank\d", w.snapshots_from or "") for w in work)
    phases = ["load", "forward", "backward", "reduce", "optimizer"]
    assert any(
        (w.rank, w.role, w.threads, w.snapshots_from) == (0, "rolled-back", 3, None)
        and [p for p, _ in w.replay_s] == phases
        and all(s >= 0 for _, s in w.replay_s)
        for w in work
    )


@pytest.mark.slow  # about 30 s
def test_dp2_soft_ordering_one_failure(tmp_path):
    """Bit-exact recovery under every ordering policy: `soft` at dp > ep, where each replica once
    ordered its experts' shards by its own gate probabilities, so the replicas' slots disagreed and the
    recovered state differed from the fault-free one (every replica now orders by the group's sums)."""
    layout = ["--parallelism.dp", "2", "--checkpoint.ordering", "soft"]
    out = fault_run(tmp_path, layout, 2, "--fault.at", "8:1")
    assert_identical(out, baseline(layout, 2))
    assert localized(out) == [(8, (1,), (0,), 3, 5)]


@pytest.mark.slow
def test_pp4_first_window_middle_stage_and_two_disjoint_stages(tmp_path):
    reference = baseline(PP4, 4)
    # 4: nothing persisted yet (first window 3-5) -> initial state; 8: middle stage; 11: stages 0 and 2
    out = fault_run(tmp_path, PP4, 4, "--fault.at", "4:1,8:2,11:0+2")
    assert_identical(out, reference)
    assert localized(out) == [
        (4, (1,), (1,), 1, 3),
        (8, (2,), (2,), 4, 4),
        (11, (0, 2), (0, 2), 8, 3),
    ]
    # a lone replaying rank takes every core of the node (auto, with MKL's strict mode); two share them
    work = recovery_work(out)
    threads = [w.threads for w in work if w.role == "failed" and w.threads]
    cpus = len(os.sched_getaffinity(0)) if torch.backends.mkl.is_available() else 1
    assert threads == [cpus, cpus, max(1, cpus // 2), max(1, cpus // 2)]
    for w in work[-4:]:  # the last recovery: stages 1 and 3 only serve logs
        if w.rank in (1, 3):
            assert (w.role, w.forwards, w.backwards) == ("healthy", 0, 0)
        else:
            assert w.role == "failed" and w.forwards == w.backwards == 3 * 4  # 3 iterations x 4 micro-batches


@pytest.mark.slow
def test_pp4_adjacent_stages_and_a_failure_during_recovery(tmp_path):
    reference = baseline(PP4, 4)
    # 7: stages 1 and 2 together; 11: stage 1 fails, and stage 2 fails while stage 1 is recovering
    out = fault_run(tmp_path, PP4, 4, "--fault.at", "7:1+2,11:1,11:2")
    assert_identical(out, reference)
    assert localized(out) == [(7, (1, 2), (1, 2), 3, 4), (11, (1, 2), (1, 2), 7, 4)]


@pytest.mark.slow
def test_interleaved_1f1b_failure(tmp_path):
    reference = baseline(INTERLEAVED, 2)
    out = fault_run(tmp_path, INTERLEAVED, 2, "--fault.at", "8:1")
    assert_identical(out, reference)
    assert localized(out) == [(8, (1,), (1, 3), 3, 5)]  # pipeline rank 1 runs stages 1 and 3


def test_frozen_operators_compute_no_weight_gradient():
    """A frozen operator gets no gradient and costs no weight-gradient FLOPs; the input gradient still flows."""
    args = ModelArgs(**{**TINY_ARGS, "n_layers": 2})
    torch.manual_seed(0)
    model = build_model(args)
    ops = {op.name: op for op in build_registry(model, stacked_operators(model))}
    x = torch.randint(0, 64, (2, 16))

    def backward_flops() -> int:
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), x)
        with FlopCounterMode(display=False, custom_mapping=GROUPED_MM_FLOPS) as counter:
            loss.backward()
        return counter.get_total_flops()

    all_active = backward_flops()
    frozen = [ops["layers.1"], ops["layers.1.moe.experts.0"], ops["layers.1.moe"], ops["head"]]
    set_frozen(frozen, True)
    partly_frozen = backward_flops()
    for op in ops.values():
        for name, ref in op.params.items():
            if ref.index is None:
                assert (ref.param.grad is None) == (op in frozen), name
            else:  # a slice of the stacked experts: no weight-gradient product for it, its gradient slice is zero
                assert (ref.part_of(ref.param.grad).abs().sum() == 0) == (op in frozen), name
    assert partly_frozen < all_active
    set_frozen(list(ops.values()), False)
    assert backward_flops() == all_active
    set_frozen(frozen, True, weight_grad=True)  # the ablation: computed all the same, dropped before the step
    assert backward_flops() == all_active and all(ref.param.grad is not None for ref in ops["head"].params.values())
    with frozen_slices_kept(frozen, torch.optim.SGD(model.parameters(), lr=0.0)):
        assert all(ref.param.grad is None for op in frozen for ref in op.params.values() if ref.index is None)


def test_an_optimizer_step_leaves_frozen_experts_slices_untouched():
    """AdamW updates the stacked expert weights whole: around a replayed step, the frozen experts' slices of the
    weights and of both moments end as they began, and the active experts move as in training."""
    args = ModelArgs(family="gpt", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_routed_experts=4,
                     expert_hidden_dim=16, top_k=2, max_seq_len=32, n_dense_layers=0)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(args)
    ops = {op.name: op for op in build_registry(model, stacked_operators(model))}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randint(0, 64, (2, 16))

    def step(frozen: list) -> None:
        set_frozen(frozen, True)
        lm_loss(model(x), x).backward()
        with frozen_slices_kept(list(ops.values()), optimizer):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        set_frozen(frozen, False)

    step([])  # the stacked tensors now have AdamW state
    frozen = [ops["layers.0.moe.experts.1"], ops["layers.1.moe.experts.3"]]
    expert_ops = [op for op in ops.values() if op.kind == "expert"]

    def weights_and_moments(op) -> dict[str, torch.Tensor]:  # the step counter is the stacked tensor's, shared
        return {name: t.clone() for name, t in op.master_tensors(optimizer) if not name.endswith(".step")}

    before = {op.name: weights_and_moments(op) for op in expert_ops}
    step(frozen)
    for op in expert_ops:
        after = weights_and_moments(op)
        moved = [not torch.equal(before[op.name][name], after[name]) for name in after]
        assert len(moved) == 9 and (not any(moved) if op in frozen else all(moved)), op.name


def test_replay_threads_share_the_node_among_its_replaying_ranks(monkeypatch):
    cpu, node_of = torch.device("cpu"), [0, 0, 0, 0, 1, 1, 1, 1]
    monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
    if torch.backends.mkl.is_available():
        assert replay_threads([1], node_of, 1, 0, 1, cpu, cpus=8) == 8  # alone on its node
        assert replay_threads([1, 2, 5], node_of, 1, 0, 1, cpu, cpus=8) == 4  # rank 5 is on the other node
        assert replay_threads(range(8), node_of, 1, 0, 1, cpu, cpus=8) == 2  # global rollback: 4 share 8
        assert replay_threads(range(8), node_of, 1, 0, 3, cpu, cpus=8) == 3  # never below the training count
    assert replay_threads([1], node_of, 1, 5, 1, cpu, cpus=8) == 5  # asked for explicitly
    assert replay_threads([1], node_of, 1, 0, 1, torch.device("cuda"), cpus=8) == 1  # CPU threads do not compute
    monkeypatch.setenv("MKL_CBWR", "AUTO")  # GEMM bits may depend on the thread count: keep training's
    assert replay_threads([1], node_of, 1, 0, 1, cpu, cpus=8) == 1
    before = torch.get_num_threads()
    with intra_op_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before


# ---- after a recovery, training goes on through later windows, to a run that ends mid-window ----------
# A run's last snapshot is replicated to same-node peers out of its sender's shared memory; when it
# does not end its window no all-reduce follows, and the sender must not remove its buffers before
# the peers have copied them (a recovery realigns the windows, so a run that ended on a window
# boundary ends inside one after it).

BF16_CLIPPED = ["--training.mixed_precision", "bf16", "--training.max_grad_norm", "1.0"]
FP32_UNCLIPPED = ["--training.mixed_precision", "fp32", "--training.max_grad_norm", "0"]
PP4_INTERLEAVED = [
    "--parallelism.pp",
    "4",
    "--parallelism.schedule",
    "Interleaved1F1B",
    "--parallelism.stages_per_rank",
    "2",
    "--training.micro_batches",
    "4",
    "--model.n_layers",
    "8",
]


@pytest.mark.slow
def test_pp4_window3_bf16_clipped_middle_stage_then_two_more_windows(tmp_path):
    """The reported case: stage 1 fails at 7 (mid-window); windows restart at 7, cross 10 and 13, and the run
    ends at 14, inside window 13-15; every later step and the final state equal the fault-free run's."""
    layout = [*PP4, *BF16_CLIPPED, "--training.steps", "14"]
    reference = baseline(layout, 4)
    out = run_cli(
        *BASE,
        *layout,
        "--checkpoint.strategy",
        "moevement",
        "--checkpoint.window",
        "3",
        "--checkpoint.host_dir",
        str(tmp_path / "shm"),
        "--fault.at",
        "7:1",
        nproc=4,
    ).stdout
    assert_identical(out, reference)
    assert localized(out) == [(7, (1,), (1,), 3, 4)]
    assert steps(out)[13].value("window") == 3


STAGE_FAULTS = "5:0,9:1,13:2,17:3"  # every stage position of pp=4, each failing inside a different window
STAGE_STEPS = "20"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
@pytest.mark.parametrize("precision", ["fp32", "bf16_clipped"])
@pytest.mark.parametrize("window", ["1", "3", "0"])  # 0: Algorithm 1
def test_pp4_each_stage_fails_in_turn(tmp_path, schedule, precision, window):
    """pp=4: ranks 0, 1, 2, 3 fail one after the other; each recovers alone and training goes on through
    later windows, ending mid-window where W > 1; bit-exact against the fault-free run of the layout."""
    layout = [
        *(PP4 if schedule == "1F1B" else PP4_INTERLEAVED),
        *(BF16_CLIPPED if precision == "bf16_clipped" else FP32_UNCLIPPED),
        "--training.steps",
        STAGE_STEPS,
    ]
    reference = baseline(layout, 4)  # one fault-free run per layout, shared by the three window sizes
    out = run_cli(
        *BASE,
        *layout,
        "--checkpoint.strategy",
        "moevement",
        "--checkpoint.window",
        window,
        "--checkpoint.host_dir",
        str(tmp_path / "shm"),
        "--fault.at",
        STAGE_FAULTS,
        nproc=4,
    ).stdout
    assert_identical(out, reference)
    found = localized(out)
    assert [(step, ranks) for step, ranks, *_ in found] == [(5, (0,)), (9, (1,)), (13, (2,)), (17, (3,))]
    stages_of = (lambda r: (r,)) if schedule == "1F1B" else (lambda r: (r, r + 4))
    assert [scope for _, _, scope, *_ in found] == [stages_of(r) for r in range(4)]
