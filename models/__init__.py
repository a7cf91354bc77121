"""Single-device MoE transformer: ``build_model(args)`` and ``count_params(args)``."""

import torch

from models.args import ModelArgs
from models.experts import named_tensors
from models.moe import MoE
from models.transformer import Transformer

__all__ = ["ModelArgs", "MoE", "Transformer", "build_model", "count_params", "stored_shapes"]


def build_model(args: ModelArgs, device: torch.device | str = "cpu") -> Transformer:
    """Validate ``args``, build on meta, materialise on ``device`` and ``init_weights()`` (uses torch's RNG)."""
    args.validate()
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights()
    return model


def count_params(args: ModelArgs) -> tuple[int, int]:
    """(total, active) parameter counts, computed on the meta device.

    Active = parameters used per token: everything (embeddings and head included) except the
    routed experts beyond ``top_k`` in each MoE layer. Tied embeddings count once.
    """
    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    idle_experts = args.n_routed_experts - args.top_k
    inactive = sum(idle_experts * moe.experts.params_per_expert() for moe in model.moe_layers().values())
    return total, total - inactive


def stored_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole model as checkpoints store it (each routed expert's own: the slices of
    the stacked expert weights) and its shape, computed on the meta device."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in named_tensors(Transformer(args))}
