"""The correspondence between this project's models and the Hugging Face checkpoints of the originals.

Two layouts are understood, each the one its public checkpoint uses:

* ``qwen2_moe`` (Qwen1.5-MoE-A2.7B; loads with ``transformers``' ``Qwen2MoeForCausalLM``): one shared
  expert ``mlp.shared_expert`` scaled by ``sigmoid(mlp.shared_expert_gate)``, bias on q/k/v.
* ``deepseek`` (deepseek-moe-16b-base; ``transformers`` has no class for it: it loads with
  ``trust_remote_code=True`` and the ``DeepseekForCausalLM`` code of ``auto_map``, which an export ships,
  ``trainer/hf_modeling/``): the ``n_shared_experts`` shared experts fused into one MLP
  ``mlp.shared_experts`` of ``n_shared_experts * moe_intermediate_size`` hidden units, as this project's
  ``moe.shared_experts`` is (of ``n_shared_experts * shared_expert_hidden_dim``: a width that is a multiple of
  ``expert_hidden_dim`` exports as that many of deepseek's shared experts).

Both store routed experts one by one (``mlp.experts.<e>.{gate,up,down}_proj``); this project's
``w1``/``w3``/``w2`` are ``gate_proj``/``up_proj``/``down_proj``; each tensor is one tensor of the
other. Everything here is pure: dicts of tensors and JSON-like config dicts in and out, no files. A
feature the project's model does not compute (MLA, sigmoid or group-limited routing, rope scaling,
sliding windows, dense layers that are not a prefix) is refused with :class:`UnsupportedModel`, one
line naming the config key.
"""

from __future__ import annotations

from collections.abc import Iterable

from models.args import ModelArgs

