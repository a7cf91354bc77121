"""The cluster of a scale study and its iteration time (the paper's Appendix C iteration model).

A cluster is `pp` stages x `pipelines` pipelines x `ep` GPUs: a pipeline is `ep` GPUs wide, its
stage one expert-parallel group, whose GPUs each run their own micro-batches (DeepSpeed-MoE
style: data parallel for non-expert operators over `dp = pipelines * ep` GPUs, routed experts
sharded over `ep` and replicated over `pipelines`).

Iteration, 1F1B: T = (M + S - 1) max_s t_s + T_sync + T_update, every stage costing what the
bottleneck stage (ceil(layers / pp) layers) costs. t_s = t_f + t_b: t_f = forward FLOPs / (peak
MFU) + 2 all-to-alls (dispatch, combine) per MoE layer, over NVLink when `ep` fits in a node,
else the NIC; t_b = 2x that compute + 2 all-to-alls. T_sync = reduce-scatter + all-gather of bf16
gradients over the data-parallel groups (non-expert: dp, experts: pipelines). T_update = Adam
over the GPU's parameters at HBM speed. A collective costs alpha + bytes / bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

FP32_STATE_BYTES = 12  # FP32 master weights + Adam m, v per parameter
COMPUTE_BYTES = GRAD_BYTES = ACT_BYTES = 2  # bf16
UPDATE_BYTES = 28  # Adam step: read bf16 grad + 12 B of state, write 12 B of state + bf16 weights
GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """DeepSeek-MoE-style transformer: MoE layers of shared + routed SwiGLU experts (3*h*f params)."""

    layers: int
    dense_layers: int
    hidden: int
    dense_ffn: int
    experts: int
    shared_experts: int
    top_k: int
    expert_ffn: int
    vocab: int
    attn_params: int = 0  # per layer; 0 means 4 * hidden^2 (multi-head attention)

    @property
    def attn(self) -> int:
        return self.attn_params or 4 * self.hidden**2

    @property
    def expert(self) -> int:
        return 3 * self.hidden * self.expert_ffn

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def total_params(self) -> int:
        moe = (self.experts + self.shared_experts) * self.expert + self.hidden * self.experts
        return (
            self.layers * self.attn
            + self.dense_layers * 3 * self.hidden * self.dense_ffn
            + self.moe_layers * moe
            + 2 * self.vocab * self.hidden
        )


@dataclass(frozen=True)
class Hardware:
    """Per-GPU rates (bytes/s, FLOP/s) of the iteration model; `simulator.scale` puts the testbed's A100 node here."""

    peak_flops: float = 989e12  # H100/H800 dense BF16
    mfu: float = 0.35
    hbm_bw: float = 3.35e12  # H100/H800 SXM HBM3
    a2a_alpha_s: float = 30e-6
    a2a_bw: float = 40 * GB  # 400 Gb/s InfiniBand per GPU, ~80% achieved
    nvlink_bw: float = 150 * GB  # all-to-all inside one node (ep <= gpus_per_node)
    gpus_per_node: int = 8
    dp_alpha_s: float = 50e-6
    dp_bw: float = 40 * GB


@dataclass(frozen=True)
class ClusterShape:
    """`pp` stages x `pipelines` x `ep` GPUs; each GPU runs `micro_batches` micro-batches an iteration."""

    pp: int
    pipelines: int
    ep: int
    micro_batches: int
    micro_batch_seqs: int = 1
    seq_len: int = 4096

    @property
    def dp(self) -> int:
        """Data-parallel degree of the non-expert operators."""
        return self.pipelines * self.ep

    @property
    def gpus(self) -> int:
        return self.pp * self.dp

    @property
    def batch_seqs(self) -> int:
        """Global batch in sequences."""
        return self.dp * self.micro_batches * self.micro_batch_seqs


@dataclass(frozen=True)
class Preset:
    """A model on a cluster."""

    name: str
    model: ModelShape
    layout: ClusterShape
    hw: Hardware = field(default_factory=Hardware)


