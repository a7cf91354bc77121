"""The training state as named tensors, walked where it lives, and its layout-independent digest.

Names are global (`layers.3.moe.experts.17.w1.weight`: one expert's slice of a stacked weight);
optimizer tensors are named `optim.<param name>.<key>` (`exp_avg`, `exp_avg_sq`, `step`). The same
state gives the same names and bytes in any parallel layout.

Nothing proportional to the model is gathered on one rank. `training_plan` lists this rank's tensors
(parameters and their AdamW state) in one order that every rank of a data-parallel group shares, and
gives each tensor one owner: each tensor of an FSDP-sharded parameter (its replicated AdamW `step`
too) goes, in that order, to the rank of the parameter's mesh that owns the fewest bytes so far; a
plain tensor is its rank's alone (pipeline stages and expert ranks hold disjoint names).
`owned_tensors` walks the plan, assembling each sharded tensor within its group one at a time
(`full_tensor`: every rank of the group takes part), and yields the owner's full copies: host memory is
bounded by the largest tensor (twice, for a moment, while `full_tensor` re-lays out one sharded along its
second dimension). The digest and the dense checkpoint (`trainer.checkpoint.dense`) are
both written from that walk.

The `state_digest` is sha256 over the lines `<name> <tensor digest>\\n` in sorted name order, where a
tensor's digest is sha256 over `<name>|<dtype>|<shape>|` and its bytes (C order). Only those per-tensor
digests travel, to rank 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from models.experts import stacked_experts, unstack
from trainer.checkpoint.rank0 import gather_to_rank0

OPTIM_PREFIX = "optim."


@dataclasses.dataclass
class Unit:
    """One tensor of this rank's training state: a parameter (`key` None) or one of its AdamW tensors."""

    param: str  # the parameter's name in the model (a stacked expert weight: the whole stack)
    key: str | None
    tensor: torch.Tensor  # as this rank holds it: plain, or an FSDP-sharded DTensor
    names: list[str]  # its stored names: one per expert of a stacked weight
    owner: bool  # this rank digests and saves it

    def specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(stored name, dtype, shape) of each stored tensor: an expert's slice lacks the stack's first dim."""
        shape = tuple(self.tensor.shape)
        shape = shape if len(self.names) == 1 or not shape else shape[1:]
        return [(name, self.tensor.dtype, shape) for name in self.names]


def _assign_owners(units: list[tuple[torch.Tensor, Unit]]) -> None:
    """Give each unit of a sharded parameter to the least loaded rank (in bytes; ties: the lowest) of the
    parameter's mesh, in plan order: every rank of the mesh sees the same units, so all agree. A plain
    parameter's units are its rank's own."""
    loads: dict[tuple[int, ...], list[int]] = {}
    for param, unit in units:
        if not isinstance(param, DTensor):
            unit.owner = True
            continue
        ranks = tuple(param.device_mesh.mesh.flatten().tolist())
        load = loads.setdefault(ranks, [0] * len(ranks))
        owner = min(range(len(ranks)), key=load.__getitem__)
        load[owner] += unit.tensor.numel() * unit.tensor.dtype.itemsize
        unit.owner = ranks[owner] == dist.get_rank()


def training_plan(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Unit]:
    """Every parameter and AdamW tensor of this rank, ordered by element size (largest first), then as the
    model names its parameters: the same order on every rank of a group, and the order files take."""
    stacked = stacked_experts(model)
    units = []
    for name, param in model.named_parameters():
        names = stacked[name][1] if name in stacked else [name]
        units.append((param, Unit(name, None, param, names, False)))
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                units.append((param, Unit(name, key, value, [f"{OPTIM_PREFIX}{n}.{key}" for n in names], False)))
    units.sort(key=lambda pair: -pair[1].tensor.dtype.itemsize)  # stable: keeps the model's order
    _assign_owners(units)
    return [unit for _, unit in units]


def owned_tensors(plan: list[Unit], copy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(stored name, full CPU tensor) of every tensor this rank owns, in plan order, one unit at a time;
    with `copy`, tensors of their own (else a CPU parameter comes as itself, and changes with it).

    Collective: every rank walks its whole plan (drain it even when it stops using the tensors), since
    each sharded unit is assembled by all the ranks of its mesh."""
    for unit in plan:
        full = unit.tensor.full_tensor() if isinstance(unit.tensor, DTensor) else unit.tensor
        if unit.owner:
            yield from _stored(unit, full.detach().to("cpu", copy=copy))
        del full


def _stored(unit: Unit, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(stored name, tensor) of the unit's full value: each expert's slice of a stack (views, not copies)."""
    if len(unit.names) == 1:
        return [(unit.names[0], full)]
    return unstack(unit.param, full, {unit.param: (None, unit.names)})


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """sha256 over `<name>|<dtype>|<shape>|` and the tensor's bytes in C order."""
    tensor = tensor.contiguous()
    h = hashlib.sha256(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    h.update(tensor.view(-1).view(torch.uint8).numpy().data if tensor.numel() else b"")
    return h.hexdigest()


def combine(digests: dict[str, str]) -> str:
    """The state digest of per-tensor digests: sha256 over `<name> <digest>\\n` in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name} {digests[name]}\n".encode())
    return h.hexdigest()


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """The digest of a whole state held as one dict of named tensors (the reference definition)."""
    return combine({name: tensor_digest(name, tensor) for name, tensor in state.items()})


def training_state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """The whole job's state digest on rank 0 (None elsewhere), each tensor digested by its owner.

    Collective over all ranks; only (name, digest) strings travel."""
    mine = [(name, tensor_digest(name, tensor)) for name, tensor in owned_tensors(training_plan(model, optimizer))]
    gathered = gather_to_rank0(mine)
    if gathered is None:
        return None
    digests: dict[str, str] = {}
    for name, digest in (pair for part in gathered for pair in part):
        if name in digests:
            raise RuntimeError(f"state digest: tensor {name!r} digested by two ranks (ownership is ambiguous)")
        digests[name] = digest
    return combine(digests)


def named_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor this rank holds, by global name (CPU copies; FSDP-sharded ones
    assembled whole); a stacked expert parameter as one tensor of its own per expert. Collective over the
    data-parallel groups. The whole of this rank's state: for tests and comparisons, not for the end of a run."""
    state: dict[str, torch.Tensor] = {}
    for unit in training_plan(model, optimizer):
        full = unit.tensor.full_tensor() if isinstance(unit.tensor, DTensor) else unit.tensor
        # each expert's own copy: a slice would carry the whole stack's storage
        state.update((n, t.clone() if len(unit.names) > 1 else t) for n, t in _stored(unit, full.detach().cpu()))
    return state
