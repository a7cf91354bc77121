"""Build the checkpoint strategy the config asks for, wired to this rank's model, layout and data.

`build_strategy` only wires: the strategy's registry entry (`trainer/strategy_registry.py`) names its
builder and what it can restore; `trainer/run/start_facts.py` gathers where this rank's state comes from.
The builders here: `moevement` (the sparse checkpointer, the upstream log at pipeline boundaries and
localized recovery: `moevement.strategy.MoEvement`) and the interval baselines `gemini`, `checkfreq`, `moc`
(the same snapshot machinery driven by an interval policy, dense or partial checkpoints, W = 1, and a
global rollback: `baselines.strategy.IntervalBaseline`). The training loop sees only `CheckpointStrategy`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from baselines.global_rollback import GlobalRollback, MocState, RestartState
from baselines.intervals import IntervalPolicy
from baselines.moc import LostTokens, PartialExpertSelector
from baselines.strategy import IntervalBaseline
from moevement.checkpoint.binding import CheckpointedModel, CheckpointerPlace
from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.operators import Operator, build_registry
from moevement.recovery.conversion import Conversion, TrainerHooks
from moevement.recovery.localized import Recovery
from moevement.recovery.replay import PipelineReplay, StageRef
from moevement.recovery.start_source import Source
from moevement.recovery.upstream_log import UpstreamLog
from moevement.storage.host_memory import JobLock, private_subdirs, remove_tree
from moevement.strategy import CheckpointStrategy, MoEvement, NoCheckpointing
from moevement.topology import Topology
from parallelisms import collectives
from parallelisms.fsdp import DTYPES
from parallelisms.mesh import ParallelDims
from parallelisms.parallelize import ModelParts, initial_parameters
from parallelisms.pipeline import local_stage_ids
from trainer.checkpoint.identity import RunIdentity
from trainer.config import Config, expected_mtbf_iters
from trainer.lifecycle.host_dirs import host_job_dir, host_rank_dir
from trainer.lifecycle.start_plan import StartPlan
from trainer.model_operators import stacked_operators
from trainer.run.host_paths import claim_host_state, persist_root
from trainer.run.start_facts import RankPlace, Restorable, StartPoint, gather_start
from trainer.step import DropoutSeeder, forward_backward, replay_update
from trainer.strategy_registry import StrategyEntry, strategy_entry


def gather_topology(dims: ParallelDims, host_dir: Path) -> Topology:
    """Every rank's pipeline rank, data-parallel rank and node (collective over all ranks).

    A node is a host and its shared-memory directory `host_dir`: ranks of one node reach each other's
    snapshot buffers by path (two launches on one host with different directories are two nodes)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Topology.single(local_stage_ids(dims.cfg, 0))
    gathered: list = [None] * dist.get_world_size()
    node = f"{socket.gethostname()}:{host_dir.resolve()}"
    collectives.all_gather_object(gathered, (dims.pp_rank, dims.dp_rank, node))
    hosts = list(dict.fromkeys(host for _, _, host in gathered))
    return Topology(
        dist.get_rank(),
        [p for p, _, _ in gathered],
        [d for _, d, _ in gathered],
        [hosts.index(h) for _, _, h in gathered],
        [local_stage_ids(dims.cfg, p) for p in range(dims.cfg.pp)],
    )


def _same_node_dirs(cfg: Config):
    """Where the ranks of this node keep host state, for shared-memory replication (None: network only)."""
    return (lambda rank: host_rank_dir(cfg, rank)) if cfg.checkpoint.replication == "auto" else None


RESTARTS_FROM = (Source.HOST_CHECKPOINT, Source.DISK_CHECKPOINT, Source.RELAID_WINDOW)  # a global rollback's


@dataclass(frozen=True)
class TrainingParts:
    """This rank's training as setup built it: what a strategy snapshots, replays and restores."""

    model: ModelParts
    optimizer: torch.optim.Optimizer
    dims: ParallelDims
    seeder: DropoutSeeder
    train_batches: object  # TokenBatches (None where no recovery replays)


