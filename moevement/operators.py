"""Operator registry: the local model shard cut into the units MoEvement snapshots and freezes.

An operator (docs/design/state-and-snapshots.md, "Operators") is each routed expert, each router (with its persistent
buffers), each MoE layer's shared experts, the non-expert part of each block, the embedding, and the
head (final norm + output projection). Operators are recognised by the global parameter names
alone, so any model that follows the naming of `models/` works, in any parallel layout: under
FSDP2 the tensors are this rank's shards, under expert parallelism only the local experts exist.
A parameter that stacks several operators' tensors (a layer's routed experts, one grouped-GEMM
operand) is described by a :class:`Stacked`: each slice is named and handled as a tensor of its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
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


@dataclass(frozen=True)
class Stacked:
    """A parameter whose dim 0 enumerates tensors of different operators (a layer's stacked routed experts).

    Slice ``i`` is the tensor named ``names[i]`` (``layers.3.moe.experts.17.w1.weight``); ``freeze(i, frozen)``
    stops or resumes its weight gradient (the parameter as a whole keeps ``requires_grad``).
    """

    names: Sequence[str]
    freeze: Callable[[int, bool], None]


@dataclass(frozen=True)
class TensorRef:
    """One named tensor of an operator: a parameter, or slice ``index`` of a stacked one."""

    param: nn.Parameter
    index: int | None = None
    freeze: Callable[[int, bool], None] | None = None

    def local(self, views: LocalViews | None = None) -> torch.Tensor:
        """This rank's part of the tensor (its FSDP shard), a view the caller may read or write."""
        return self.part_of(self.param, views)

    def part_of(self, tensor: torch.Tensor, views: LocalViews | None = None) -> torch.Tensor:
        """The same part of a tensor shaped like the parameter (its optimizer state); a 0-dim one whole.
        With `views`, resolved through its cache (the same view as without)."""
        if views is not None:
            return views.part(tensor, self.index)
        tensor = local_tensor(tensor)
        return tensor if self.index is None or tensor.dim() == 0 else tensor[self.index]

    def state(self, optimizer: torch.optim.Optimizer, key: str, views: LocalViews | None = None) -> torch.Tensor | None:
        value = optimizer.state.get(self.param, {}).get(key)
        return None if value is None else self.part_of(value, views)

    def largest_numel(self, tensor: torch.Tensor) -> int:
        """Elements of the largest part `part_of` gives any rank of `tensor` (shaped like the parameter, or
        0-dim): the same on every rank of a data-parallel group, where the local parts differ by a row when a
        sharded dimension does not divide (FSDP cuts `ceil(rows / ranks)` rows for the first ranks)."""
        if tensor.dim() == 0:
            return 1
        shape = list(tensor.shape)
        for mesh_dim, placement in enumerate(getattr(tensor, "placements", ())):
            if placement.is_shard():
                shape[placement.dim] = -(-shape[placement.dim] // tensor.device_mesh.size(mesh_dim))
        return math.prod(shape[1:] if self.index is not None else shape)

    def set_frozen(self, frozen: bool) -> None:
        if self.index is None:
            self.param.requires_grad_(not frozen)
        else:
            self.freeze(self.index, frozen)


class LocalViews:
    """The local parts of parameters and optimizer state, each tensor resolved once.

    Under FSDP every parameter and state tensor is a DTensor, whose `to_local` costs tens of microseconds
    of dispatch; a stacked parameter has one slice per expert. Resolving every operator's tensors one by
    one costs milliseconds per snapshot layout; here each tensor is made local once and a stacked one is
    cut into its slices in one `unbind`. Valid while the tensors it resolved are the model's and the
    optimizer's (a window: see `optimizer_tensors`); it keeps them alive, so identities stay unique.
    """

    def __init__(self) -> None:
        self._local: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, its local part)
        self._slices: dict[int, tuple[torch.Tensor, ...]] = {}

    def part(self, tensor: torch.Tensor, index: int | None) -> torch.Tensor:
        """`tensor`'s local part, or slice `index` of it (a 0-dim tensor whole), as `TensorRef.part_of`."""
        key = id(tensor)
        if key not in self._local:
            self._local[key] = (tensor, local_tensor(tensor))
        local = self._local[key][1]
        if index is None or local.dim() == 0:
            return local
        if key not in self._slices:
            self._slices[key] = local.unbind(0)
        return self._slices[key][index]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter's optimizer state tensors in order: compared by identity, a difference means state
    was created (a first step) or replaced (a load) since."""
    return [
        value
        for group in optimizer.param_groups
        for p in group["params"]
        for value in optimizer.state.get(p, {}).values()
        if isinstance(value, torch.Tensor)
    ]


@dataclass
class Operator:
    name: str  # e.g. `layers.3.moe.experts.17`, `layers.3.moe.router`, `layers.3`, `head`
    kind: str  # expert | router | shared_expert | block | embedding | head
    layer: int | None = None
    expert: int | None = None
    params: dict[str, TensorRef] = field(default_factory=dict)  # global name -> its tensor
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # persistent non-gradient state
    frozen: bool = False  # during a replay: forward and input gradient only (moevement.recovery.replay)

    def numel(self) -> int:
        """Elements of its parameters' largest parts (`TensorRef.largest_numel`: alike on every replica)."""
        return sum(ref.largest_numel(ref.param) for ref in self.params.values())

    def master_tensors(
        self, optimizer: torch.optim.Optimizer, views: LocalViews | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the full FP32 training state: master weights, buffers, optimizer state."""
        out = [(name, ref.local(views)) for name, ref in self.params.items()]
        out += [(name, b.detach()) for name, b in self.buffers.items()]
        for name, ref in self.params.items():
            out += [
                (f"optim.{name}.{key}", value)
                for key in OPTIMIZER_KEYS
                if (value := ref.state(optimizer, key, views)) is not None
            ]
        return out

    def compute_tensors(self, views: LocalViews | None = None) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of what a frozen operator needs to run: its weights (cast on copy) and buffers."""
        return [(name, ref.local(views)) for name, ref in self.params.items()] + [
            (name, b.detach()) for name, b in self.buffers.items()
        ]

    def fp32_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of the full FP32 state of the largest part any replica holds (so every replica of a data-parallel
        group plans alike); a parameter without optimizer state yet counts AdamW's two moments."""
        total = self._buffer_bytes()
        for ref in self.params.values():
            nbytes = ref.largest_numel(ref.param) * ref.param.element_size()
            state = optimizer.state.get(ref.param, {})
            states = [v for k in OPTIMIZER_KEYS if (v := state.get(k)) is not None]
            total += nbytes + (sum(ref.largest_numel(v) * v.element_size() for v in states) if states else 2 * nbytes)
        return total

    def compute_bytes(self, compute_dtype: torch.dtype) -> int:
        """Bytes of its compute weights' largest parts (as `fp32_bytes`) and its buffers."""
        return self.numel() * compute_dtype.itemsize + self._buffer_bytes()

    def _buffer_bytes(self) -> int:
        return sum(_nbytes(b) for b in self.buffers.values())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def build_registry(model: nn.Module, stacked: Mapping[str, Stacked] | None = None) -> list[Operator]:
    """The operators of the local model shard, in parameter order; every parameter (every slice of a
    ``stacked`` one, by parameter name) in exactly one."""
    stacked = stacked or {}
    ops: dict[str, Operator] = {}
    persistent = set(model.state_dict().keys())
    for name, p in model.named_parameters():
        if name in stacked:
            refs = [(each, TensorRef(p, i, stacked[name].freeze)) for i, each in enumerate(stacked[name].names)]
        else:
            refs = [(name, TensorRef(p))]
        for each, ref in refs:
            _classify(each, ops).params[each] = ref
    for name, b in model.named_buffers():
        if name in persistent:
            _classify(name, ops).buffers[name] = b
    return list(ops.values())


STACKED_EXPERTS = re.compile(r"^layers\.\d+\.moe\.experts\.[^.]+$")  # `layers.3.moe.experts.w1`: every expert's


def _classify(name: str, ops: dict[str, Operator]) -> Operator:
    if STACKED_EXPERTS.match(name):
        raise ValueError(f"tensor {name!r} stacks several experts: build_registry needs its Stacked description")
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
