"""Per-rank accelerator memory of a config and launch layout, for `train.py --dry-run` (no process group,
nothing allocated: the meta device and arithmetic).

A rank's peak is its state plus the larger of its two phases (upper-bound bookkeeping of what is alive
together, not an allocator simulation: fragmentation and the caching allocator's reserve come on top):

- state, all iteration long: FP32 parameters and AdamW moments, buffers (`training_state_bytes`), and
  MoEvement's device memory (`moevement_device_bytes`).
- forward/backward: the compute weights FSDP gathers (pp > 1: the whole stage, which the pipeline keeps
  gathered after its first backward, `set_reshard_after_backward(False)`; else the root's weights, kept
  from forward to backward, and two blocks: the one running and the one prefetched), the gradients held
  across micro-batches (FSDP without gradient sync, pp > 1 or several micro-batches: FP32 unsharded
  gradients, `reduce_dtype`; plain tensors: the gradients themselves; else one block's unsharded gradient
  in flight), the activations of the micro-batches alive at once (`activation_estimate` x
  `pipeline_peak`), and a working set: one block's saved bytes (its activations' gradients in flight),
  what recomputing a checkpointed block adds (`StageActivations.recompute`), and the last stage's loss
  chunk.
- optimizer step: the reduced FP32 gradients and the FP32 temporary of foreach AdamW (sqrt of the
  second moment, one per local element).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models import Transformer
from moevement.checkpoint.profiler import PROBE_BYTES
from moevement.operators import build_registry
from moevement.storage.device_copy import ring_bytes
from parallelisms.fsdp import DTYPES
from trainer.config import Config
from trainer.estimates import host_estimate
from trainer.estimates.activation_estimate import MODES, StageActivations, micro_batch_shape, stage_modules, trace_stage
from trainer.estimates.pipeline_peak import AlivePeak, peak_alive
from trainer.estimates.training_state_bytes import FP32, StateBytes, rank_parts, rank_state
from trainer.model_operators import stacked_operators


@dataclass
class RankMemory:
    """One rank's accelerator bytes by what holds them (see the module docstring)."""

    rank: int
    pp_rank: int
    state: StateBytes
    gathered: int  # compute weights gathered by FSDP
    accumulated: int  # gradients held across micro-batches
    alive: dict[str, AlivePeak]  # mode -> live activations at their peak
    working: dict[str, int]  # mode -> backward working set
    moevement: int

    @property
    def step_phase(self) -> int:
        return self.state.grads + self.state.moments // 2

    def peak(self, mode: str) -> int:
        """Peak bytes with `training.activation_checkpoint = mode`."""
        s = self.state
        train = self.gathered + self.accumulated + self.alive[mode].nbytes + self.working[mode]
        return s.params + s.moments + s.buffers + self.moevement + max(train, self.step_phase)


def gathered_bytes(cfg: Config, state: StateBytes) -> int:
    """Compute weights FSDP holds gathered at once (0 without FSDP)."""
    if not state.fsdp:
        return 0
    itemsize = DTYPES[cfg.training.mixed_precision].itemsize
    whole_stage = cfg.parallelism.pp > 1
    return (state.unsharded if whole_stage else state.root + 2 * state.largest_block) * itemsize


def accumulated_bytes(cfg: Config, state: StateBytes) -> int:
    """Gradients held across micro-batches (or one block's in flight, when each backward reduces)."""
    accumulating = cfg.parallelism.pp > 1 or cfg.training.micro_batches > 1
    if not state.fsdp:
        return state.grads if accumulating else 0
    if accumulating:
        return state.unsharded * FP32
    return state.largest_block * (DTYPES[cfg.training.mixed_precision].itemsize + FP32)


def moevement_device_bytes(cfg: Config, pp_rank: int) -> int:
    """MoEvement's accelerator memory: the staging ring snapshots gather their chunks in before one
    device-to-host copy each, with the checksum's transient (`moevement.storage.device_copy.ring_bytes`: its
    slots hold `checkpoint.chunk_mb`, or the largest FP32 entry where that is larger; one transient more under
    `checkpoint.copy_graph`), and the copy-bandwidth probe's FP32 source (`PROBE_BYTES`, at start-up and
    re-profiling), which the caching allocator keeps."""
    if cfg.checkpoint.strategy != "moevement":
        return 0
    model, _ = host_estimate.rank_model(cfg, pp_rank)  # data-parallel rank 0's shards, the largest
    ops = build_registry(model, stacked_operators(model))
    largest = max(t.numel() for op in ops for _, t in op.compute_tensors() if t.is_floating_point())
    return ring_bytes(largest * FP32, cfg.checkpoint.copy_graph, cfg.checkpoint.chunk_bytes) + PROBE_BYTES


def estimate(cfg: Config) -> list[RankMemory]:
    """Every rank's accelerator memory under `cfg` (world rank = pp_rank * dp + dp_rank)."""
    p, t = cfg.parallelism, cfg.training
    with torch.device("meta"):
        whole = Transformer(cfg.model)
    out = []
    for pp_rank in range(p.pp):
        stage_ids, modules = stage_modules(cfg, pp_rank, whole)
        traces = [trace_stage(cfg, s, m) for s, m in zip(stage_ids, modules)]
        parts = rank_parts(cfg, pp_rank, whole)
        device_moevement = moevement_device_bytes(cfg, pp_rank)
        alive = {m: peak_alive(p, t.micro_batches, pp_rank, {a.stage: a.saved[m] for a in traces}) for m in MODES}
        working = {m: _working(traces, m) for m in MODES}
        for dp_rank in range(p.dp):
            rank = pp_rank * p.dp + dp_rank
            state = rank_state(cfg, rank, parts)
            gathered, accumulated = gathered_bytes(cfg, state), accumulated_bytes(cfg, state)
            out.append(RankMemory(rank, pp_rank, state, gathered, accumulated, alive, working, device_moevement))
    return out


def _working(traces: list[StageActivations], mode: str) -> int:
    """Backward's working set on a rank: one block's activation gradients, one recomputed block, the loss."""
    return (
        max(a.largest_block for a in traces)
        + max(a.recompute[mode] for a in traces)
        + max(a.loss_transient for a in traces)
    )


def configured_mode(cfg: Config) -> str:
    """`training.activation_checkpoint` (none where the config has no such key)."""
    return getattr(cfg.training, "activation_checkpoint", "none")


def describe(cfg: Config) -> str:
    """The header line's layout and assumptions."""
    p, t = cfg.parallelism, cfg.training
    b, s = micro_batch_shape(cfg)
    weights = "bf16 compute weights over FP32 master weights" if t.mixed_precision == "bf16" else "FP32 weights"
    world, per_node = p.pp * p.dp, host_estimate.RANKS_PER_NODE
    return (
        f"pp={p.pp} dp={p.dp} ep={p.ep}: {world} ranks, {-(-world // per_node)} node(s) of {per_node} ranks "
        "(assumed: no config key names ranks per node); "
        f"schedule={p.schedule if p.pp > 1 else 'none (pp=1)'} "
        f"micro-batch {b}x{s} of {t.micro_batches}; {weights}, FP32 gradients and AdamW moments; "
        f"activation_checkpoint={configured_mode(cfg)}; eager CUDA kernels (flash attention, fused RMSNorm)"
    )
