"""Turn a model description into this rank's parallel model parts.

Order: build on meta -> cut pipeline stages -> keep this rank's experts -> materialise
and initialise (each parameter's init depends only on the seed and its global name, so
every layout starts from the same weights) -> activation checkpointing -> torch.compile -> FSDP2 ->
pipeline schedule (TorchTitan's order).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from models import ModelArgs, Transformer
from models.experts import named_tensors
from parallelisms.activation_checkpoint import apply_activation_checkpoint
from parallelisms.compile import apply_compile
from parallelisms.expert_parallel import apply_expert_parallel, shard_moe_experts
from parallelisms.fsdp import DTYPES, apply_fsdp
from parallelisms.mesh import ParallelDims, ParallelismConfig
from parallelisms.pipeline import build_schedule, split_model
from parallelisms.precision import cpu_has_native_bf16, use_fp32_gemm


@dataclass
class ModelParts:
    """What one rank trains: its pipeline stage modules and how to drive them."""

    parts: list[nn.Module]  # one module per local pipeline stage
    stage_ids: list[int]
    view: nn.Module  # all local parameters under their global names (state dicts, digests)
    schedule: object | None  # torch.distributed.pipelining schedule when pp > 1
    n_stages: int
    pipeline_stages: list = field(default_factory=list)  # the schedule's PipelineStage per local stage
    stage_shapes: object = None  # stage id -> example (input, output) tensors on meta

    @property
    def loss_fn(self):
        """(last stage's output, labels) -> mean cross-entropy: the last stage's ``Transformer.loss``."""
        return self.parts[self.stage_ids.index(self.n_stages - 1)].loss if self.has_last_stage else None

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids


class ModelView(nn.Module):
    """Several stage modules of one model seen under the whole model's parameter names."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict()
        for part in parts:
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(part, name, None) is not None:
                    setattr(self, name, getattr(part, name))
            self.layers.update(part.layers)


@dataclass
class MaterializedStages:
    """One pipeline rank's stage modules, materialised on `device` and initialised from the seed, before any
    process group is bound to them (`materialize_stages`); `parallelize` takes them on from there."""

    stage_ids: list[int]
    parts: list[nn.Module]
    pp_rank: int
    ep_rank: int  # the expert-parallel coordinate whose routed experts the parts hold
    device: torch.device
    rng_state: torch.Tensor  # the CPU generator's state once the last part was initialised


def materialize_stages(
    args: ModelArgs,
    cfg: ParallelismConfig,
    pp_rank: int,
    ep_rank: int,
    seed: int,
    device: torch.device,
    loss_chunk_tokens: int = 0,
) -> MaterializedStages:
    """The stages pipeline rank `pp_rank` runs, holding expert-parallel rank `ep_rank`'s routed experts (of
    `cfg.ep`), materialised on `device` and initialised. Needs no process group: a rank shell's warm standby
    builds them before it joins the job (`trainer/run/prebuilt.py`)."""
    args.validate()
    with torch.device("meta"):
        whole = Transformer(args)
    stage_ids, parts = split_model(whole, cfg, pp_rank)
    for part in parts:
        part.loss_chunk_tokens = loss_chunk_tokens
        if cfg.ep > 1:
            shard_moe_experts(part, ep_rank, cfg.ep)
        part.to_empty(device=device)
        torch.manual_seed(seed)
        part.init_weights()
    return MaterializedStages(stage_ids, parts, pp_rank, ep_rank, device, torch.get_rng_state())


@dataclass(frozen=True)
class BuildOptions:
    """How `parallelize` builds a rank's parts: the training config's model-building keys.

    `cpu_bf16_gemm` (auto | native | fp32): how bf16 products run on CPU (`parallelisms.precision`).
    `loss_chunk_tokens` > 0: the last stage returns normalised hidden states and its loss forms the logits
    that many tokens at a time (`Transformer.loss`).
    `activation_checkpoint` (none | full | selective): which blocks recompute their forward in backward
    (`parallelisms.activation_checkpoint`); `compile_blocks`: torch.compile the blocks' dense parts
    (`parallelisms.compile`)."""

    seed: int
    micro_batch_shape: tuple[int, int]  # (sequences, tokens) of one micro-batch on one data-parallel rank
    micro_batches: int
    mixed_precision: str = "fp32"
    cpu_bf16_gemm: str = "auto"
    loss_chunk_tokens: int = 0
    activation_checkpoint: str = "none"
    compile_blocks: bool = False


def parallelize(
    args: ModelArgs, dims: ParallelDims, opts: BuildOptions, stages: MaterializedStages | None = None
) -> ModelParts:
    """Build this rank's parts of the model described by `args` in the layout `dims` (on `dims.device`), as
    `opts` says. `stages`: this rank's stages as `materialize_stages` built them for the same arguments (the
    CPU generator is then left in the state their initialisation left it in, as if built here); None: built
    here."""
    cfg, device, precision = dims.cfg, dims.device, opts.mixed_precision
    if stages is None:
        stages = materialize_stages(args, cfg, dims.pp_rank, dims.ep_rank, opts.seed, device, opts.loss_chunk_tokens)
    else:
        torch.set_rng_state(stages.rng_state)
    stage_ids, parts = stages.stage_ids, stages.parts
    for part in parts:
        apply_expert_parallel(part, dims.group("ep") if cfg.ep > 1 else None, dims.group("dp") if cfg.dp > 1 else None)
        apply_activation_checkpoint(part, opts.activation_checkpoint)
        if opts.compile_blocks:
            apply_compile(part)
        if cfg.dp > 1 or precision != "fp32":
            apply_fsdp(part, dims, precision)
        if (
            device.type == "cpu"
            and precision != "fp32"
            and (opts.cpu_bf16_gemm == "fp32" or (opts.cpu_bf16_gemm == "auto" and not cpu_has_native_bf16()))
        ):
            use_fp32_gemm(part)
    n_stages = cfg.pp * cfg.stages_per_rank
    shapes = stage_shapes(args, opts.micro_batch_shape, DTYPES[precision], n_stages, opts.loss_chunk_tokens > 0)
    view = parts[0] if len(parts) == 1 else ModelView(parts)
    model = ModelParts(parts, stage_ids, view, None, n_stages, [], shapes)
    if cfg.pp > 1:
        model.schedule, model.pipeline_stages = build_schedule(
            parts, stage_ids, dims, opts.micro_batches, device, shapes, model.loss_fn
        )
    return model


def initial_parameters(args: ModelArgs, dims: ParallelDims, seed: int) -> dict[str, torch.Tensor]:
    """The initial (full, unsharded) value of every parameter of this rank's stages, by global name
    (each expert's slice of a stacked expert weight under its own name).

    Rebuilt from the seed exactly as `parallelize` initialises them: what a replacement rank
    rolls back to when no checkpoint is persisted yet."""
    every_expert = dataclasses.replace(dims.cfg, ep=1)
    stages = materialize_stages(args, every_expert, dims.pp_rank, 0, seed, torch.device("cpu"))
    return {name: t.detach() for part in stages.parts for name, t in named_tensors(part)}


def stage_shapes(
    args: ModelArgs, micro_batch_shape: tuple[int, int], compute_dtype: torch.dtype, n_stages: int, hidden_out: bool
):
    """(inputs, outputs) example tensors on meta for stage s: tokens or hidden states in, hidden states or
    logits out (the last stage's normalised hidden states when its loss forms the logits: `hidden_out`)."""
    b, s = micro_batch_shape

    def shapes(stage: int):
        meta = torch.device("meta")
        first, last = stage == 0, stage == n_stages - 1
        inputs = (
            torch.empty(b, s, dtype=torch.long, device=meta)
            if first
            else torch.empty(b, s, args.dim, dtype=compute_dtype, device=meta, requires_grad=True)
        )
        outputs = (
            torch.empty(b, s, args.vocab_size, dtype=torch.float32, device=meta, requires_grad=True)
            if last and not hidden_out
            else torch.empty(b, s, args.dim, dtype=compute_dtype, device=meta, requires_grad=True)
        )
        return inputs, outputs

    return shapes
