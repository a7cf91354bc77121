"""A warm standby's prebuilt rank (trainer/run/prebuilt.py): what setup takes on after the activation is what it
would have built itself, bit for bit, and the CPU generator is left where a fresh build leaves it. The
prebuilt path end to end, under a real SIGKILL, is tests/test_real_deaths.py's."""

from __future__ import annotations

import dataclasses

import torch

from parallelisms.mesh import ParallelismConfig, build_mesh, rank_coordinates
from parallelisms.parallelize import BuildOptions, parallelize
from tests.helpers import DEBUG_CONFIG, one_rank_group
from train import training_data
from trainer.config import load_config
from trainer.run.prebuilt import prebuild


def build(cfg, dims, stages=None):
    t = cfg.training
    shape = (t.batch_size // t.micro_batches, t.seq_len)
    opts = BuildOptions(cfg.job.seed, shape, t.micro_batches, t.mixed_precision, loss_chunk_tokens=0)
    return parallelize(cfg.model, dims, opts, stages)


def tensors(model) -> dict[str, torch.Tensor]:
    """Every parameter (its local tensor) and buffer, MoE load counters included."""
    named = [*model.view.named_parameters(), *model.view.named_buffers()]
    return {name: getattr(t, "_local_tensor", t).detach().clone() for name, t in named}


def test_a_prebuilt_rank_is_the_rank_setup_builds_and_leaves_the_generator_alike():
    """Guarantee: Bit-exact recovery (a prebuilt replacement). The standby prebuilds (warm-up included) under
    another generator state than setup would run in; taken on, its model equals a fresh build bit for bit
    (weights and buffers, bf16 FSDP2 on top), and the CPU generator ends in the fresh build's state."""
    cfg = load_config(DEBUG_CONFIG, ["--training.mixed_precision", "bf16"])
    with one_rank_group():
        dims = build_mesh(cfg.parallelism, "cpu")
        torch.manual_seed(1)
        fresh = build(cfg, dims)
        fresh_rng = torch.get_rng_state()
        torch.manual_seed(2)  # a standby's generator holds whatever its imports left
        prebuilt = prebuild(cfg, 0, 1, training_data, warm=True)
        prebuilt.activated()  # its buffer watch stops: nothing more is mapped behind the training thread
        assert prebuilt.fits(cfg, 0) and prebuilt.parts() == "data+model"
        assert not prebuilt.fits(cfg, 1)
        torch.manual_seed(3)  # the activation, the process group, the mesh
        taken = build(cfg, dims, prebuilt.stages)
        assert torch.equal(torch.get_rng_state(), fresh_rng)
    built, expected = tensors(taken), tensors(fresh)
    assert built.keys() == expected.keys()
    assert all(torch.equal(built[name], expected[name]) for name in expected)
    assert prebuilt.data[0].num_batches == training_data(cfg)[0].num_batches


def test_rank_coordinates_follow_the_mesh_order():
    """(pp, edp, ep) row-major: a standby knows its stage and experts from its rank alone."""
    cfg = ParallelismConfig(pp=2, dp=4, ep=2)
    assert [rank_coordinates(cfg, r) for r in range(8)] == [
        (p, d, d % 2) for p in range(2) for d in range(4)
    ]  # fmt: skip
    assert rank_coordinates(dataclasses.replace(cfg, dp=1, ep=1), 1) == (1, 0, 0)


def test_a_standby_of_a_checkpointing_job_watches_its_ranks_host_directory(tmp_path):
    """With `checkpoint.prefault` a standby maps its own rank's host directory while it waits (until
    `activated`); without checkpoints or without prefault it maps nothing."""
    common = ["--checkpoint.host_dir", str(tmp_path), "--job.name", "watched", "--parallelism.pp", "2"]
    for extra, watched in (
        (["--checkpoint.strategy", "moevement"], True),
        (["--checkpoint.strategy", "moevement", "--checkpoint.prefault", "false"], False),
        ([], False),
    ):
        prebuilt = prebuild(load_config(DEBUG_CONFIG, common + extra), 1, 2, training_data)
        try:
            assert (prebuilt.buffers is not None) == watched, extra
            if watched:
                assert prebuilt.buffers.rank_dir == tmp_path / "watched" / "rank00001"
        finally:
            prebuilt.activated()
