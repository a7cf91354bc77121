"""Learning-rate schedule and gradient clipping."""

import math

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