SUPPORTED = {"qwen2_moe": "qwen", "deepseek": "deepseek"}
ARCHITECTURES = {"qwen": "Qwen2MoeForCausalLM", "deepseek": "DeepseekForCausalLM"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved


class UnsupportedModel(ValueError):
    """A Hugging Face config or state dict this project cannot represent exactly; the message names the key."""


# ---------------------------------------------------------------- configs


def _get(cfg: dict, key: str, default=None, *, required: bool = False):
    if key not in cfg or cfg[key] is None:
        if required:
            raise UnsupportedModel(f"config.json: missing {key!r}")
        return default
    return cfg[key]


def _rope_theta(cfg: dict) -> float:
    """The RoPE base from ``rope_theta`` (transformers 4) or ``rope_parameters`` (5); scaling is refused."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if scaling or rope_type != "default":
        raise UnsupportedModel(f"config.json: rope scaling ({scaling or rope_type!r}) is not supported")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _reject(cfg: dict, key: str, ok, what: str) -> None:
    value = cfg.get(key)
    if value is not None and not ok(value):
        raise UnsupportedModel(f"config.json: {key}={value!r}: {what} is not supported")


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """The :class:`ModelArgs` of a Hugging Face ``config.json`` (``qwen2_moe`` or ``deepseek``).

    Keys that only a training run sets (dropout, capacity, z-loss) keep their defaults; the balance loss
    takes the original's coefficient and form (DeepSeek's ``seq_aux``; Qwen's reference form, one loss
    over every layer's tokens).
    """
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        hint = " (MLA attention, group-limited routing)" if str(model_type).startswith("deepseek_v") else ""
        raise UnsupportedModel(
            f"config.json: model_type {model_type!r}{hint} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    _reject(cfg, "hidden_act", lambda v: v == "silu", "an activation other than silu")
    n_layers = int(_get(cfg, "num_hidden_layers", required=True))
    n_heads = int(_get(cfg, "num_attention_heads", required=True))
    n_kv = int(_get(cfg, "num_key_value_heads", n_heads))
    common = dict(
        vocab_size=int(_get(cfg, "vocab_size", required=True)),
        dim=int(_get(cfg, "hidden_size", required=True)),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=0 if n_kv == n_heads else n_kv,
        rope_theta=_rope_theta(cfg),
        norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        max_seq_len=int(_get(cfg, "max_position_embeddings", 4096)),
        tie_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        dense_hidden_dim=int(_get(cfg, "intermediate_size", required=True)),
        n_routed_experts=int(_get(cfg, "num_experts" if model_type == "qwen2_moe" else "n_routed_experts", 0)),
        expert_hidden_dim=int(_get(cfg, "moe_intermediate_size", required=True)),
        top_k=int(_get(cfg, "num_experts_per_tok", required=True)),
        norm_topk_prob=bool(_get(cfg, "norm_topk_prob", False)),
    )
    family = _qwen_args(cfg, n_layers) if model_type == "qwen2_moe" else _deepseek_args(cfg, n_layers)
    args = ModelArgs(**common, **family)
    try:
        args.validate()
    except ValueError as e:
        raise UnsupportedModel(f"config.json: gives an invalid model ({e})") from None
    return args


def _qwen_args(cfg: dict, n_layers: int) -> dict:
    _reject(cfg, "use_sliding_window", lambda v: not v, "sliding-window attention")
    _reject(cfg, "qkv_bias", lambda v: v, "Qwen2-MoE without q/k/v bias")
    dense = sorted(int(i) for i in _get(cfg, "mlp_only_layers", []))
    step = int(_get(cfg, "decoder_sparse_step", 1))
    if dense != list(range(len(dense))) or (dense and step != 1):
        raise UnsupportedModel(
            f"config.json: mlp_only_layers={dense} with decoder_sparse_step={step}: "
            "dense layers that are not a prefix of the model are not supported"
        )
    if int(_get(cfg, "shared_expert_intermediate_size", 0)) < 1:
        raise UnsupportedModel("config.json: shared_expert_intermediate_size must be >= 1 (qwen has one shared expert)")
    return dict(
        family="qwen",
        qkv_bias=True,
        n_dense_layers=len(dense),
        moe_every=step,
        n_shared_experts=1,
        shared_expert_hidden_dim=int(cfg["shared_expert_intermediate_size"]),
        aux_loss_coef=float(_get(cfg, "router_aux_loss_coef", 0.001)),
        aux_loss_type="global",
    )


def _deepseek_args(cfg: dict, n_layers: int) -> dict:
    for key, what in (("q_lora_rank", "MLA attention"), ("kv_lora_rank", "MLA attention")):
        _reject(cfg, key, lambda v: False, what)
    _reject(cfg, "scoring_func", lambda v: v == "softmax", "routing other than softmax")
    _reject(cfg, "topk_method", lambda v: v == "greedy", "group-limited routing")
    _reject(cfg, "attention_bias", lambda v: not v, "attention bias")
    _reject(cfg, "moe_layer_freq", lambda v: int(v) == 1, "MoE every other layer (dense layers that are not a prefix)")
    n_shared = int(_get(cfg, "n_shared_experts", 0) or 0)
    return dict(
        family="deepseek",
        n_dense_layers=int(_get(cfg, "first_k_dense_replace", 0)),
        n_shared_experts=n_shared,
        shared_expert_hidden_dim=int(cfg["moe_intermediate_size"]),
        aux_loss_coef=float(_get(cfg, "aux_loss_alpha", 0.001)),
        aux_loss_type="seq" if _get(cfg, "seq_aux", False) else "batch",
    )


def hf_config(args: ModelArgs, dtype: str = "float32") -> dict:
    """The ``config.json`` that loads ``args``' weights with the original's class (see the module docstring), in
    the keys of ``transformers`` 5 (``dtype``, ``rope_parameters``; ``torch_dtype`` and ``rope_scaling`` are
    deprecated there and warn). The special token ids are the tokenizer's: the caller adds them."""
    if args.family not in ARCHITECTURES:
        raise UnsupportedModel(f"model.family={args.family!r}: only qwen and deepseek have a Hugging Face layout")
    common = {
        "architectures": [ARCHITECTURES[args.family]],
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.dense_hidden_dim,
        "moe_intermediate_size": args.expert_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_embeddings,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk_prob,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
    }
    return common | (_qwen_config(args) if args.family == "qwen" else _deepseek_config(args))


def _qwen_config(args: ModelArgs) -> dict:
    if args.n_dense_layers and args.moe_every != 1:
        raise UnsupportedModel("model: n_dense_layers > 0 with moe_every > 1 has no Qwen2-MoE layout")
    return {
        "model_type": "qwen2_moe",
        "qkv_bias": args.qkv_bias,
        "num_experts": args.n_routed_experts,
        "shared_expert_intermediate_size": args.shared_expert_hidden_dim,
        "decoder_sparse_step": args.moe_every,
        "mlp_only_layers": list(range(args.n_dense_layers)),
        "use_sliding_window": False,
        "sliding_window": None,
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
    }


def _deepseek_config(args: ModelArgs) -> dict:
    if args.qkv_bias:
        raise UnsupportedModel("model.qkv_bias=true has no deepseek layout (its attention has no bias)")
    if args.moe_every != 1:
        raise UnsupportedModel("model.moe_every > 1 has no deepseek layout")
    shared_width = args.n_shared_experts * args.shared_expert_hidden_dim  # the one fused MLP, here and there
    if shared_width % args.expert_hidden_dim:
        raise UnsupportedModel(
            f"model.n_shared_experts x model.shared_expert_hidden_dim ({shared_width}) must be a multiple of "
            "model.expert_hidden_dim for the deepseek layout (its shared experts are moe_intermediate_size wide)"
        )
    return {
        "model_type": "deepseek",
        # the modeling files the export ships beside the weights (trainer/hf_modeling/; trust_remote_code=True)
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekConfig",
            "AutoModel": "modeling_deepseek.DeepseekModel",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM",
        },
        "n_routed_experts": args.n_routed_experts,
        "n_shared_experts": shared_width // args.expert_hidden_dim or None,
        "first_k_dense_replace": args.n_dense_layers,
        "moe_layer_freq": 1,
        "scoring_func": "softmax",
        "aux_loss_alpha": args.aux_loss_coef,
        "seq_aux": args.aux_loss_type == "seq",
        "attention_bias": False,
        "pretraining_tp": 1,
    }


