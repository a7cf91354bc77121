"""``DeepseekConfig``: the ``config.json`` of a DeepSeek-MoE v1 model exported by ``python -m trainer.hf export``.

Shipped inside the export directory (``auto_map``: ``AutoConfig``) beside ``modeling_deepseek.py``; it imports
nothing but ``transformers``. The keys are deepseek-moe-16b-base's; a value the modeling file does not compute
(another activation, sigmoid routing, MoE every other layer, attention bias, RoPE scaling, MLA) is refused
with a ``ValueError`` naming the key, so that a model never silently computes something else.
"""

from __future__ import annotations

from transformers import PretrainedConfig

# key -> the only value the modeling file computes
_REQUIRED = {
    "hidden_act": "silu",
    "scoring_func": "softmax",
    "moe_layer_freq": 1,
    "attention_bias": False,
    "q_lora_rank": None,
    "kv_lora_rank": None,
}


class DeepseekConfig(PretrainedConfig):
    """DeepSeek-MoE v1: ``first_k_dense_replace`` dense layers, then MoE layers of ``n_routed_experts``
    softmax-routed experts (top ``num_experts_per_tok``) plus ``n_shared_experts`` shared experts fused into one
    MLP of ``n_shared_experts * moe_intermediate_size`` units."""

    model_type = "deepseek"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 102400
    hidden_size: int = 2048
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    # {"rope_type": "default", "rope_theta": base}; a transformers-4 config's top-level rope_theta lands here
    rope_parameters: dict | None = None
    tie_word_embeddings: bool = False
    n_routed_experts: int = 64
    n_shared_experts: int | None = 2
    num_experts_per_tok: int = 6
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    scoring_func: str = "softmax"
    aux_loss_alpha: float = 0.001
    seq_aux: bool = True
    attention_bias: bool = False
    attention_dropout: float = 0.0
    pretraining_tp: int = 1
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self, **kwargs) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)
        for key, value in _REQUIRED.items():
            if getattr(self, key, None) != value:
                raise ValueError(f"config.json: {key}={getattr(self, key)!r} is not supported (only {value!r})")
        if self.rope_parameters.get("rope_type") != "default":
            raise ValueError(f"config.json: rope_parameters={self.rope_parameters!r}: only unscaled RoPE is supported")
