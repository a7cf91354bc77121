"""Replay with frozen and active operators (docs/design/replay.md).

Loading `SS_{t0+i}` makes slot i *active*: its FP32 master weights, buffers and optimizer state
are restored and it trains normally. Operators of later slots are *frozen*: they hold the compute
weights of the snapshot (upcast into the FP32 parameter, which the mixed-precision cast maps back
to the identical compute weights), run forward and input-gradient computation only
(`requires_grad=False`, or a frozen slice of a stacked parameter: no weight-gradient product) and
get no optimizer update (no gradient, so AdamW skips them; a frozen slice is kept as it was). Each
replayed iteration applies the *logged* clip coefficient and learning rate, so active operators get
exactly the original update.

`PipelineReplay` re-runs one iteration on a set of pipeline stages (the recovery scope): every
micro-batch forward through the scope's stages in order (GPipe), then every backward in
micro-batch order, which is the order in which the pipeline schedules accumulate gradients.
Inputs at the scope's outer boundaries come from the upstream logs (or the data loader), output
gradients from the downstream logs (or the loss); between scope stages on different ranks the
tensors travel point to point. Forward, backward and gradient reduction go through the stage's
own `PipelineStage` methods, so FSDP2 behaves exactly as under the schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moevement.operators import Operator
from moevement.recovery.fetch import RecoveryError
from moevement.recovery.upstream_log import UpstreamLog
from parallelisms import collectives

MOMENTS = ("exp_avg", "exp_avg_sq")


def set_frozen(ops: list[Operator], frozen: bool, weight_grad: bool = False) -> None:
    """Frozen: no weight gradient is computed or applied for these operators' tensors (`weight_grad`: it is
    computed all the same, and dropped before the optimizer step by `frozen_slices_kept`)."""
    for op in ops:
        op.frozen = frozen
        for ref in op.params.values():
            ref.set_frozen(frozen and not weight_grad)


@contextmanager
def frozen_slices_kept(ops: list[Operator], optimizer):
    """Around an optimizer step: frozen operators end it as they began it.

    AdamW updates a parameter whole; a frozen slice has a zero gradient, but momentum and weight decay
    would still move its weights and moments. A frozen plain parameter has no gradient (or one computed
    under `set_frozen(..., weight_grad=True)`, dropped here), so AdamW skips it.
    """
    kept = []
    for op in ops:
        if not op.frozen:
            continue
        for ref in op.params.values():
            if ref.index is None:
                ref.param.grad = None
            else:
                state = optimizer.state.get(ref.param, {})
                tensors = [ref.local()] + [ref.part_of(v) for k, v in state.items() if k in MOMENTS]
                kept += [(t, t.clone()) for t in tensors]
    yield
    with torch.no_grad():
        for tensor, value in kept:
            tensor.copy_(value)


@torch.no_grad()
def load_master(op: Operator, tensors: dict[tuple[str, str], torch.Tensor], optimizer) -> None:
    """Restore an operator's FP32 weights, buffers and optimizer state from snapshot entries."""
    for name, ref in op.params.items():
        ref.local().copy_(tensors[("master", name)])
        state = optimizer.state[ref.param]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            value = tensors.get(("master", f"optim.{name}.{key}"))
            if value is None:  # taken before the first step: no operator had optimizer state then
                state.pop(key, None)
                continue
            if key not in state:
                state[key] = torch.zeros((), dtype=value.dtype) if key == "step" else torch.zeros_like(ref.param)
            ref.part_of(state[key]).copy_(value)
    for name, b in op.buffers.items():
        b.copy_(tensors[("master", name)])


@torch.no_grad()
def load_compute(op: Operator, tensors: dict[tuple[str, str], torch.Tensor]) -> None:
    """Give a frozen operator the snapshot's compute weights (and buffers)."""
    for name, ref in op.params.items():
        ref.local().copy_(tensors[("compute", name)])
    for name, b in op.buffers.items():
        b.copy_(tensors[("compute", name)])


