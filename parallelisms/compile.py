"""torch.compile of transformer blocks, applied from outside the model after activation checkpointing.

`training.compile` compiles, in every block, the parts whose shapes depend on the batch only: the attention,
the dense SwiGLU FFN of a dense layer and a MoE layer's shared experts. A MoE layer's routing, permutation,
routed experts and combination stay eager: their shapes depend on the routing (the grouped GEMM,
``torch._grouped_mm``, has no compiled CPU kernel, and a whole compiled block fails to trace it); the RMSNorms
and dropouts stay eager too (torch's own modules: dynamo does not compile them as a frame of their own). Each
part is compiled in place (``nn.Module.compile``): module tree and parameter names are unchanged. Inside a
checkpointed block the recomputation calls the same compiled parts.

Bit-exactness contract: compiled kernels (fused elementwise code, reductions in another order) may give other
bits than eager ones, so a compiled run does not reproduce an eager run's digest; a compiled run reproduces
itself, and a compiled run recovered from a failure ends with the digest of the fault-free compiled run
(frozen operators of a replay recompile their parts once without weight gradients).
"""

from __future__ import annotations

import torch
from torch import nn

# the parts of a block that are compiled (those present), by attribute path
COMPILED_PARTS = ("attention", "feed_forward", "moe.shared_experts")


def compiled_parts(block: nn.Module) -> list[nn.Module]:
    """The modules of `block` that `apply_compile` compiles (the `COMPILED_PARTS` it has)."""
    found = []
    for path in COMPILED_PARTS:
        module = block
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if module is not None:
            found.append(module)
    return found


def apply_compile(part: nn.Module) -> int:
    """Compile the `COMPILED_PARTS` of every block of `part` (a model or a pipeline stage) in place, lazily
    (each compiles at its first call); returns how many.

    Whole graphs only (``fullgraph=True``: a part that cannot be traced fails at its first call) and no
    dynamic shapes (a part sees one micro-batch shape in training; validation and a replay's frozen weights
    compile their variants once). A part is never left to run eager behind the run's back, which would
    change its bits mid-run: reaching dynamo's recompile limit raises (a process-wide setting)."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    count = 0
    for block in part.layers.values():
        for module in compiled_parts(block):
            module.compile(fullgraph=True, dynamic=False)
            count += 1
    return count


def is_compiled(module: nn.Module) -> bool:
    """Whether `module` was compiled in place (``nn.Module.compile``)."""
    return getattr(module, "_compiled_call_impl", None) is not None