# ---------------------------------------------------------------- tensors


_MLP = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def _layer_sources(args: ModelArgs, i: int) -> dict[str, str]:
    ours, theirs = f"layers.{i}", f"model.layers.{i}"
    out = {
        f"{ours}.attention_norm.weight": f"{theirs}.input_layernorm.weight",
        f"{ours}.ffn_norm.weight": f"{theirs}.post_attention_layernorm.weight",
    }
    for proj, hf in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        out[f"{ours}.attention.{proj}.weight"] = f"{theirs}.self_attn.{hf}.weight"
        if args.qkv_bias and proj != "wo":
            out[f"{ours}.attention.{proj}.bias"] = f"{theirs}.self_attn.{hf}.bias"
    if not args.is_moe_layer(i):
        out.update({f"{ours}.feed_forward.{w}.weight": f"{theirs}.mlp.{hf}.weight" for w, hf in _MLP})
        return out
    out[f"{ours}.moe.router.gate.weight"] = f"{theirs}.mlp.gate.weight"
    for e in range(args.n_routed_experts):
        out.update({f"{ours}.moe.experts.{e}.{w}.weight": f"{theirs}.mlp.experts.{e}.{hf}.weight" for w, hf in _MLP})
    shared = {"qwen": "shared_expert", "deepseek": "shared_experts"}.get(args.family)
    if shared and args.n_shared_experts:  # deepseek's n shared experts are one fused MLP, as here
        out.update({f"{ours}.moe.shared_experts.{w}.weight": f"{theirs}.mlp.{shared}.{hf}.weight" for w, hf in _MLP})
    if args.family == "qwen":
        out[f"{ours}.moe.shared_expert_gate.weight"] = f"{theirs}.mlp.shared_expert_gate.weight"
    return out


def sources(args: ModelArgs) -> dict[str, str]:
    """Every tensor of the whole model (project name) and its name in the original's checkpoint, in the model's
    order (embedding, layers, final norm, head), the order an export's shards follow."""
    out = {"tok_embeddings.weight": "model.embed_tokens.weight"}
    for i in range(args.n_layers):
        out.update(_layer_sources(args, i))
    out["norm.weight"] = "model.norm.weight"
    if not args.tie_embeddings:
        out["output.weight"] = "lm_head.weight"
    return out


def check_names(hf_names: Iterable[str], args: ModelArgs) -> None:
    """Refuse a checkpoint missing a tensor the model needs, or holding one it does not compute."""
    expected = set(sources(args).values())
    present = {k for k in hf_names if not k.endswith(_IGNORED_SUFFIXES)}
    if args.tie_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints also store the head
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing:
        raise UnsupportedModel(f"weights: missing {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise UnsupportedModel(f"weights: unexpected {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
