"""Figure 11: the scale study's four DeepSeek-MoE clusters on the §5.1 testbed's hardware.

The clusters and models are `simulator.presets.PAPER_PRESETS` (32B-671B on 512-16,384 GPUs, 8-way
expert parallelism: one stage of one pipeline is one node). What changes from the presets' own
hardware: the node is the §5.1 Azure A100 node (80 Gb/s NIC shared by 8 GPUs, NVLink 300 GB/s a
direction, A100 peaks), its MFU is the one DeepSeek-MoE's stated T implies on the testbed
(`simulator.testbed`), and checkpoints and failures follow the calibrated mechanisms
(`simulator.mechanisms`, `simulator.calibrated`), ZeRO-1 sharding the FP32 state over pipelines.
The iteration time is `simulator.cluster.stage_model`'s (1F1B, all-to-all inside the node,
gradient exchange over the NIC). `simulator.model` runs every strategy on the setting.
"""

from __future__ import annotations

import math
from dataclasses import replace

from simulator.cluster import Hardware, Preset, stage_model
from simulator.setting import Setting, StageParams, gpu_operators, gradient_exchange_bytes, pipeline_send_bytes
from simulator.testbed import A100_PEAK_FLOPS, FP32_STATE_BYTES, GPUS_PER_NODE, NODE_NIC_BW, TESTBEDS

A100_HBM_BW = 2.0e12  # A100 80 GB
A100_NVLINK_BW = 300e9  # 600 GB/s both directions


def azure_hardware() -> Hardware:
    """§5.1's node as the iteration model's per-GPU rates; MFU from DeepSeek-MoE's stated T."""
    return Hardware(
        peak_flops=A100_PEAK_FLOPS,
        mfu=TESTBEDS["DeepSeek-MoE"].mfu,
        hbm_bw=A100_HBM_BW,
        a2a_bw=NODE_NIC_BW / GPUS_PER_NODE,
        nvlink_bw=A100_NVLINK_BW,
        gpus_per_node=GPUS_PER_NODE,
        dp_bw=NODE_NIC_BW / GPUS_PER_NODE,
    )


def from_preset(preset: Preset) -> Setting:
    """The bottleneck node of a scale-study preset on the Azure hardware."""
    p = replace(preset, hw=azure_hardware())
    m, lay, st = p.model, p.layout, stage_model(p)
    layers, moe_layers = (
        math.ceil(m.layers / lay.pp),
        min(math.ceil(m.layers / lay.pp), math.ceil(m.moe_layers / lay.pp)),
    )
    experts = moe_layers * m.experts * m.expert
    other_per_layer = st.nonexpert_params // max(1, layers)  # replicated on every GPU of the stage
    stage_params = experts + other_per_layer * layers
    stage = StageParams(layers, moe_layers, m.experts, m.expert, other_per_layer)
    ops = gpu_operators(stage, lay.ep, m.top_k, lay.pipelines, GPUS_PER_NODE * lay.pipelines)
    sends = pipeline_send_bytes(lay.pp, lay.micro_batches, m.hidden, lay.ep * lay.micro_batch_seqs * lay.seq_len)
    return Setting(
        name=preset.name,
        iteration_s=st.iteration_s,
        gpus=lay.gpus,
        stages=lay.pp,
        micro_batches=lay.micro_batches,
        experts=m.experts,
        node_state_bytes=FP32_STATE_BYTES * stage_params / lay.pipelines,
        cluster_state_bytes=FP32_STATE_BYTES * m.total_params(),
        expert_state_share=experts / stage_params,
        operators=ops,
        nic_train_bytes=sends + gradient_exchange_bytes(lay.pipelines, stage_params),
        log_bytes_gpu=sends / GPUS_PER_NODE,
    )
