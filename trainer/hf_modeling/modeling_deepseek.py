"""DeepSeek-MoE v1 for ``transformers``: what ``python -m trainer.hf export`` ships beside the weights.

``AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True)`` loads it (``auto_map`` in
``config.json``), offline. It computes the forward of this project's ``models/`` in the checkpoint's tensor
names: pre-norm blocks of RoPE attention (grouped-query when ``num_key_value_heads < num_attention_heads``,
no bias) and either a SwiGLU MLP (the first ``first_k_dense_replace`` layers) or a mixture of experts; the
router's softmax over the routed experts is taken in float32, the top-k weights renormalised only with
``norm_topk_prob`` (and ``top_k > 1``), the shared experts added unweighted. A KV cache (``past_key_values``,
any ``transformers`` ``Cache``) and a 2-D padding ``attention_mask`` make ``generate`` work.

Shipped inside the export directory: it imports only ``torch``, ``transformers`` and its configuration file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_deepseek import DeepseekConfig


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate each pair (x[..., i], x[..., i + d/2]) of x [B, H, S, d] by position * theta^(-2i/d), in float32;
    ``positions`` [B or 1, S]."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = (positions.float()[..., None] * inv_freq)[:, None]  # [B, 1, S, d/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def attention_mask_4d(padding: torch.Tensor | None, past: int, length: int, device) -> torch.Tensor | None:
    """The boolean [B or 1, 1, length, past + length] mask of ``length`` new queries after ``past`` cached keys:
    causal, and without padded keys (``padding`` [B, past + length], 0 = pad); every query still sees itself, so a
    padded row is never empty. None (plain causal attention) without padding or a cache."""
    if past == 0 and (padding is None or bool(padding.all())):
        return None
    keys = torch.arange(past + length, device=device)
    queries = past + torch.arange(length, device=device)
    mask = (keys[None, :] <= queries[:, None])[None, None]
    if padding is not None:
        mask = mask & padding[:, None, None, :].bool()
    return mask | (keys[None, :] == queries[:, None])


class DeepseekAttention(nn.Module):
    """Causal self-attention with RoPE; ``num_key_value_heads`` K/V heads, each shared by a group of query heads."""

    def __init__(self, config: DeepseekConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.theta = layer_idx, config.rope_parameters["rope_theta"]
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.n_heads
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Cache | None):
        """x [B, S, hidden] -> [B, S, hidden]; the new keys and values are appended to ``cache``."""
        bsz, seqlen, _ = x.shape
        q = self.q_proj(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seqlen, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seqlen, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and seqlen > 1, enable_gqa=self.n_kv != self.n_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class DeepseekMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekMoE(nn.Module):
    """``n_routed_experts`` SwiGLU experts, each token sent to its top ``num_experts_per_tok`` by a softmax gate,
    plus the shared experts (one fused MLP) on every token."""

    def __init__(self, config: DeepseekConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.n_routed_experts, bias=False)
        width = config.moe_intermediate_size
        self.experts = nn.ModuleList(DeepseekMLP(config.hidden_size, width) for _ in range(config.n_routed_experts))
        n_shared = config.n_shared_experts or 0
        self.shared_experts = DeepseekMLP(config.hidden_size, n_shared * width) if n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores = F.linear(tokens.float(), self.gate.weight.float()).softmax(dim=-1)
        weights, ids = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (ids == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(tokens[rows]) * weights[rows, slot, None].to(tokens.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view_as(x)


class DeepseekDecoderLayer(nn.Module):
    """``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``; ``mlp`` is MoE from ``first_k_dense_replace`` on."""

    def __init__(self, config: DeepseekConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DeepseekAttention(config, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if layer_idx >= config.first_k_dense_replace:
            self.mlp = DeepseekMoE(config)
        else:
            self.mlp = DeepseekMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Cache | None):
        h = x + self.self_attn(self.input_layernorm(x), positions, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekPreTrainedModel(PreTrainedModel):
    """What ``transformers`` needs of every class here: the config class, the weights' prefix, SDPA attention."""

    config_class = DeepseekConfig
    base_model_prefix = "model"
    _no_split_modules = ["DeepseekDecoderLayer"]
    _supports_sdpa = True


class DeepseekModel(DeepseekPreTrainedModel):
    """Token embedding -> decoder layers -> RMSNorm: the last hidden states."""

    def __init__(self, config: DeepseekConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Exactly one of ``input_ids`` [B, S] and ``inputs_embeds`` [B, S, hidden]; ``attention_mask``: None or
        [B, cached + S] (1 = token, 0 = padding); ``position_ids`` default to the positions after the cache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be [batch, length] (0 = padding), got {attention_mask.dim()}-D")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = (past + torch.arange(h.shape[1], device=h.device))[None]
        mask = attention_mask_4d(attention_mask, past, h.shape[1], h.device)
        for layer in self.layers:
            h = layer(h, position_ids, mask, past_key_values)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), past_key_values=past_key_values)


class DeepseekForCausalLM(DeepseekPreTrainedModel, GenerationMixin):
    """:class:`DeepseekModel` and the output head (``lm_head``, tied to the embedding with ``tie_word_embeddings``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DeepseekConfig):
        super().__init__(config)
        self.model = DeepseekModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits of the last ``logits_to_keep`` positions (0: all); with ``labels`` [B, S] also the mean
        next-token cross-entropy (label -100: ignored)."""
        out = self.model(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache)
        logits = self.lm_head(out.last_hidden_state[:, -logits_to_keep:])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)
