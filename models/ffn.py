"""SwiGLU feed-forward network: the dense FFN and every (routed or shared) expert."""

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``; maps [..., dim] -> [..., dim]. ``w2`` is the down projection."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
