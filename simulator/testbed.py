"""The paper's evaluation cluster (§5.1) and Table 2's four models at their (PP, DP, EP) layouts.

Hardware facts (§5.1, Azure Standard_NC96ads_A100_v4): 12 nodes of 8 A100 80 GB; 80 Gb/s between
nodes per node (10 GB/s, shared by the node's 8 GPUs and by pipeline and gradient traffic); Azure
Blob Storage at 40 Gb/s in aggregate; PCIe Gen4 x16 between a GPU and host memory (31.5 GB/s a
direction); 312 TFLOP/s dense BF16/FP16 per A100.

Workload facts (§5.1): batch 512 sequences of 2048 tokens in micro-batches of 32; (PP, DP, EP) =
(6, 2, 8) for MoE-LLaVa and QWen-MoE, (3, 4, 8) for GPT-MoE, (12, 1, 8) for DeepSeek-MoE: one
stage of one pipeline is one node. ZeRO-1 (§5.1's DeepSpeed baseline) shards the FP32 state over
a stage's data-parallel ranks.

The iteration time T is stated, not modelled: Table 3 prints every strategy's per-iteration
overhead in seconds and in percent of T, so each cell bounds T to [(s - 0.005) / (p + 0.005),
(s + 0.005) / (p - 0.005)]; T is the middle of the four cells' common range (`iteration_from_cells`).
The MFU it implies is shown beside it (`Testbed.mfu`).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
NODE_NIC_BW = 80e9 / 8  # bytes/s per node, shared by its 8 GPUs
GPUS_PER_NODE = 8
BLOB_BW = 40e9 / 8  # bytes/s, the whole cluster to Azure Blob Storage
PCIE_BW = 31.5 * GB  # PCIe Gen4 x16, one direction
A100_PEAK_FLOPS = 312e12
FP32_STATE_BYTES, COMPUTE_BYTES, ACT_BYTES = 12, 2, 2
BATCH_SEQS, MICRO_BATCH_SEQS, SEQ_LEN = 512, 32, 2048
RUN_S = 12 * 3600  # §5.2: 12-hour runs


@dataclass(frozen=True)
class MoEShape:
    """What a stage holds per MoE model: routed experts of `expert` params, the rest per layer."""

    layers: int
    moe_layers: int
    hidden: int
    experts: int  # routed experts per MoE layer
    top_k: int  # routed experts per token
    expert: int  # params of one routed expert
    layer_other: int  # params per layer outside the routed experts (attention, router, shared/dense FFN, norms)
    embedding: int  # input embedding + output head params
    source: str

    def total_params(self) -> int:
        return self.moe_layers * self.experts * self.expert + self.layers * self.layer_other + self.embedding

    def active_params(self) -> int:
        return self.moe_layers * self.top_k * self.expert + self.layers * self.layer_other + self.embedding


def _swiglu(h: int, f: int) -> int:
    return 3 * h * f


def _attention(h: int) -> int:
    return 4 * h * h


@dataclass(frozen=True)
class Testbed:
    """One Table 2 model on its §5.1 layout, with the iteration time Table 3 implies."""

    name: str
    shape: MoEShape
    pp: int
    dp: int
    ep: int
    iteration_s: float
    iteration_source: str

    @property
    def gpus(self) -> int:
        return self.pp * self.dp * self.ep

    @property
    def moc_start_overhead(self) -> float:
        """Table 3's MoC overhead cell (seconds) over T: MoC's overhead at its first K."""
        return OVERHEAD_CELLS[self.name][2][0] / self.iteration_s

    @property
    def nodes(self) -> int:
        return self.gpus // GPUS_PER_NODE

    @property
    def micro_batches(self) -> int:
        """Micro-batches per pipeline per iteration: the batch over DP pipelines, 32 sequences each."""
        return BATCH_SEQS // (self.dp * MICRO_BATCH_SEQS)

    @property
    def mfu(self) -> float:
        """6 x active params x tokens / (T x GPUs x peak): what the stated T implies."""
        flops = 6 * self.shape.active_params() * BATCH_SEQS * SEQ_LEN
        return flops / (self.iteration_s * self.gpus * A100_PEAK_FLOPS)


def iteration_from_cells(cells: list[tuple[float, float]]) -> float:
    """The middle of the T range that every (seconds, percent) overhead cell allows after rounding."""
    lo = max((s - 0.005) / (p / 100 + 0.005) for s, p in cells)
    hi = min((s + 0.005) / (p / 100 - 0.005) for s, p in cells)
    if lo > hi:
        raise ValueError(f"overhead cells {cells} allow no common iteration time")
    return (lo + hi) / 2


# Table 3's overhead cells (seconds, percent): CheckFreq, Gemini, MoC, MoEvement.
OVERHEAD_CELLS = {
    "MoE-LLaVa": [(0.03, 2), (0.02, 1), (0.14, 8), (0.01, 1)],
    "GPT-MoE": [(0.03, 1), (0.03, 1), (0.18, 9), (0.03, 1)],
    "QWen-MoE": [(0.05, 2), (0.04, 2), (0.19, 9), (0.04, 2)],
    "DeepSeek-MoE": [(0.08, 3), (0.07, 2), (0.22, 8), (0.06, 2)],
}
_T_SOURCE = "Table 3 overhead cells (s / %), middle of their common range"

# Shapes: the released models Table 2 cites (totals and active params within 3% of Table 2 where Table 2
# agrees with itself; see docs/simulator.md for the rows where it does not).
SHAPES = {
    # MoE-LLaVA-StableLM-1.6B x 4 (2.9B total, 2.0B active): 24 layers (Table 2 says 32), MoE every other layer
    "MoE-LLaVa": MoEShape(
        24,
        12,
        2048,
        4,
        2,
        _swiglu(2048, 5632),
        _attention(2048) + _swiglu(2048, 5632) // 2,
        2 * 100352 * 2048,
        "MoE-LLaVA-StableLM-1.6Bx4",
    ),
    # train_configs/gpt_moe_7b.toml: 12 layers, 32 experts of f 2976, top-6, tied embeddings
    "GPT-MoE": MoEShape(
        12,
        12,
        2048,
        32,
        6,
        _swiglu(2048, 2976),
        _attention(2048) + 32 * 2048,
        50304 * 2048,
        "train_configs/gpt_moe_7b.toml",
    ),
    # train_configs/qwen_moe_14b.toml (Qwen1.5-MoE-A2.7B): 60 routed of f 1408 top-4 + a shared expert of f 5632
    "QWen-MoE": MoEShape(
        24,
        24,
        2048,
        60,
        4,
        _swiglu(2048, 1408),
        _attention(2048) + _swiglu(2048, 5632) + 61 * 2048,
        2 * 151936 * 2048,
        "train_configs/qwen_moe_14b.toml",
    ),
    # train_configs/deepseek_moe_16b.toml: 28 layers (first dense), 64 routed of f 1408 top-6 + 2 shared
    "DeepSeek-MoE": MoEShape(
        28,
        27,
        2048,
        64,
        6,
        _swiglu(2048, 1408),
        _attention(2048) + 2 * _swiglu(2048, 1408) + 64 * 2048 + _swiglu(2048, 10944) // 28,
        2 * 102400 * 2048,
        "train_configs/deepseek_moe_16b.toml",
    ),
}
LAYOUTS = {"MoE-LLaVa": (6, 2, 8), "GPT-MoE": (3, 4, 8), "QWen-MoE": (6, 2, 8), "DeepSeek-MoE": (12, 1, 8)}

TESTBEDS: dict[str, Testbed] = {
    name: Testbed(name, SHAPES[name], *LAYOUTS[name], iteration_from_cells(OVERHEAD_CELLS[name]), _T_SOURCE)
    for name in SHAPES
}