def collective_s(alpha_s: float, nbytes: float, bandwidth: float) -> float:
    """Affine cost of one collective: alpha + bytes / bandwidth."""
    return alpha_s + nbytes / bandwidth


def pipeline_s(stage_s: Sequence[float], micro_batches: int) -> float:
    """1F1B makespan: fill/drain through every stage + (M - 1) steady steps of the slowest stage.

    `stage_s[i]` is stage i's forward + backward time for one micro-batch; equal stages give
    (M + S - 1) * t.
    """
    return sum(stage_s) + (micro_batches - 1) * max(stage_s)


@dataclass(frozen=True)
class StageModel:
    """One GPU of the bottleneck stage: its operators and per-micro-batch costs (seconds)."""

    operators: tuple[int, ...]  # parameter counts in schedule order: routed experts, then the rest
    expert_params: int
    nonexpert_params: int
    compute_s: float  # forward + backward FLOP time of one micro-batch
    t_f: float  # forward incl. all-to-all
    t_b: float  # backward incl. all-to-all
    dp_s: float  # T_sync: gradient reduce-scatter + all-gather per iteration
    update_s: float  # T_update: the optimizer step
    nic_s: float  # seconds per iteration the NIC carries training traffic
    stages: int
    micro_batches: int

    @property
    def params(self) -> int:
        return self.expert_params + self.nonexpert_params

    @property
    def iteration_s(self) -> float:
        return pipeline_s([self.t_f + self.t_b] * self.stages, self.micro_batches) + self.dp_s + self.update_s


def stage_model(preset: Preset) -> StageModel:
    """Bottleneck-stage operators and times from the preset's model shape, layout and hardware."""
    m, lay, hw = preset.model, preset.layout, preset.hw
    n_layers = math.ceil(m.layers / lay.pp)
    n_moe = min(n_layers, math.ceil(m.moe_layers / lay.pp))
    n_dense = n_layers - n_moe
    experts = [m.expert] * (n_moe * math.ceil(m.experts / lay.ep))
    others = [m.attn] * n_layers + [3 * m.hidden * m.dense_ffn] * n_dense
    others += [m.hidden * m.experts] * n_moe + [m.expert] * (n_moe * m.shared_experts)
    tokens = lay.micro_batch_seqs * lay.seq_len
    active = (
        n_layers * m.attn
        + n_dense * 3 * m.hidden * m.dense_ffn
        + n_moe * ((m.top_k + m.shared_experts) * m.expert + m.hidden * m.experts)
    )
    attn_scores = 2 * lay.seq_len * m.hidden * n_layers  # causal QK^T + AV, per token
    fwd_compute = (2 * active + attn_scores) * tokens / (hw.peak_flops * hw.mfu)
    a2a_bytes = tokens * m.top_k * m.hidden * ACT_BYTES * (lay.ep - 1) / lay.ep
    a2a_bw = hw.nvlink_bw if lay.ep <= hw.gpus_per_node else hw.a2a_bw
    a2a = 2 * n_moe * collective_s(hw.a2a_alpha_s, a2a_bytes, a2a_bw)  # dispatch + combine
    dp_s = 0.0
    for group, params in ((lay.dp, sum(others)), (lay.pipelines, sum(experts))):
        if group > 1:
            dp_s += 2 * collective_s(hw.dp_alpha_s, (group - 1) / group * params * GRAD_BYTES, hw.dp_bw)
    nic_s = dp_s + (0.0 if lay.ep <= hw.gpus_per_node else 2 * a2a * lay.micro_batches)
    params = sum(experts) + sum(others)
    return StageModel(
        operators=tuple(experts + others),
        expert_params=sum(experts),
        nonexpert_params=sum(others),
        compute_s=3 * fwd_compute,
        t_f=fwd_compute + a2a,
        t_b=2 * fwd_compute + a2a,
        dp_s=dp_s,
        update_s=UPDATE_BYTES * params / hw.hbm_bw,
        nic_s=nic_s,
        stages=lay.pp,
        micro_batches=lay.micro_batches,
    )
