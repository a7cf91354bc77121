"""Expert parallelism for ``models.moe.MoE``: shard the routed experts over an ep group, all-to-all the tokens.

Only two seams of ``MoE`` are replaced (instance attributes, the class is untouched):
``global_load`` (one all-reduce of the per-expert counts and gate-probability sums over the data-parallel
group, for the load statistics and the aux loss) and ``experts_forward`` (all-to-all dispatch -> local
experts -> all-to-all back). Routing, permutation and combination stay local and in the global expert id space.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from models.experts import WEIGHTS, GroupedExperts
from models.moe import MoE
from parallelisms import collectives


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def apply_expert_parallel(model: nn.Module, ep_group: ProcessGroup | None, dp_group: ProcessGroup | None) -> None:
    """Make every ``MoE`` in ``model`` (possibly a pipeline stage, possibly on meta) expert/data parallel, in place.

    - dp_group of size dp > 1: ``global_load`` returns the counts and gate-probability sums summed over dp_group,
      and dp, so ``tokens_per_expert`` and ``gate_prob_sum`` are dp-global (every replica orders the experts
      alike) and the aux loss is the dp-global one (see ``MoE.training_side_effects``).
      Every dp rank must feed the same number of tokens per micro-batch.
    - ep_group of size ep > 1: ep rank r keeps the experts with global ids [r*E/ep, (r+1)*E/ep) (stacked
      weights of E/ep experts; each keeps its global id in checkpoints) and ``experts_forward`` becomes an
      all-to-all dispatch.
      Every ep rank must call the MoE forward/backward the same number of times (collectives inside).

    Gradient contract (ep ranks each hold their own experts): an expert's gradient sums the contributions of
    the tokens of every rank of its ep group. If each rank's loss is a mean over its local tokens and the
    replicated parameters are averaged over dp, expert gradients must be divided by dp overall (e.g. FSDP over
    the dp/ep replica group with ``set_gradient_divide_factor(dp)``; with ep == dp: just divide by dp).

    Experts this rank's own already (`shard_moe_experts`, called before the group existed) are kept as they are.
    """
    ep, dp = _size(ep_group), _size(dp_group)
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        if dp > 1:
            moe.global_load = types.MethodType(_dp_global_load(dp_group, dp), moe)
        if ep > 1:
            ep_rank = dist.get_rank(ep_group)
            own = local_expert_ids(moe.n_experts, ep_rank, ep)
            if (moe.experts.first_id, moe.experts.n) != (own.start, len(own)):
                shard_experts(moe, ep_rank, ep)  # raises for experts sharded for another rank
            moe.experts_forward = types.MethodType(_ep_experts_forward(ep_group, ep), moe)


def shard_moe_experts(model: nn.Module, ep_rank: int, ep_size: int) -> None:
    """Keep only expert-parallel rank `ep_rank`'s routed experts in every ``MoE`` of `model` (`shard_experts`);
    `apply_expert_parallel` later binds the group and keeps them."""
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        shard_experts(moe, ep_rank, ep_size)


def local_expert_ids(n_experts: int, ep_rank: int, ep_size: int) -> range:
    """Global ids of the routed experts owned by ``ep_rank`` (a contiguous block of E/ep)."""
    if n_experts % ep_size:
        raise ValueError(f"n_routed_experts={n_experts} must be divisible by the expert-parallel size {ep_size}")
    per_rank = n_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def shard_experts(moe: MoE, ep_rank: int, ep_size: int) -> None:
    """Keep the stacked weights of ep rank `ep_rank`'s experts only (on meta: their shapes)."""
    if moe.experts.n != moe.n_experts:
        raise RuntimeError("apply_expert_parallel: the MoE experts are already sharded")
    local, every = local_expert_ids(moe.n_experts, ep_rank, ep_size), moe.experts
    _, hidden, dim = every.w1.shape
    with torch.device(every.w1.device):
        moe.experts = GroupedExperts(len(local), dim, hidden, first_id=local.start)
    if every.w1.device.type != "meta":  # a materialised model keeps its weights
        with torch.no_grad():
            for w in WEIGHTS:
                getattr(moe.experts, w).copy_(getattr(every, w)[local.start : local.stop])


GATE_SUM_UNIT = 2.0**-24  # gate-probability sums cross the data-parallel group as integers of this unit


def _dp_global_load(dp_group: ProcessGroup, dp: int):
    def global_load(self: MoE, counts: torch.Tensor, gate_sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(counts [E] and gate_sums [E] summed over the data-parallel group, dp), in one all-reduce of int64: the
        gate sums in fixed point (`GATE_SUM_UNIT`), whose sum is exact in any order, so every replica gets the
        same bits. Not differentiable."""
        with torch.no_grad():
            fixed = torch.round(gate_sums.detach().double() / GATE_SUM_UNIT).to(torch.int64)
            total = torch.cat([counts.detach().to(torch.int64), fixed])
            collectives.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
        n = counts.numel()
        return total[:n], (total[n:].double() * GATE_SUM_UNIT).to(gate_sums.dtype), dp

    return global_load


def _all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Differentiable all-to-all of rows with uneven splits (backward: the reverse all-to-all).

    Under grad mode the input always requires grad, so every ep rank runs the backward all-to-all:
    with frozen operators (MoEvement replay) one rank's experts may need no gradient while a peer's do.
    """
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()
    return collectives.all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)


def _ep_experts_forward(ep_group: ProcessGroup, ep: int):
    def experts_forward(self: MoE, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: local token copies grouped by global expert id, ``counts`` [E] (local kept counts) -> outputs, same order.

        1. all-to-all the counts: recv[s, e] = rows source rank s sends to local expert e;
        2. all-to-all the rows, uneven splits (no capacity padding); they arrive as [src][local expert];
        3. regroup to [local expert][src], ``run_experts``, undo the regrouping;
        4. all-to-all the outputs back with the reversed splits.
        """
        n_local = self.n_experts // ep
        send = counts.to(torch.int64).reshape(ep, n_local)
        recv = torch.empty_like(send)
        collectives.all_to_all_single(recv, send, group=ep_group)
        sizes = torch.cat([send.sum(1), recv.sum(1)]).tolist()  # the splits: one device -> host sync
        input_splits, output_splits = sizes[:ep], sizes[ep:]
        received = _all_to_all(x, output_splits, input_splits, ep_group)
        # Row i of ``received`` belongs to chunk (src, e) = divmod(chunk_id, n_local); stable sort by e.
        chunk_id = torch.repeat_interleave(
            torch.arange(ep * n_local, device=x.device), recv.flatten(), output_size=received.shape[0]
        )
        order = (chunk_id % n_local).argsort(stable=True)
        expert_out = self.run_experts(received.index_select(0, order), recv.sum(0))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return _all_to_all(expert_out.index_select(0, inverse), input_splits, output_splits, ep_group)

    return experts_forward