@dataclass(frozen=True)
class StrategyWiring:
    """What a strategy's builder (`trainer/strategy_registry.py`) is given: this rank's training, its place,
    its host state and where its state comes from (`start`)."""

    cfg: Config
    model: ModelParts
    optimizer: torch.optim.Optimizer
    seeder: DropoutSeeder
    train_batches: object  # TokenBatches
    line: Callable
    place: RankPlace
    lock: JobLock
    disk: Path | None  # where the strategy persists (its entry's `persists`)
    start: StartPoint
    new_checkpointer: Callable[..., SparseCheckpointer]  # takes the strategy's checkpoint config (and policy)

    def operators(self) -> list[Operator]:
        """This rank's operators, as the checkpointer registers them."""
        return build_registry(self.model.view, stacked_operators(self.model.view))

    def initial_parameters(self) -> dict:
        """The seed's initial parameters of this rank's model parts (what a never-saved operator restarts from)."""
        return initial_parameters(self.cfg.model, self.place.dims, self.cfg.job.seed)

    def restart_state(self) -> RestartState | None:
        """What a global rollback restarts from (`GlobalRollback.restart`) when the start's source is a
        checkpoint (`RESTARTS_FROM`), else None: a new run goes on from train.py's start."""
        start = self.start
        if start.source not in RESTARTS_FROM:
            return None
        return RestartState(start.rejoin.live, start.found, start.checks["run"], start.rejoin.fault)

    def clear_rank_dir(self) -> None:
        """Once every rank holds what it restores from, empty this rank's host directory: a global rollback's
        restart never reads it again (collective)."""
        if dist.is_initialized():
            collectives.barrier()  # every rank holds its copy before any rank clears its directory
        remove_tree(self.place.rank_dir, self.place.rank_dir.parent)


def build_strategy(
    cfg: Config, parts: TrainingParts, line, plan: StartPlan, dense_step: int = 0, prebuilt: str | None = None
) -> CheckpointStrategy:
    """`checkpoint.strategy` on this rank (collective over all ranks): wires its registry entry's builder to
    this rank's model, place and start. Where the state comes from is gathered and chosen in
    `trainer/run/start_facts.py` (`dense_step`: the dense checkpoint train.py loaded, 0 for none); the rank's
    host directory stays as it is until training goes on, so a death before then loses nothing.
    `prebuilt`: what a warm standby built of this rank (`trainer/run/prebuilt.py`), for the recovery's report."""
    entry = strategy_entry(cfg.checkpoint.strategy)
    model, dims = parts.model, parts.dims
    if not entry.recovers:
        return NoCheckpointing()
    lock = claim_host_state(cfg, dist.get_rank() if dist.is_initialized() else 0, plan.process.locks)
    topo = gather_topology(dims, host_job_dir(cfg))
    identity = RunIdentity.of_sparse(cfg)
    rank_dir = host_rank_dir(cfg, topo.rank)
    place = RankPlace(dims, topo, rank_dir, identity, _job_meta(cfg, dims, identity, plan.run_id))
    disk = _disk(cfg, entry)
    ops = lambda: build_registry(model.view, stacked_operators(model.view))  # noqa: E731  (a re-lay's target)
    restorable = Restorable(entry.restores, disk, ops)
    start = gather_start(place, plan, cfg.parallelism.elastic, restorable, dense_step, line, prebuilt)
    timeout_s = plan.process.bounds.timeout_s
    new_checkpointer = _checkpointer_factory(cfg, parts, rank_dir, topo, place.job_meta, timeout_s)
    wiring = StrategyWiring(
        cfg, model, parts.optimizer, parts.seeder, parts.train_batches, line, place, lock, disk, start, new_checkpointer
    )
    return entry.builder()(wiring)


