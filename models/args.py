"""Model hyper-parameters: the `[model]` section of a training config."""

from dataclasses import dataclass, fields


@dataclass
class ModelArgs:
    """Shape of a decoder-only MoE transformer.

    Families:
      - ``deepseek``: fine-grained routed experts + ``n_shared_experts`` always-on
        shared experts; the first ``n_dense_layers`` layers use a dense FFN.
      - ``qwen``: routed experts + one shared expert scaled by a sigmoid gate.
      - ``gpt``: routed experts only (no shared expert).
    """

    family: str = "deepseek"  # deepseek (routed + shared experts) | qwen (routed + gated shared) | gpt (routed)
    vocab_size: int = 260  # tokens in the vocabulary (260: bytes + specials)
    dim: int = 64  # hidden size
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # attention heads
    n_kv_heads: int = 0  # 0 means n_heads (plain multi-head attention)
    qkv_bias: bool = False  # bias on the query, key and value projections (Qwen)
    rope_theta: float = 10000.0  # rotary embedding base
    norm_eps: float = 1e-6  # RMSNorm epsilon
    max_seq_len: int = 4096  # longest sequence the rotary tables cover
    dropout: float = 0.0  # dropout probability (seeded per iteration, micro-batch and rank)
    tie_embeddings: bool = False  # share the input embedding and output head
    n_dense_layers: int = 0  # leading layers with a dense FFN instead of MoE (DeepSeek: 1)
    dense_hidden_dim: int = 256  # hidden size of the dense FFN layers
    # Mixture of experts.
    n_routed_experts: int = 8  # routed experts per MoE layer
    n_shared_experts: int = 0  # always-on shared experts per MoE layer (deepseek)
    expert_hidden_dim: int = 64  # hidden size of a routed expert
    shared_expert_hidden_dim: int = 64  # hidden size of a shared expert
    top_k: int = 2  # routed experts per token
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss
    # balance loss per MoE layer over the micro-batch's tokens (batch) or per sequence, averaged (seq: DeepSeek),
    # or one loss over every MoE layer's tokens together (global: the Qwen-MoE reference; needs parallelism.pp = 1)
    aux_loss_type: str = "batch"
    router_z_loss_coef: float = 0.0  # weight of the router z-loss, mean logsumexp(logits)^2 (ST-MoE; 0: off)
    capacity_factor: float = 0.0  # > 0: drop assignments beyond ceil(cf*T*K/E) per expert (0: none)
    moe_every: int = 1  # after the dense layers, every moe_every-th layer is MoE (others dense)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Layers n_dense_layers + moe_every - 1, + 2*moe_every - 1, ... are MoE; the rest are dense."""
        offset = layer_id - self.n_dense_layers
        return offset >= 0 and (offset + 1) % self.moe_every == 0

    def validate(self) -> None:
        """Raise ValueError (one line, naming ``model.<key>``) if the shape is inconsistent."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) != (f.type is bool) or not isinstance(value, _ACCEPTED[f.type]):
                raise ValueError(f"model.{f.name}={value!r} must be of type {f.type.__name__}")
        req = self._require
        req("family", self.family in FAMILIES, f"must be one of {', '.join(FAMILIES)}")
        for key in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "max_seq_len",
            "dense_hidden_dim",
            "n_routed_experts",
            "expert_hidden_dim",
            "shared_expert_hidden_dim",
            "moe_every",
        ):
            req(key, getattr(self, key) >= 1, "must be >= 1")
        req("dim", self.dim % self.n_heads == 0, f"must be divisible by model.n_heads={self.n_heads}")
        req(
            "dim",
            self.dim // self.n_heads % 2 == 0,
            f"/ model.n_heads={self.n_heads} (the head dim) must be even for RoPE",
        )
        req(
            "n_kv_heads",
            self.n_kv_heads == 0 or self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0,
            f"must be 0 (= n_heads) or a divisor of model.n_heads={self.n_heads}",
        )
        for key in ("rope_theta", "norm_eps"):
            req(key, getattr(self, key) > 0, "must be > 0")
        req("dropout", 0 <= self.dropout < 1, "must be in [0, 1)")
        req(
            "n_dense_layers",
            0 <= self.n_dense_layers <= self.n_layers,
            f"must be in [0, model.n_layers={self.n_layers}]",
        )
        req(
            "top_k",
            1 <= self.top_k <= self.n_routed_experts,
            f"must be in [1, model.n_routed_experts={self.n_routed_experts}]",
        )
        fixed = _FIXED_SHARED.get(self.family)
        if fixed is None:
            req("n_shared_experts", self.n_shared_experts >= 0, "must be >= 0")
        else:
            req("n_shared_experts", self.n_shared_experts == fixed, f"must be {fixed} for family {self.family}")
        req("aux_loss_coef", self.aux_loss_coef >= 0, "must be >= 0")
        req("aux_loss_type", self.aux_loss_type in AUX_LOSS_TYPES, f"must be one of {', '.join(AUX_LOSS_TYPES)}")
        req("router_z_loss_coef", self.router_z_loss_coef >= 0, "must be >= 0")
        req("capacity_factor", self.capacity_factor >= 0, "must be >= 0 (0 disables capacity dropping)")

    def _require(self, key: str, ok: bool, rule: str) -> None:
        if not ok:
            raise ValueError(f"model.{key}={getattr(self, key)!r} {rule}")


FAMILIES = ("deepseek", "qwen", "gpt")
AUX_LOSS_TYPES = ("batch", "seq", "global")
_FIXED_SHARED = {"qwen": 1, "gpt": 0}  # families with a fixed number of shared experts
_ACCEPTED = {str: str, int: int, bool: bool, float: (int, float)}  # TOML may write 1 for 1.0