@torch.no_grad()
def wipe_operators(ops: list[Operator], optimizer) -> None:
    """A failed rank's memory is gone: overwrite its weights and optimizer state with NaN."""
    for op in ops:
        for ref in op.params.values():
            ref.local().fill_(float("nan"))
            for value in optimizer.state.get(ref.param, {}).values():
                if isinstance(value, torch.Tensor):
                    ref.part_of(value).fill_(float("nan"))
        for b in op.buffers.values():
            b.fill_(float("nan")) if b.is_floating_point() else b.zero_()


@torch.no_grad()
def reset_to_initial(ops: list[Operator], optimizer, initial: dict[str, torch.Tensor]) -> None:
    """Return operators to the seed's initial state (`initial`: full tensor by global name), optimizer state
    cleared. `ops` holds every slice of any stacked parameter it touches (a rank's operators do)."""
    for op in ops:
        for name, ref in op.params.items():
            full, p = initial[name], ref.param
            if isinstance(p, DTensor):
                placements = p.placements if ref.index is None else _slice_placements(p.placements)
                full = distribute_tensor(full, p.device_mesh, placements, src_data_rank=None).to_local()
            ref.local().copy_(full)
            optimizer.state.pop(p, None)


def _slice_placements(placements):
    """The placements of one dim-0 slice of a DTensor sharded along a later dimension."""
    if any(isinstance(pl, Shard) and pl.dim == 0 for pl in placements):
        raise ValueError("a stacked parameter must not be sharded along its stacking dimension")
    return tuple(Shard(pl.dim - 1) if isinstance(pl, Shard) else pl for pl in placements)


@dataclass
class StageRef:
    """One pipeline stage this rank runs: its module, its `PipelineStage`, example boundary tensors."""

    module: torch.nn.Module
    stage: object  # torch.distributed.pipelining.PipelineStage
    input_meta: torch.Tensor  # what the stage receives (tokens on stage 0)
    output_meta: torch.Tensor  # what it sends downstream (logits on the last stage)


