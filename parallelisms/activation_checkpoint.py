"""Activation checkpointing of transformer blocks, applied from outside the model (TorchTitan's `apply_ac`).

Modes (`training.activation_checkpoint`):
  - ``none``: every block keeps its activations for backward.
  - ``full``: every block keeps only its inputs; backward runs the block's forward again to regain them.
  - ``selective``: the blocks with an even global layer id (0, 2, 4, ...) are checkpointed, every other
    block: about half the activation memory saved for a third of the recomputation. The choice depends on
    the global layer id only, so a block is checkpointed or not in every pipeline layout alike.

A checkpointed block keeps its class, its module tree and its parameter names (checkpoints, digests and
MoEvement's operators see the same model): only its ``forward`` is replaced by an instance attribute, as
expert parallelism replaces the MoE's seams. The body runs under ``torch.utils.checkpoint`` (non-reentrant,
``preserve_rng_state=True``: the recomputation draws the same dropout masks); FSDP2's hooks stay around the
block's call, so the recomputation finds the parameters gathered by the backward's pre-hook.

Bit-exactness contract: the recomputation runs the same kernels on the same inputs as the forward did, so
with deterministic kernels every gradient, and the whole training state, is bit for bit that of a run
without checkpointing (tests/test_activation_checkpoint.py compares the state digests). Two more rules
make the recomputation invisible:
  - The MoE's forward side effects (load statistics, the last auxiliary loss, the registration of a layer
    in the model-wide balance loss) happen once per forward: the recomputation runs against scratch copies
    and the MoE's attributes and statistics are put back as the forward left them.
  - The recomputation never stops early (``early_stop=False``): it runs the whole block on
    every rank, so the collectives inside it (the expert-parallel all-to-all, the data-parallel count
    all-reduce) run as often on every rank, whichever gradients a rank needs (frozen operators in a replay).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.moe import MoE

MODES = ("none", "full", "selective")
MARK = "activation_checkpointed"  # the attribute a checkpointed block carries (True)


def checkpointed_layers(layer_ids: list[int], mode: str) -> list[int]:
    """The global layer ids among `layer_ids` that `mode` checkpoints."""
    if mode not in MODES:
        raise ValueError(f"training.activation_checkpoint={mode!r} must be one of {', '.join(MODES)}")
    if mode == "none":
        return []
    return [i for i in layer_ids if mode == "full" or i % 2 == 0]


def apply_activation_checkpoint(part: nn.Module, mode: str) -> list[int]:
    """Checkpoint the blocks of `part` (a model or a pipeline stage: its ``layers``, keyed by global layer
    id) that `mode` selects, in place; returns their layer ids. Apply before FSDP2 and torch.compile."""
    chosen = checkpointed_layers([int(key) for key in part.layers], mode)
    for layer_id in chosen:
        checkpoint_block(part.layers[str(layer_id)])
    return chosen


def is_checkpointed(block: nn.Module) -> bool:
    return getattr(block, MARK, False)


def checkpoint_block(block: nn.Module) -> None:
    """Make `block`'s forward keep only its inputs and recompute its body in backward (see the module doc).

    Without autograd (validation under ``no_grad``) the body runs as it is: nothing to recompute."""
    if is_checkpointed(block):
        raise RuntimeError("checkpoint_block: the block is already checkpointed")
    body = block.forward  # the class's forward, bound to this block
    moes = [m for m in block.modules() if isinstance(m, MoE)]

    def forward(self: nn.Module, *args, **kwargs):
        if not torch.is_grad_enabled():
            return body(*args, **kwargs)
        calls = 0

        def run(*inputs, **kw):
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward itself
                return body(*inputs, **kw)
            with side_effects_undone(moes):  # the recomputation in backward
                return body(*inputs, **kw)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, early_stop=False, **kwargs)

    block.forward = types.MethodType(forward, block)
    setattr(block, MARK, True)


@contextmanager
def side_effects_undone(moes: list[MoE]) -> Iterator[None]:
    """Run a recomputation of `moes`' forwards as if it had not happened: their attributes (the last auxiliary
    loss, the balance-loss index, ...) and buffers (the load statistics) end as they began, and a model-wide
    balance loss (``model_balance``) is replaced by a scratch copy meanwhile, so the original, which the
    forward's autograd nodes hold, is not registered with the layer a second time."""
    kept = []
    for moe in moes:
        kept.append((moe, dict(vars(moe)), [buf.detach().clone() for buf in moe.buffers(recurse=False)]))
        if moe.model_balance is not None:
            moe.model_balance = _scratch_copy(moe.model_balance)
    try:
        yield
    finally:
        with torch.no_grad():
            for moe, attrs, buffers in kept:
                for name in set(vars(moe)) - set(attrs):
                    delattr(moe, name)
                vars(moe).update(attrs)
                for buf, value in zip(moe.buffers(recurse=False), buffers):
                    buf.copy_(value)


def _scratch_copy(obj: object) -> object:
    """A copy of `obj` whose list attributes are copies too (what `ModelBalanceLoss.add` appends to); its
    other attributes are rebound, never changed in place, by an `add`."""
    scratch = copy.copy(obj)
    for name, value in vars(obj).items():
        if isinstance(value, list):
            setattr(scratch, name, list(value))
    return scratch
