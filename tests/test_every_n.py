"""The docs' example of adding a strategy (`baselines/every_n.py` and its registry entry), built through the
registry and restoring exactly: in process over a real one-rank gloo group (default suite), and end to end
under torchrun with a failure (slow)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from baselines.strategy import IntervalBaseline
from parallelisms.mesh import build_mesh
from tests.helpers import DEBUG_CONFIG, base_args, final_line, one_rank_group, step_losses
from tests.test_baselines import baseline_recoveries, baseline_run, reference
from train import build_training
from trainer.checkpoint.state import training_state_digest
from trainer.config import ConfigError, load_config
from trainer.lifecycle.fault_bounds import fault_bounds
from trainer.lifecycle.process_state import ProcessState
from trainer.lifecycle.start_plan import StartPlan
from trainer.lifecycle.startup import STARTUP
from trainer.run.strategy_factory import TrainingParts, build_strategy
from trainer.step import DropoutSeeder, take_expert_load, train_step
from trainer.strategy_registry import STRATEGIES


def test_every_n_needs_its_n():
    with pytest.raises(ConfigError, match="'checkpoint.interval' must be N"):
        load_config(DEBUG_CONFIG, ["--checkpoint.strategy", "every_n"])


def _batch(cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    shape = (cfg.training.batch_size, cfg.training.seq_len)
    tokens = torch.randint(0, cfg.model.vocab_size, (shape[0], shape[1] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # the same batch for the same iteration, as the loader gives


def _iteration(cfg, dims, model, optimizer, seeder, ft, step: int) -> None:
    """One iteration as train.py runs it: snapshot (if due), forward/backward, optimizer step, `end`."""
    inputs, labels = _batch(cfg, step)
    seeder.begin(step)
    ft.begin(step)
    result = train_step(model, optimizer, inputs, labels, step, cfg.training, dims)
    tokens, gate_probs = take_expert_load(model.view)
    scalars = {"loss": result.loss, "aux_loss": result.aux_loss, "lr": result.lr, "grad_norm": result.grad_norm}
    ft.end(step, {**scalars, "clip_coef": result.clip_coef, "loss_scale": 1.0, "skipped": False}, tokens, gate_probs)


def test_every_n_built_through_the_registry_rolls_back_to_its_checkpoint_exactly(tmp_path: Path):
    """Checkpoints of state_3 and state_5 (N = 2, from the first iteration after the copy is measured); rolled
    back before iteration 7, the model and optimizer are state_5 bit for bit, and iterations 5-6 run again to
    the same states. A small batch: the test is about the strategy, not the model."""
    args = [*base_args(steps=8)[2:], "--checkpoint.strategy", "every_n", "--checkpoint.interval", "2"]
    args += ["--training.batch_size", "4", "--training.seq_len", "32", "--model.n_layers", "2"]
    args += ["--checkpoint.host_dir", str(tmp_path / "shm"), "--job.output_dir", str(tmp_path / "out")]
    cfg = load_config(DEBUG_CONFIG, args)
    assert STRATEGIES["every_n"].build == "baselines.every_n:build"
    with one_rank_group():
        dims = build_mesh(cfg.parallelism, "cpu", cfg.fault.timeout_s)
        model, optimizer = build_training(cfg, dims)
        seeder = DropoutSeeder(model, cfg.job.seed, dims.dp_rank)
        lines: list = []
        parts = TrainingParts(model, optimizer, dims, seeder, None)
        process = ProcessState(STARTUP, bounds=fault_bounds(cfg.fault))
        ft = build_strategy(cfg, parts, lines.append, StartPlan("", 0, process=process))
        assert isinstance(ft, IntervalBaseline) and ft.rollback.strategy == "every_n"
        loss = ft.resume(0, math.nan)
        assert loss[0] == 0  # a new run: from train.py's start
        before: dict[int, str] = {}
        for step in range(1, 7):
            before[step] = training_state_digest(model.view, optimizer)
            _iteration(cfg, dims, model, optimizer, seeder, ft, step)
        after_6 = training_state_digest(model.view, optimizer)
        assert before[5] != after_6 and ft.recover(7, []) == 5
        [report] = [line for line in lines if not isinstance(line, str)]
        assert (report.step, report.rollback_to, report.strategy) == (7, 5, "every_n")
        for step in range(5, 7):
            assert training_state_digest(model.view, optimizer) == before[step]
            _iteration(cfg, dims, model, optimizer, seeder, ft, step)
        assert training_state_digest(model.view, optimizer) == after_6
        ft.close()


@pytest.mark.slow
def test_every_n_recovers_a_failure_under_torchrun_exactly(tmp_path: Path):
    """Two pipeline stages under torchrun; rank 1 fails before iteration 8: both roll back to the checkpoint of
    6 (N = 3: 3, 6, 9) and the run ends with the fault-free run's digest."""
    out = baseline_run(tmp_path, "every_n", "--checkpoint.interval", "3", "--fault.at", "8:1")
    [r] = baseline_recoveries(out)
    assert (r.step, r.ranks, r.scope, r.rollback_to, r.strategy) == (8, (1,), (0, 1), 6, "every_n")
    assert step_losses(out) == step_losses(reference())
    assert final_line(out) == final_line(reference())
