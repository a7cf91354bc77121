"""Operator registry: the local model shard cut into the units MoEvement snapshots and freezes.

An operator (docs/design.md §2) is each routed expert, each router (with its persistent buffers),
each MoE layer's shared experts, the non-expert part of each block, the embedding, and the
head (final norm + output projection). Operators are recognised by the global parameter names
alone, so any model that follows the naming of `models/` works, in any parallel layout: under
FSDP2 the tensors are this rank's shards, under expert parallelism only the local experts exist.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

# (pattern on the global tensor name, kind); the first match wins. The match's `op` group names
# the operator: every tensor under `layers.3.moe.experts.17.` belongs to `layers.3.moe.experts.17`.
RULES: tuple[tuple[re.Pattern, str], ...] = tuple(
    (re.compile(p), kind)
    for p, kind in (
        (r"^(?P<op>layers\.(?P<layer>\d+)\.moe\.experts\.(?P<expert>\d+))\.", "expert"),
        (r"^(?P<op>layers\.(?P<layer>\d+)\.moe\.router)\.", "router"),
        (r"^(?P<op>layers\.(?P<layer>\d+)\.moe)\.(shared_experts|shared_expert_gate)", "shared_expert"),
        (r"^(?P<op>layers\.(?P<layer>\d+))\.", "block"),
        (r"^(?P<op>tok_embeddings)\.", "embedding"),
        (r"^(norm|output)\.", "head"),
    )
)
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "step")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a (possibly DTensor) parameter or state tensor, detached."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return tensor.detach()


@dataclass
class Operator:
    name: str  # e.g. `layers.3.moe.experts.17`, `layers.3.moe.router`, `layers.3`, `head`
    kind: str  # expert | router | shared_expert | block | embedding | head
    layer: int | None = None
    expert: int | None = None
    params: dict[str, nn.Parameter] = field(default_factory=dict)  # global name -> parameter
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # persistent non-gradient state

    def numel(self) -> int:
        return sum(local_tensor(p).numel() for p in self.params.values())

    def master_tensors(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the full FP32 training state: master weights, buffers, optimizer state."""
        out = [(name, local_tensor(p)) for name, p in self.params.items()]
        out += [(name, b.detach()) for name, b in self.buffers.items()]
        for name, p in self.params.items():
            state = optimizer.state.get(p, {})
            out += [(f"optim.{name}.{key}", local_tensor(state[key])) for key in OPTIMIZER_KEYS if key in state]
        return out

    def compute_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of what a frozen operator needs to run: its weights (cast on copy) and buffers."""
        return [(name, local_tensor(p)) for name, p in self.params.items()] + [
            (name, b.detach()) for name, b in self.buffers.items()
        ]

    def fp32_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of the full FP32 state; a parameter without optimizer state yet counts AdamW's two moments."""
        total = self._buffer_bytes()
        for p in self.params.values():
            nbytes = _nbytes(local_tensor(p))
            state = optimizer.state.get(p)
            total += nbytes + (
                sum(_nbytes(local_tensor(state[k])) for k in OPTIMIZER_KEYS if k in state) if state else 2 * nbytes
            )
        return total

    def compute_bytes(self, compute_dtype: torch.dtype) -> int:
        return self.numel() * compute_dtype.itemsize + self._buffer_bytes()

    def _buffer_bytes(self) -> int:
        return sum(_nbytes(b) for b in self.buffers.values())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def build_registry(model: nn.Module) -> list[Operator]:
    """The operators of the local model shard, in parameter order; every parameter in exactly one."""
    ops: dict[str, Operator] = {}
    persistent = set(model.state_dict().keys())
    tensors = [(name, p, True) for name, p in model.named_parameters()]
    tensors += [(name, b, False) for name, b in model.named_buffers() if name in persistent]
    for name, tensor, is_param in tensors:
        op = _classify(name, ops)
        (op.params if is_param else op.buffers)[name] = tensor
    return list(ops.values())


def _classify(name: str, ops: dict[str, Operator]) -> Operator:
    for pattern, kind in RULES:
        m = pattern.match(name)
        if m is None:
            continue
        groups = m.groupdict()
        op_name = groups.get("op") or kind
        if op_name not in ops:
            layer, expert = groups.get("layer"), groups.get("expert")
            ops[op_name] = Operator(
                op_name, kind, None if layer is None else int(layer), None if expert is None else int(expert)
            )
        return ops[op_name]
    raise ValueError(f"tensor {name!r} belongs to no MoEvement operator (see moevement.operators.RULES)")
