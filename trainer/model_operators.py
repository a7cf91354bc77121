"""The model's parameters as MoEvement's operator registry sees them (`moevement.operators`).

moevement knows operators and tensors, never model classes (tests/test_layering.py): this is where the
trainer tells it which of a model's parameters are stacked experts. Read by the strategies' wiring
(`trainer/run/strategy_factory.py`) and by the estimates of what a rank holds (`trainer/estimates/`).
"""

from __future__ import annotations

import torch

from models.experts import stacked_experts
from moevement.operators import Stacked


def stacked_operators(model: torch.nn.Module) -> dict[str, Stacked]:
    """The model's stacked expert parameters as the operator registry sees them: each slice one expert's tensor."""
    return {name: Stacked(names, module.set_frozen) for name, (module, names) in stacked_experts(model).items()}
