"""How many micro-batches' activations a pipeline rank holds at once, under the configured schedule.

A micro-batch's activations live from its forward on a stage to its backward there. Without pipelining
(`parallelism.pp` = 1) `trainer.step.forward_backward` runs each micro-batch's forward and backward in
turn: one is alive. With `torch.distributed.pipelining` (`parallelisms.pipeline`):

- GPipe: every forward before any backward: all `training.micro_batches` are alive.
- 1F1B: stage s runs min(m, n_stages - s) warm-up forwards, then one backward before each further
  forward (`Schedule1F1B`): min(m, pp - s) are alive.
- Interleaved1F1B: the rank's action list as `ScheduleInterleaved1F1B` builds it (torch's own
  `_get_1f1b_rank_ops`, which puts each step's forward before its backward), walked forward; the peak
  weighs each local stage's micro-batch by its own bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallelisms.mesh import ParallelismConfig


@dataclass
class AlivePeak:
    """The largest sum of live micro-batch activations on one rank, and how it came about."""

    nbytes: int
    micro_batches: int  # micro-batches alive at that moment (over all local stages)
    why: str


def peak_alive(p: ParallelismConfig, micro_batches: int, pp_rank: int, per_stage: dict[int, int]) -> AlivePeak:
    """Peak live activation bytes of pipeline rank `pp_rank` whose local stage s keeps `per_stage[s]` bytes
    per micro-batch."""
    m = micro_batches
    if p.pp == 1:
        return AlivePeak(sum(per_stage.values()), 1, "pp=1: one micro-batch's forward and backward at a time")
    if p.schedule == "GPipe":
        return AlivePeak(m * sum(per_stage.values()), m, "GPipe: every micro-batch")
    if p.schedule == "1F1B":
        (stage,) = per_stage
        alive = min(m, p.pp * p.stages_per_rank - stage)
        return AlivePeak(alive * per_stage[stage], alive, f"1F1B: min(micro_batches, pp - stage {stage})")
    return _interleaved(p, m, pp_rank, per_stage)


def _interleaved(p: ParallelismConfig, m: int, rank: int, per_stage: dict[int, int]) -> AlivePeak:
    """Walk `ScheduleInterleaved1F1B`'s action list of `rank` (the same construction, torch's helpers)."""
    from torch.distributed.pipelining.schedules import _ComputationType, _get_1f1b_rank_ops, _get_warmup_ops

    n_local, rounds = p.stages_per_rank, max(1, m // p.pp)
    per_round = m // rounds
    warmup = _get_warmup_ops(rank, n_local, per_round, p.pp, m, multiply_factor=2)
    fwd_bwd = n_local * m - warmup

    def forward_stage(step: int) -> int:
        return (step // per_round) % n_local * p.pp + rank

    def backward_stage(step: int) -> int:
        return (n_local - 1 - ((step - warmup) // per_round) % n_local) * p.pp + rank

    ops = _get_1f1b_rank_ops(n_local, p.pp, warmup, fwd_bwd, warmup, rank, forward_stage, backward_stage)
    live = count = best = best_count = 0
    for op in ops:
        if op is None:
            continue
        sign = 1 if op.computation_type == _ComputationType.FORWARD else -1
        live += sign * per_stage[op.stage_index]
        count += sign
        if live > best:
            best, best_count = live, count
    why = f"Interleaved1F1B: {warmup} warm-up forwards, each later forward before its backward"
    return AlivePeak(best, best_count, why)
