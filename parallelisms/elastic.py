"""`parallelism.elastic`: the layout a job takes on the world torchrun's elastic rendezvous gives it
(`torchrun --nnodes MIN:MAX`), when a node was lost for good or came back.

The rule (Lazarus keeps every remaining GPU busy; this keeps the arithmetic of the training run):

- the pipeline (`pp`, `stages_per_rank`, `schedule`, `split_points`) and expert parallelism (`ep`) stay as
  configured: every stage and every expert group keeps its shape;
- the data-parallel degree follows the world: `dp = world / pp`;
- the micro-batches per rank follow `dp` so that every micro-batch keeps its configured rows
  (`batch_size / (micro_batches x dp)`): with half the ranks, each rank runs twice the micro-batches.

The global batch of an iteration is the same samples whatever `dp` (`trainer.data.batches`), so a run on
fewer ranks is the same training run: the same samples in the same micro-batches, the same learning-rate
schedule and optimizer state. What differs are the bits that the data-parallel reduction order decides.
A world that no layout fits is refused with one line (`ElasticError`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallelisms.mesh import ParallelismConfig


class ElasticError(ValueError):
    """No layout fits the world; the message says why, in one line."""


@dataclass(frozen=True)
class ElasticLayout:
    parallelism: ParallelismConfig  # the configured one with `dp` following the world
    micro_batches: int  # per rank and iteration


def elastic_layout(configured: ParallelismConfig, micro_batches: int, world: int) -> ElasticLayout:
    """The layout of `world` ranks under the rule above, from the configured layout and its
    `micro_batches` (per rank); ElasticError when none fits."""
    p = configured
    if world % p.pp:
        raise ElasticError(f"{world} processes cannot hold parallelism.pp = {p.pp} stages of equal width")
    dp = world // p.pp
    if dp % p.ep:
        raise ElasticError(f"{world} processes give dp = {dp} per stage, which parallelism.ep = {p.ep} does not divide")
    shares = micro_batches * p.dp  # micro-batch shares per iteration, each of the configured rows
    if shares % dp:
        raise ElasticError(
            f"dp = {dp} ranks cannot split the {shares} micro-batch shares of an iteration "
            f"(training.micro_batches x parallelism.dp = {micro_batches} x {p.dp}) evenly"
        )
    per_rank = shares // dp
    if p.pp > 1 and per_rank < p.pp:
        raise ElasticError(
            f"dp = {dp} leaves {per_rank} micro-batches per rank, fewer than the pipeline's {p.pp} stages"
        )
    if p.schedule == "Interleaved1F1B" and per_rank % p.pp:
        raise ElasticError(f"dp = {dp} leaves {per_rank} micro-batches per rank, not a multiple of pp = {p.pp}")
    return ElasticLayout(replace(p, dp=dp), per_rank)


def fitting_worlds(configured: ParallelismConfig, micro_batches: int) -> list[tuple[int, ElasticLayout]]:
    """Every world from one data-parallel group (`pp` ranks) up to the configured `pp x dp` that a layout
    fits, with its layout: the process counts an elastic job may shrink to."""
    fits = []
    for world in range(configured.pp, configured.pp * configured.dp + 1, configured.pp):
        try:
            fits.append((world, elastic_layout(configured, micro_batches, world)))
        except ElasticError:
            continue
    return fits