def build_moevement(w: StrategyWiring) -> MoEvement:
    """MoEvement: the sparse checkpointer (persisting to `checkpoint.persist_dir`), the upstream log at
    pipeline boundaries and localized recovery; it restores from `w.start` in `resume`."""
    cfg, model = w.cfg, w.model
    checkpointer = w.new_checkpointer(dataclasses.replace(cfg.checkpoint, persist_dir=str(w.disk or "")))
    log = UpstreamLog(model.parts, model.stage_ids, model.n_stages) if cfg.parallelism.pp > 1 else None
    recovery = _recovery(w, checkpointer, _trainer_hooks(w, log), log)
    return MoEvement(checkpointer, log, recovery, w.lock, w.start.source, w.start.found, w.start.rejoin)


def _recovery(
    w: StrategyWiring, checkpointer: SparseCheckpointer, hooks: TrainerHooks, log: UpstreamLog | None
) -> Recovery:
    """MoEvement's recovery on this rank: localized (or, with `fault.scope` global, every stage) rollback to
    the persisted window and sparse-to-dense conversion, replaying through the trainer's `hooks`."""
    cfg, topo, optimizer, device, line = w.cfg, w.place.topo, w.optimizer, w.place.dims.device, w.line
    conversion = Conversion(
        checkpointer,
        optimizer,
        topo,
        hooks,
        log,
        device,
        threads=cfg.fault.replay_threads,
        frozen_weight_grad=cfg.fault.frozen_weight_grad,
    )
    return Recovery(
        checkpointer,
        log,
        topo,
        cfg.training.micro_batches,
        conversion,
        line,
        global_rollback=cfg.fault.scope == "global",
    )


def _checkpointer_factory(
    cfg: Config, parts: TrainingParts, rank_dir: Path, topo: Topology, job_meta: dict, timeout_s: float
) -> Callable[..., SparseCheckpointer]:
    """`SparseCheckpointer` bound to this rank's model, layout and host directory (its replication group
    bounded by `timeout_s`, the process's `FaultBounds`); a strategy passes its own checkpoint config (and
    policy)."""
    model, dtype = parts.model, DTYPES[cfg.training.mixed_precision]
    state = CheckpointedModel(model.view, parts.optimizer, dtype, parts.dims.device, stacked_operators(model.view))
    place = CheckpointerPlace(topo, rank_dir, job_meta, _same_node_dirs(cfg), timeout_s)
    return functools.partial(SparseCheckpointer, state=state, place=place)


def _job_meta(cfg: Config, dims: ParallelDims, identity: RunIdentity, run_id: str) -> dict:
    """What every snapshot and live state of this rank carries: the job, the rank's place and the run."""
    return {
        "seed": cfg.job.seed,
        "dp_rank": dims.dp_rank,
        "pp_rank": dims.pp_rank,
        "layout": {"dp": dims.cfg.dp, "ep": dims.cfg.ep},  # what a window of an elastic job is re-laid from
        "run": identity.to_json(),
        "run_id": run_id,
        "rng": "dropout seed = derive_seed(seed, iteration, micro-batch, stage, dp_rank)",
    }


