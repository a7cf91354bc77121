"""What every strategy's mechanism needs to know about one run: a `Setting`.

A setting is one node's view of a cluster in which one stage of one pipeline is one node (8-way
expert parallelism = the node): the bytes of FP32 state the node holds, the operators of one of its
GPUs in Algorithm 1's order (routed experts, then the rest), the bytes the node's NIC carries for
training each iteration, and the iteration time. Built from a Table 2 testbed (`from_testbed`) or
from a scale-study preset (`simulator.scale`).

Training traffic on the node's NIC per iteration (the bottleneck stage): pipeline sends, M
micro-batches of activations forward and of gradients backward, each 32 x 2048 tokens x hidden x
2 bytes (a middle stage sends both, an end stage one, a single stage none); the data-parallel
gradient exchange over DP pipelines, 2 (DP - 1) / DP x the stage's parameters x 2 bytes (reduced
inside the node over NVLink first). The upstream log copies each GPU's share of the pipeline sends
to host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.testbed import (
    ACT_BYTES,
    BLOB_BW,
    COMPUTE_BYTES,
    FP32_STATE_BYTES,
    GPUS_PER_NODE,
    MICRO_BATCH_SEQS,
    NODE_NIC_BW,
    PCIE_BW,
    SEQ_LEN,
    Testbed,
)


@dataclass(frozen=True)
class Operator:
    """One operator a GPU snapshots: FP32 state and compute-weight bytes, and its FLOP weight.

    `expert` is (MoE layer on the stage, expert index) for a routed expert, None otherwise; a routed
    expert's `flops` is its FLOPs at uniform popularity (scaled by E x its token share under skew)."""

    fp32: float
    compute: float
    flops: float
    expert: tuple[int, int] | None = None


@dataclass(frozen=True)
class Setting:
    name: str
    iteration_s: float
    gpus: int
    stages: int
    micro_batches: int
    experts: int  # routed experts per MoE layer
    node_state_bytes: float  # FP32 state the bottleneck node checkpoints
    cluster_state_bytes: float  # FP32 state of the whole model (what a persist writes)
    expert_state_share: float  # of which routed experts
    operators: tuple[Operator, ...]  # one GPU's, routed experts first
    nic_train_bytes: float  # what the node's NIC sends for training per iteration
    log_bytes_gpu: float  # what one GPU's upstream log copies to host per iteration
    moc_start_overhead: float | None = None  # MoC's overhead at its first K (a testbed input); None: derived
    pcie_bw: float = PCIE_BW  # bytes/s, one GPU to host memory
    node_nic_bw: float = NODE_NIC_BW  # bytes/s, one node's line rate, shared by its GPUs
    blob_bw: float = BLOB_BW  # bytes/s, the whole cluster to persistent storage
    snapshot_cap_bw: float = math.inf  # bytes/s per GPU: a cap on snapshot copies while training runs

    @property
    def nodes(self) -> int:
        return self.gpus // GPUS_PER_NODE


def pipeline_send_bytes(stages: int, micro_batches: int, hidden: int, micro_batch_tokens: int) -> float:
    """Bytes the bottleneck stage's node sends to its pipeline neighbours per iteration."""
    directions = 0 if stages == 1 else (1 if stages == 2 else 2)
    return directions * micro_batches * micro_batch_tokens * hidden * ACT_BYTES


def gradient_exchange_bytes(dp: int, stage_params: float) -> float:
    """Ring all-reduce (or reduce-scatter + all-gather) of a stage's bf16 gradients over dp nodes."""
    return 2 * (dp - 1) / dp * stage_params * COMPUTE_BYTES if dp > 1 else 0.0


@dataclass(frozen=True)
class StageParams:
    """The bottleneck stage's parameters: `layers` layers, `moe_layers` of them with `experts` routed experts of
    `expert_params` each, and `other_params` of every other operator per layer."""

    layers: int
    moe_layers: int
    experts: int
    expert_params: int
    other_params: int


def gpu_operators(
    stage: StageParams, ep: int, top_k: int, shard_experts: int, shard_other: int
) -> tuple[Operator, ...]:
    """One GPU's operators: its routed experts (ceil(E / ep) per MoE layer), then one operator per layer
    for the rest; FP32 state and compute weights sharded `shard_*` ways (ZeRO-1 over data parallelism)."""
    moe_layers, layers, experts = stage.moe_layers, stage.layers, stage.experts
    expert_params, other_params = stage.expert_params, stage.other_params
    per_gpu = math.ceil(experts / ep)
    expert_flops = expert_params * ep * top_k / experts  # tokens routed to one expert, relative to a dense op
    ops = [
        Operator(
            FP32_STATE_BYTES * expert_params / shard_experts,
            COMPUTE_BYTES * expert_params / shard_experts,
            expert_flops,
            (layer, j),
        )
        for layer in range(moe_layers)
        for j in range(per_gpu)
    ]
    ops += [
        Operator(
            FP32_STATE_BYTES * other_params / shard_other, COMPUTE_BYTES * other_params / shard_other, other_params
        )
        for _ in range(layers)
    ]
    return tuple(ops)


def from_testbed(tb: Testbed, zero1: bool = True) -> Setting:
    """The bottleneck stage (ceil(layers / PP) layers) of a Table 2 testbed; `zero1` shards the FP32 state
    over the stage's data-parallel ranks (experts over DP pipelines, the rest over 8 x DP GPUs)."""
    s = tb.shape
    layers, moe_layers = math.ceil(s.layers / tb.pp), math.ceil(s.moe_layers / tb.pp)
    stage_params = moe_layers * s.experts * s.expert + layers * s.layer_other + s.embedding / tb.pp
    shard = tb.dp if zero1 else 1
    node_state = FP32_STATE_BYTES * stage_params / shard
    expert_share = moe_layers * s.experts * s.expert / stage_params
    other = s.layer_other + s.embedding // (tb.pp * layers)  # embeddings spread over the stages' layers
    stage = StageParams(layers, moe_layers, s.experts, s.expert, other)
    ops = gpu_operators(stage, tb.ep, s.top_k, shard, GPUS_PER_NODE * shard)
    sends = pipeline_send_bytes(tb.pp, tb.micro_batches, s.hidden, MICRO_BATCH_SEQS * SEQ_LEN)
    return Setting(
        name=tb.name,
        iteration_s=tb.iteration_s,
        gpus=tb.gpus,
        stages=tb.pp,
        micro_batches=tb.micro_batches,
        experts=s.experts,
        node_state_bytes=node_state,
        cluster_state_bytes=FP32_STATE_BYTES * s.total_params(),
        expert_state_share=expert_share,
        operators=ops,
        nic_train_bytes=sends + gradient_exchange_bytes(tb.dp, stage_params),
        log_bytes_gpu=sends / GPUS_PER_NODE,
        moc_start_overhead=tb.moc_start_overhead,
    )
