"""Decoder-only transformer whose blocks use a dense SwiGLU FFN or a mixture of experts.

The layout is pipeline-splittable (TorchTitan style): a stage is the whole model with some
``layers`` entries deleted and ``tok_embeddings`` / ``norm`` / ``output`` set to None. Layer keys
are global layer ids, so parameter names (``layers.3.moe.experts.17.w1.weight``) are global too.
"""

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.args import ModelArgs
from models.attention import Attention, rope_tables
from models.experts import stacked_experts, unstack
from models.ffn import SwiGLU
from models.moe import ModelBalanceLoss, MoE


class Block(nn.Module):
    """Pre-norm block: ``h = x + drop(attn(norm(x)))``, ``out = h + drop(ffn(norm(h)))``.

    The FFN is ``moe`` (MoE) on MoE layers and ``feed_forward`` (SwiGLU) otherwise; the other is None.
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        is_moe = args.is_moe_layer(layer_id)
        self.moe = MoE(args) if is_moe else None
        self.feed_forward = None if is_moe else SwiGLU(args.dim, args.dense_hidden_dim)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.dropout(self.attention(self.attention_norm(x), cos, sin))
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + self.dropout(ffn(self.ffn_norm(h)))


class Transformer(nn.Module):
    """Token embedding -> blocks -> RMSNorm -> output head (logits in float32).

    Build under ``torch.device("meta")``, then ``to_empty(device=...)`` and ``init_weights()``
    (``models.build_model`` does this). ``tie_embeddings`` needs embedding and head on one stage.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.dropout = nn.Dropout(args.dropout)
        self.layers = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.loss_chunk_tokens = 0  # > 0: the head runs in `loss`, this many tokens at a time (see `loss`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [B, S] int64 (or hidden states [B, S, dim] when ``tok_embeddings`` is None) ->
        logits [B, S, vocab] float32 (hidden states when ``norm``/``output`` is None; the normalised
        hidden states when ``loss_chunk_tokens`` > 0, for :meth:`loss`)."""
        h = x if self.tok_embeddings is None else self.dropout(self.tok_embeddings(x))
        seqlen = h.shape[1]
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        self.start_model_balance()
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is None or self.output is None:
            return h
        h = self.norm(h)
        return h if self.loss_chunk_tokens > 0 else self.output(h).float()

    def loss(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``forward``'s output against ``labels`` [B, S].

        With ``loss_chunk_tokens`` > 0, ``out`` holds the normalised hidden states and the head forms the
        float32 logits of ``loss_chunk_tokens`` tokens at a time, forming them again in backward
        (activation checkpointing per chunk): the [tokens, vocab] logits never exist at once, for one
        more head GEMM in backward."""
        if self.loss_chunk_tokens <= 0:
            return F.cross_entropy(out.flatten(0, 1).float(), labels.flatten())
        h, y, n = out.flatten(0, 1), labels.flatten(), self.loss_chunk_tokens
        chunks = [
            checkpoint(self._summed_loss, hc, yc, use_reentrant=False, preserve_rng_state=False)
            for hc, yc in zip(h.split(n), y.split(n), strict=True)
        ]
        return torch.stack(chunks).sum() / y.numel()

    def _summed_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.output(hidden).float(), labels, reduction="sum")

    def start_model_balance(self) -> None:
        """With ``aux_loss_type = "global"``, give every MoE layer one fresh :class:`ModelBalanceLoss` for
        this training forward (the reference's one loss over all layers needs every MoE layer here)."""
        if not (self.training and self.args.aux_loss_type == "global" and self.args.aux_loss_coef > 0):
            return
        moe_layers = self.moe_layers()
        n_moe = sum(self.args.is_moe_layer(i) for i in range(self.args.n_layers))
        if len(moe_layers) != n_moe:
            raise ValueError(
                "model.aux_loss_type='global' is one loss over every MoE layer, but this model part holds "
                f"{len(moe_layers)} of {n_moe}: use 'batch' or 'seq' with pipeline parallelism"
            )
        balance = ModelBalanceLoss(self.args.n_routed_experts, self.args.aux_loss_coef)
        for moe in moe_layers.values():
            moe.model_balance = balance

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE modules of the layers present, keyed by global layer id."""
        return {key: layer.moe for key, layer in self.layers.items() if layer.moe is not None}

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)tie embeddings, (re)compute the RoPE buffers, zero the load statistics, initialise every parameter.

        Linear/embedding weights ~ N(0, 0.02) (residual output projections ``wo``/``w2``:
        0.02 / sqrt(2 n_layers)), biases 0, norms 1. Draws one seed from torch's global RNG and
        derives each parameter's generator from it and the parameter's global name (each routed expert's
        own, ``layers.3.moe.experts.17.w1.weight``), so a pipeline stage or an expert-parallel shard gets
        exactly the values of the whole model.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight  # to_empty() from meta unties them
        cos, sin = rope_tables(
            self.args.dim // self.args.n_heads, self.args.max_seq_len, self.args.rope_theta, device=self.rope_cos.device
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for moe in self.moe_layers().values():
            moe.reset_load_stats()
        base_seed = int(torch.randint(2**62, ()))
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        stacked = stacked_experts(self)
        for name, param in self.named_parameters():
            owner = self.get_submodule(name.rpartition(".")[0])
            if isinstance(owner, nn.RMSNorm):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:  # a stacked expert weight: each expert's slice as if it were a tensor of its own
                for each, tensor in unstack(name, param, stacked):
                    std = residual_std if each.endswith(("attention.wo.weight", ".w2.weight")) else 0.02
                    tensor.normal_(0.0, std, generator=_generator(base_seed, each, param.device))


def _generator(base_seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.blake2b(f"{base_seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest) >> 1)