def build_interval_baseline(w: StrategyWiring) -> IntervalBaseline:
    """gemini (dense, host memory, replicated), checkfreq (dense, persisted to disk), moc (partial, disk), over
    this rank's operators: an interval policy and a global rollback, restoring from `w.start` in `resume`.

    The rank's host directory is cleared first (what a start restores from is loaded). A new run removes this
    rank's disk checkpoints; a restart of the run (`restart`) resumes from them."""
    cfg, strategy, ck_cfg = w.cfg, w.cfg.checkpoint.strategy, w.cfg.checkpoint
    w.clear_rank_dir()
    ops = w.operators()
    names = [op.name for op in ops]
    moc, keep = None, 2
    if strategy == "moc":
        moc = _moc_state(cfg, ops, w.place.dims)
        keep = math.ceil(cfg.model.n_routed_experts / moc.selector.k) + 1  # every expert's newest save stays
        select = moc.selector.next_checkpoint
    else:
        select = lambda: names  # noqa: E731  (dense: every operator)
    restart = w.restart_state()
    if w.disk is not None:  # snapshot in host memory, then persist asynchronously to disk
        ck_cfg = dataclasses.replace(ck_cfg, replicas=0, persist_dir=str(w.disk), persist_every=1)
        if restart is None:  # an earlier run's checkpoints must not be restored into this one
            drop_disk_checkpoints(w.disk)
    policy = IntervalPolicy(strategy, ck_cfg.interval, expected_mtbf_iters(cfg), select)
    checkpointer = w.new_checkpointer(ck_cfg, policy=policy, disk_keep=keep)
    rollback = GlobalRollback(strategy, checkpointer, policy, w.model.n_stages, w.initial_parameters, w.line, moc)
    return IntervalBaseline(checkpointer, rollback, moc, w.lock, w.start.rejoin, restart)


def drop_disk_checkpoints(disk: Path) -> None:
    """Remove this rank's checkpoints of an earlier run from `disk`: a new run must not restore them."""
    for old in private_subdirs(disk, "window-", f"rank{dist.get_rank():05d}"):
        remove_tree(old, disk)


def _disk(cfg: Config, entry: StrategyEntry) -> Path | None:
    """Where `entry`'s strategy persists: `checkpoint.persist_dir`, else (`beside_records`) a folder beside the
    run records; None: host memory only."""
    if entry.persists == "nowhere":
        return None
    default = str(Path(cfg.job.output_dir) / f"{entry.name}-checkpoints") if entry.persists == "beside_records" else ""
    return persist_root(cfg, default)


def _moc_state(cfg: Config, ops: list, dims: ParallelDims) -> MocState:
    """MoC's partial expert selection over this rank's operators and its lost-token accounting."""
    m, ck_cfg = cfg.model, cfg.checkpoint
    moe_layers = [layer for layer in range(m.n_layers) if m.is_moe_layer(layer)]
    selector = PartialExpertSelector(ops, moe_layers, m.n_routed_experts, cfg.parallelism.ep, ck_cfg.moc_experts)
    return MocState(
        selector,
        LostTokens(),
        ck_cfg.moc_plt_threshold,
        dims.dp_rank < cfg.parallelism.ep,
        experts={op.name for op in ops if op.kind == "expert"},
    )


def _trainer_hooks(w: StrategyWiring, log: UpstreamLog | None) -> TrainerHooks:
    """How a replay runs the trainer's iteration on this rank: its batches, dropout seeds, forward and
    backward (through the pipeline's logs where there are stages), optimizer step and initial parameters."""
    cfg, model, dims, topo = w.cfg, w.model, w.place.dims, w.place.topo
    micro, dp = cfg.training.micro_batches, cfg.parallelism.dp

    if model.schedule is not None:
        stages = {
            s: StageRef(part, stage, *model.stage_shapes(s))
            for s, part, stage in zip(model.stage_ids, model.parts, model.pipeline_stages)
        }
        replay = PipelineReplay(
            stages,
            model.n_stages,
            micro,
            lambda s: topo.rank_of(topo.owner_pp(s), dims.dp_rank),
            log,
            model.loss_fn,
            dims.device,
        )
        run = replay.forward_backward
    else:

        def run(t, scope, inputs, labels, boundary):
            forward_backward(model, inputs.to(dims.device), labels.to(dims.device), micro)

    return TrainerHooks(
        batch=functools.partial(w.train_batches.local_batch, dp_rank=dims.dp_rank, dp_size=dp),
        begin_iteration=w.seeder.begin,
        forward_backward=run,
        optimizer_step=functools.partial(replay_update, model, w.optimizer),
        initial_parameters=functools.partial(initial_parameters, cfg.model, dims, cfg.job.seed),
        line=w.line,
    )
