"""Learning-rate schedule and gradient clipping."""

import math

import pytest
import torch

from trainer.config import TrainingConfig
from trainer.optim import clip_grad_norm, lr_at


def test_warmup_then_cosine():
    cfg = TrainingConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(1, cfg) == 0.1
    assert lr_at(10, cfg) == 1.0
    assert math.isclose(lr_at(60, cfg), 0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(lr_at(110, cfg), 0.1)


def test_clip_reports_norm_and_coefficient():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    norm, coef = clip_grad_norm([p], max_norm=1.0)
    assert math.isclose(norm, 5.0, rel_tol=1e-6)
    assert math.isclose(coef, 1.0 / (5.0 + 1e-6), rel_tol=1e-6)
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.8]), atol=1e-6)
    p.grad = torch.tensor([0.3, 0.4])
    norm, coef = clip_grad_norm([p], max_norm=1.0)
    assert coef == 1.0 and torch.equal(p.grad, torch.tensor([0.3, 0.4]))


def test_local_shard_adamw_matches_adamw_on_dtensors_bit_for_bit():
    """The update on local shards equals DTensor dispatch's, also when only some parameters have
    gradients (a replay: frozen operators have none), and leaves gradient-less parameters alone."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer.optim import LocalShardAdamW

    if dist.is_initialized():
        pytest.skip("needs its own one-rank process group")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        gen = torch.Generator().manual_seed(0)
        shapes = [(8, 4), (6,), (3, 5), (4, 4)]
        init = [torch.randn(s, generator=gen) for s in shapes]
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
        active = [{0, 1, 2, 3}, {0, 2}, {1, 3}, {2}]
        results = []
        for cls in (torch.optim.AdamW, LocalShardAdamW):
            params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
            opt = cls(params, lr=1e-2, weight_decay=0.1, foreach=True)
            for step, subset in enumerate(active):
                for i, p in enumerate(params):
                    p.grad = distribute_tensor(grads[step][i], mesh, [Shard(0)]) if i in subset else None
                before = [p.to_local().clone() for p in params]
                opt.step()
                for i, p in enumerate(params):
                    assert torch.equal(p.to_local(), before[i]) == (i not in subset)
            results.append(
                (
                    [p.to_local() for p in params],
                    [opt.state[p][k].to_local() for p in params for k in ("exp_avg", "exp_avg_sq")],
                )
            )
        for ref, got in zip(results[0], results[1]):
            assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    finally:
        dist.destroy_process_group()
