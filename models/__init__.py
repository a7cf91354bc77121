"""Single-device MoE transformer: ``build_model(args)`` and ``count_params(args)``."""

import torch

from models.args import ModelArgs
from models.moe import MoE
from models.transformer import Transformer

__all__ = ["ModelArgs", "MoE", "Transformer", "build_model", "count_params"]


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
    inactive = sum(
        idle_experts * sum(p.numel() for p in moe.experts["0"].parameters()) for moe in model.moe_layers().values()
    )
    return total, total - inactive