class PipelineReplay:
    """Re-run iterations of this rank's stages inside a recovery scope (see the module docstring)."""

    def __init__(
        self,
        stages: dict[int, StageRef],
        n_stages: int,
        micro_batches: int,
        owner_rank: Callable[[int], int],
        log: UpstreamLog,
        loss_fn: Callable,
        device: torch.device,
    ):
        self.stages, self.n_stages, self.micro = stages, n_stages, micro_batches
        self.owner_rank = owner_rank  # rank holding stage s in this rank's data-parallel slice
        self.log, self.loss_fn, self.device = log, loss_fn, device
        self.me = dist.get_rank()

    def forward_backward(
        self,
        iteration: int,
        scope: set[int],
        inputs: torch.Tensor,
        labels: torch.Tensor,
        boundary: Mapping[tuple[str, int, int, int], torch.Tensor],
    ) -> dict[str, float]:
        """Accumulate this rank's gradients of `iteration` for its stages in `scope`, reduced and scaled;
        returns the seconds of its forward, backward and gradient-reduction phases.

        `boundary[(kind, iteration, stage, micro)]` is the logged "act" of stage-1 or "grad" of
        stage+1 for stages whose neighbour is outside the scope.
        """
        started = time.perf_counter()
        local = sorted(s for s in self.stages if s in scope)
        xs, ys = inputs.to(self.device).chunk(self.micro), labels.to(self.device).chunk(self.micro)
        traffic = _Traffic(iteration, scope, xs, boundary)
        cache = self._forward(local, ys, traffic)
        seconds = {"forward": time.perf_counter() - started, "backward": 0.0, "reduce": 0.0}
        for s in reversed(local):
            started = time.perf_counter()
            self._backward(s, cache, traffic)
            reduced = time.perf_counter()
            self.stages[s].stage.perform_reduce_grad(self.micro)
            seconds["backward"] += reduced - started
            seconds["reduce"] += time.perf_counter() - reduced
        for work in traffic.pending:
            collectives.wait(work)
        return seconds

    def _forward(self, local: list[int], labels: tuple[torch.Tensor, ...], traffic: _Traffic) -> dict:
        """Every micro-batch forward through the `local` stages in order (GPipe); returns {(stage, micro):
        (its output, or the loss on the last stage; its input)} for the backward."""
        cache = {}
        for s in local:
            ref = self.stages[s]
            for m in range(self.micro):
                x = self._incoming(traffic, "act", s - 1, s, m)
                out = ref.module(x)
                if s == self.n_stages - 1:
                    out = self.loss_fn(out, labels[m])
                else:
                    self._outgoing(traffic, "act", s, s + 1, m, out.detach())
                cache[(s, m)] = (out, x)
        return cache

    def _backward(self, s: int, cache: dict, traffic: _Traffic) -> None:
        """Every micro-batch's backward through stage `s` in micro-batch order (taking its `_forward` entries
        from `cache`); the input gradients go upstream (zeros where nothing upstream needs a gradient)."""
        ref = self.stages[s]
        for m in range(self.micro):
            out, x = cache.pop((s, m))
            grad = None if s == self.n_stages - 1 else self._incoming(traffic, "grad", s + 1, s, m)
            grad_in = _input_gradient(ref, out, x, grad)
            if s > 0:
                self._outgoing(traffic, "grad", s, s - 1, m, torch.zeros_like(x) if grad_in is None else grad_in)

    def _incoming(self, traffic: _Traffic, kind: str, src_stage: int, stage: int, micro: int) -> torch.Tensor:
        """Stage `stage`'s input activation (kind act) or output gradient (kind grad) for `micro`: the data,
        a logged boundary tensor, a hand-off from this rank's own stage, or received from its owner."""
        if kind == "act" and stage == 0:
            return traffic.inputs[micro]
        if src_stage not in traffic.scope:
            key = (kind, traffic.iteration, src_stage, micro)
            if key not in traffic.boundary:
                raise RecoveryError(
                    f"no upstream log holds the {kind} of stage {src_stage}, iteration {traffic.iteration}"
                )
            tensor = traffic.boundary[key].to(self.device)
        elif (kind, src_stage, micro) in traffic.handoff:
            tensor = traffic.handoff.pop((kind, src_stage, micro))
        else:
            ref = self.stages[stage]
            meta = ref.input_meta if kind == "act" else ref.output_meta
            tensor = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            collectives.recv(tensor, self.owner_rank(src_stage), tag=_tag(kind, src_stage))
        return tensor.detach().requires_grad_(kind == "act")

    def _outgoing(
        self, traffic: _Traffic, kind: str, stage: int, dst_stage: int, micro: int, tensor: torch.Tensor
    ) -> None:
        """Pass `tensor` to stage `dst_stage` if it replays: handed off on this rank, or sent (in flight
        until the end of `forward_backward`)."""
        if dst_stage not in traffic.scope:
            return  # the neighbour is healthy and already has it
        if dst_stage in self.stages:
            traffic.handoff[(kind, stage, micro)] = tensor
            return
        work = collectives.isend(tensor.detach().contiguous(), self.owner_rank(dst_stage), tag=_tag(kind, stage))
        traffic.pending.append(work)


@dataclass
class _Traffic:
    """The tensors of one `PipelineReplay.forward_backward` call that cross stage boundaries."""

    iteration: int
    scope: set[int]
    inputs: tuple[torch.Tensor, ...]  # the data's micro-batches (stage 0's input)
    boundary: Mapping[tuple[str, int, int, int], torch.Tensor]  # logged by the healthy neighbours
    handoff: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # between this rank's stages
    pending: list = field(default_factory=list)  # sends in flight


def _input_gradient(
    ref: StageRef, out: torch.Tensor, x: torch.Tensor, grad: torch.Tensor | None
) -> torch.Tensor | None:
    """One micro-batch's backward through stage `ref` (`grad`: the output gradient; None on the last stage,
    whose `out` is the loss); returns the gradient of its input `x`, or None when no gradient flows (every
    operator up to here is frozen and the input is data)."""
    if not out.requires_grad:
        return None
    arguments = {
        "stage_output": out if grad is None else (out,),
        "output_grads": None if grad is None else (grad,),
        "input_values": [x],
    }
    grads, _ = ref.stage.backward_maybe_with_nosync("full", arguments)
    return grads[0]


def _tag(kind: str, stage: int) -> int:
    return 2 * stage + (kind == "grad")
