"""The scale study's presets: the paper's four clusters (§5.4, Appendix C) and a few labelled extras.

| preset     | model (source)                                                  | stages x pipelines x ep | M  |
|------------|-----------------------------------------------------------------|-------------------------|----|
| 32B-512    | DeepSeekMoE-16B recipe grown to 32B (*): 36 layers, h 3072,     | 16 x 4 x 8              | 144|
|            | 64+2 experts of f 1408, top-6                                   |                         |    |
| 67B-1536   | the same recipe grown to 67B (*): 39 layers, h 4096, f 2048     | 24 x 8 x 8              | 72 |
| 145B-4096  | DeepSeekMoE 145B (DeepSeekMoE paper): 62 layers, h 4096,        | 32 x 16 x 8             | 36 |
|            | 128+4 experts of f 1408, top-12                                 |                         |    |
| 671B-16384 | DeepSeek-V3 (its technical report): 61 layers (3 dense, f       | 64 x 32 x 8             | 60 |
|            | 18432), h 7168, 256+1 experts of f 2048, top-8, MLA ~187M/layer |                         |    |

(*) No public DeepSeek-MoE model has 32B or 67B parameters: DeepSeekMoE 16B's recipe (64 routed +
2 shared fine-grained experts, top-6, first layer dense, vocab 102400) with more layers and a wider
hidden size; totals 32.0B and 66.7B. The layouts are the paper's; 8-way expert parallelism is the
NVLink domain. M (micro-batches of one 4096-token sequence per GPU) = global batch / (pipelines x
ep): 15360 sequences for 671B (DeepSeek-V3's batch after its ramp-up), 4608 (4.5K, DeepSeekMoE's
recipe) for the others.

Extras (`extra-*`, not the paper's): the project's earlier layouts with 4-16 stages and 8-64-way
expert parallelism (16 micro-batches), kept to show what shallow pipelines and wide expert
parallelism change.
"""

from __future__ import annotations

from simulator.cluster import ClusterShape, ModelShape, Preset

PAPER_EP = 8  # the paper's expert parallelism: one NVLink domain

S32 = ModelShape(36, 1, 3072, 8192, 64, 2, 6, 1408, 102400)
S67 = ModelShape(39, 1, 4096, 10944, 64, 2, 6, 2048, 102400)
S145 = ModelShape(62, 1, 4096, 10944, 128, 4, 12, 1408, 102400)
S671 = ModelShape(61, 3, 7168, 18432, 256, 1, 8, 2048, 129280, attn_params=187_000_000)
DEEPSEEK_V3_BATCH, DEEPSEEKMOE_BATCH = 15360, 4608  # sequences of 4096 tokens


def layout_for(stages: int, pipelines: int, ep: int, batch_seqs: int) -> ClusterShape:
    """A layout whose GPUs share `batch_seqs` one-sequence micro-batches equally (ValueError if they cannot)."""
    dp = pipelines * ep
    if stages < 1 or dp < 1 or batch_seqs % dp:
        raise ValueError(f"{batch_seqs} sequences do not split over {pipelines} pipelines x {ep} GPUs")
    return ClusterShape(stages, pipelines, ep, batch_seqs // dp)


PAPER_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("32B-512", S32, layout_for(16, 4, PAPER_EP, DEEPSEEKMOE_BATCH)),
        Preset("67B-1536", S67, layout_for(24, 8, PAPER_EP, DEEPSEEKMOE_BATCH)),
        Preset("145B-4096", S145, layout_for(32, 16, PAPER_EP, DEEPSEEKMOE_BATCH)),
        Preset("671B-16384", S671, layout_for(64, 32, PAPER_EP, DEEPSEEK_V3_BATCH)),
    )
}
EXTRA_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("extra-32B-512-pp4-ep8", S32, ClusterShape(4, 16, 8, 16)),
        Preset("extra-67B-1024-pp8-ep16", S67, ClusterShape(8, 8, 16, 16)),
        Preset("extra-67B-2048-pp8-ep16", S67, ClusterShape(8, 16, 16, 16)),
        Preset("extra-145B-4096-pp8-ep32", S145, ClusterShape(8, 16, 32, 16)),
        Preset("extra-145B-8192-pp8-ep32", S145, ClusterShape(8, 32, 32, 16)),
        Preset("extra-671B-16384-pp16-ep64", S671, ClusterShape(16, 16, 64, 16)),
    )
}
PRESETS: dict[str, Preset] = {**PAPER_PRESETS, **EXTRA_PRESETS}
