"""Mixture-of-experts FFN: top-k softmax router, routed SwiGLU experts, optional shared experts.

The forward reads as the algorithm: route -> permute (group the token copies by expert) ->
experts_forward (each expert on its contiguous group, one grouped GEMM per projection: models/experts.py)
-> combine (weight and scatter back). An expert-parallel wrapper replaces only ``experts_forward``
(all-to-all, ``run_experts`` on the local experts, all-to-all back); routing and combining stay in the
global expert index space.

On one device nothing reads a value back to the host, except capacity dropping (``capacity_factor`` > 0:
the number of kept assignments sizes a tensor) and a replay with frozen experts (the active experts' rows
are gathered); expert parallelism reads its all-to-all split sizes.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.experts import GroupedExperts
from models.ffn import SwiGLU


class Router(nn.Module):
    """Scores every token against the ``n_experts`` global experts and keeps the ``top_k`` best."""

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (logits [T, E] float32, scores [T, E] their softmax, expert_ids [T, K] int64,
        weights [T, K] float32). Renormalising one weight would make it 1: at top_k=1 the score is kept."""
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(dim=-1)
        weights, expert_ids = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, scores, expert_ids, weights


def expert_counts(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert, int64 [E]. A comparison against every expert id, not ``bincount``, which on a
    GPU reads the largest id back to the host to size its output."""
    ids = expert_ids.flatten()
    return (ids.unsqueeze(1) == torch.arange(n_experts, device=ids.device)).sum(dim=0)


def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Expert-level balance loss ``E / (K T) * sum_i count_i * mean_t scores[t, i]`` (1 when perfectly balanced)."""
    n_tokens, n_experts = scores.shape
    return (counts.to(scores.dtype) * scores.mean(dim=0)).sum() * (n_experts / (top_k * n_tokens))


def sequence_balancing_loss(scores: torch.Tensor, expert_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """DeepSeek-MoE's sequence-level balance loss: the expert-level loss of each sequence of ``seq_len``
    consecutive tokens (its own counts and mean scores), averaged over the sequences (1 when balanced)."""
    n_experts, top_k = scores.shape[1], expert_ids.shape[1]
    per_seq = scores.view(-1, seq_len, n_experts)
    ids = expert_ids.reshape(per_seq.shape[0], seq_len * top_k)
    counts = torch.zeros(per_seq.shape[0], n_experts, dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=scores.dtype))
    return ((counts * per_seq.mean(dim=1)).sum(dim=1) * (n_experts / (top_k * seq_len))).mean()


class ModelBalanceLoss:
    """Qwen-MoE reference's balance loss over one forward of the whole model (``aux_loss_type = "global"``).

    ``E * sum_e f_e * P_e``, where f_e is expert e's share of the top-k assignments and P_e its mean
    score over the tokens of every MoE layer together (``top_k`` when balanced): one loss for the model,
    not one per layer. Each layer :meth:`add`\\ s its counts and scores as the forward goes; the gradient
    of its scores, ``coef * E * C_e / N^2`` (C: every layer's counts, N: every layer's tokens), is formed
    in backward, when all layers have added theirs.
    """

    def __init__(self, n_experts: int, coef: float):
        self.n_experts, self.coef = n_experts, coef
        self.counts: torch.Tensor | None = None
        self.rows = 0
        self.score_sums: list[torch.Tensor] = []

    def add(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Register one layer's scores [T, E] and counts [E]; a 0-dim tensor whose backward sends
        d(loss)/d(scores) times its incoming gradient into ``scores``."""
        counts = counts.to(torch.float32)
        self.counts = counts if self.counts is None else self.counts + counts
        self.rows += scores.shape[0]
        self.score_sums.append(scores.detach().sum(dim=0))
        return _ModelBalanceGrad.apply(scores, self)

    def share(self, layer: int) -> torch.Tensor:
        """The `layer`-th added layer's part of the loss (coefficient included): its scores against every
        layer's counts. The parts of all layers sum to the loss."""
        return self.coef * self.n_experts * (self.counts * self.score_sums[layer]).sum() / self.rows**2


class _ModelBalanceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, balance: ModelBalanceLoss) -> torch.Tensor:
        ctx.balance, ctx.shape = balance, scores.shape
        return scores.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        b = ctx.balance
        per_score = grad * (b.coef * b.n_experts / b.rows**2) * b.counts
        return per_score.expand(ctx.shape), None


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2 (keeps router logits small)."""
    return logits.logsumexp(dim=-1).square().mean()


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out`` whose backward also sends d(loss)/d(aux_loss) = ``scale`` into ``aux_loss``.

    Lets the auxiliary loss train the router without being added to the model output
    (a pipeline stage only returns hidden states). Same idea as Megatron's MoEAuxLossAutoScaler.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_like = (aux_loss.dtype, aux_loss.device)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        dtype, device = ctx.aux_like
        return grad_out, torch.full((), ctx.scale, dtype=dtype, device=device), None


class MoE(nn.Module):
    """Routed experts (``experts``: stacked, models/experts.py) plus the family's shared experts
    (``shared_experts``: the ``n_shared_experts`` of DeepSeek-MoE fused into one SwiGLU, as its checkpoints store them).

    Attributes the trainer uses: ``aux_grad_scale`` (set to 1/num_microbatches), ``last_aux_loss``
    (detached 0-dim tensor of the last training forward, coefficient included), and the non-persistent buffers
    accumulated on every training forward until ``reset_load_stats()``: ``tokens_per_expert``
    (int64 [E], assignments before capacity dropping, over the data-parallel group), ``gate_prob_sum``
    (float32 [E], summed softmax scores, over the data-parallel group) and ``dropped_tokens`` (int64
    scalar, assignments dropped by capacity).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_experts = args.n_routed_experts
        self.top_k = args.top_k
        self.aux_loss_coef, self.aux_loss_type = args.aux_loss_coef, args.aux_loss_type
        self.router_z_loss_coef = args.router_z_loss_coef
        self.capacity_factor = args.capacity_factor
        self.router = Router(args.dim, args.n_routed_experts, args.top_k, args.norm_topk_prob)
        self.experts = GroupedExperts(self.n_experts, args.dim, args.expert_hidden_dim)
        n_shared = 0 if args.family == "gpt" else args.n_shared_experts
        # n shared experts are one SwiGLU of n times the hidden units: the sum of n experts is that MLP's output
        self.shared_experts = SwiGLU(args.dim, n_shared * args.shared_expert_hidden_dim) if n_shared else None
        self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False) if args.family == "qwen" else None
        self.aux_grad_scale = 1.0
        self.model_balance: ModelBalanceLoss | None = None  # set by the model for each forward (``global``)
        self._last_aux_loss = torch.zeros(())
        self._balance_index: int | None = None
        self.register_buffer("tokens_per_expert", torch.zeros(self.n_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("gate_prob_sum", torch.zeros(self.n_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.int64), persistent=False)

    @property
    def last_aux_loss(self) -> torch.Tensor:
        """Detached auxiliary loss of the last training forward; with ``global`` the model's one loss, each
        MoE layer reporting its share (the loss of its scores against every layer's counts)."""
        if self._balance_index is None:
            return self._last_aux_loss
        return self._last_aux_loss + self.model_balance.share(self._balance_index)

    def reset_load_stats(self) -> None:
        """Zero ``tokens_per_expert``, ``gate_prob_sum`` and ``dropped_tokens``."""
        for buf in (self.tokens_per_expert, self.gate_prob_sum, self.dropped_tokens):
            buf.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim]."""
        tokens = x.reshape(-1, x.shape[-1])
        logits, scores, expert_ids, weights = self.router(tokens)
        counts = expert_counts(expert_ids, self.n_experts)
        order, kept_counts = self.permute(expert_ids, counts)
        token_ids = order // self.top_k
        expert_out = self.experts_forward(tokens.index_select(0, token_ids), kept_counts)
        out = self.combine(expert_out, weights.flatten().index_select(0, order), token_ids, tokens.shape[0])
        if self.shared_experts is not None:
            out = out + self.shared_forward(tokens)
        if self.training:
            seq_len = x.shape[-2] if x.dim() >= 3 else tokens.shape[0]
            out = self.training_side_effects(out, logits, scores, expert_ids, counts, kept_counts, seq_len)
        return out.view(x.shape)

    def permute(self, expert_ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Order the T*K assignments (flat index t*K + k) by expert, token order within an expert.

        Returns (order, kept_counts): the flat indices of the kept assignments and the kept count per
        expert. With ``capacity_factor > 0`` an expert keeps its first ceil(cf * T * K / E) assignments
        in training; evaluation keeps every assignment, so a sequence's output never depends on the others.
        """
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)
        if self.capacity_factor <= 0 or not self.training:
            return order, counts
        capacity = math.ceil(self.capacity_factor * flat.numel() / self.n_experts)
        group_start = counts.cumsum(0) - counts
        rank = torch.arange(flat.numel(), device=flat.device) - group_start.index_select(0, flat.index_select(0, order))
        return order[rank < capacity], counts.clamp(max=capacity)

    def global_load(self, counts: torch.Tensor, gate_sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Seam for data parallelism: (``counts`` [E] and ``gate_sums`` [E] summed over every token of the
        data-parallel group for this micro-batch, number of data-parallel replicas). Single process:
        ``(counts, gate_sums, 1)``."""
        return counts, gate_sums, 1

    def experts_forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: token copies grouped by global expert id (ascending), ``counts`` [E] rows each -> outputs, same order."""
        return self.run_experts(x, counts)

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts present in ``self.experts`` (ascending id) on consecutive groups of ``counts`` [n] rows.

        Every expert's weights get a gradient (zero for an expert without rows), as one stacked tensor."""
        return self.experts(x, counts)

    @staticmethod
    def combine(
        expert_out: torch.Tensor, weights: torch.Tensor, token_ids: torch.Tensor, n_tokens: int
    ) -> torch.Tensor:
        """Sum ``weights * expert_out`` rows into their tokens; dropped assignments contribute 0."""
        weighted = expert_out * weights.to(expert_out.dtype).unsqueeze(1)
        return expert_out.new_zeros(n_tokens, expert_out.shape[1]).index_add_(0, token_ids, weighted)

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts (one fused MLP); qwen scales it by ``sigmoid(shared_expert_gate(x))``."""
        out = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x)) * out
        return out

    def training_side_effects(self, out, logits, scores, expert_ids, counts, kept_counts, seq_len) -> torch.Tensor:
        """Accumulate load statistics and attach the auxiliary losses to ``out``'s backward.

        ``tokens_per_expert`` and ``gate_prob_sum`` accumulate data-parallel-global sums (the same on every
        replica, so popularity orders agree); ``dropped_tokens`` stays local. The batch-level balance loss
        (``aux_loss_type = "batch"``) uses the global counts and is divided by ``dp``: its mean over the
        replicas is the loss over all their tokens, and averaging the replicas' gradients (as FSDP does) gives
        that global loss's gradient. The sequence-level one and the z-loss are means over local sequences and
        tokens, whose replica average is already the global mean.
        """
        with torch.no_grad():
            g_counts, g_gate_sums, replicas = self.global_load(counts, scores.sum(dim=0))
            self.tokens_per_expert += g_counts
            self.gate_prob_sum += g_gate_sums
            self.dropped_tokens += counts.sum() - kept_counts.sum()
        aux_loss = scores.new_zeros(())
        self._balance_index = None
        if self.aux_loss_coef > 0 and self.aux_loss_type == "global":
            if self.model_balance is None:
                raise RuntimeError("aux_loss_type='global' needs the model to set MoE.model_balance before forward")
            self._balance_index = len(self.model_balance.score_sums)
            balance_part = self.model_balance.add(scores, counts)
        elif self.aux_loss_coef > 0 and self.aux_loss_type == "seq":
            aux_loss = aux_loss + self.aux_loss_coef * sequence_balancing_loss(scores, expert_ids, seq_len)
        elif self.aux_loss_coef > 0:
            aux_loss = aux_loss + self.aux_loss_coef * load_balancing_loss(scores, g_counts, self.top_k) / replicas
        if self.router_z_loss_coef > 0:
            aux_loss = aux_loss + self.router_z_loss_coef * router_z_loss(logits)
        self._last_aux_loss = aux_loss.detach()
        if self._balance_index is not None:
            aux_loss = aux_loss + balance_part
        if not aux_loss.requires_grad:
            return out
        return AttachAuxLoss.apply(out, aux_loss, self.aux_grad_scale)
