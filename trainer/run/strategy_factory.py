"""Build the checkpoint strategy the config asks for, wired to this rank's model, layout and data.

`none`: nothing. `moevement`: the sparse checkpointer, the upstream log (pipeline boundaries) and
localized recovery (`moevement.strategy.MoEvement`). `gemini`, `checkfreq`, `moc`: the same snapshot
machinery driven by an interval policy (dense or partial checkpoints, W = 1) and a global rollback
(`baselines.strategy.IntervalBaseline`). The training loop sees only `CheckpointStrategy`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from baselines.global_rollback import GlobalRollback, MocState, RestartState
from baselines.intervals import IntervalPolicy
from baselines.moc import LostTokens, PartialExpertSelector
from baselines.strategy import IntervalBaseline
from models.experts import stacked_experts
from moevement.checkpoint.binding import CheckpointedModel, CheckpointerPlace
from moevement.checkpoint.checkpointer import SparseCheckpointer
from moevement.operators import Operator, Stacked, build_registry
from moevement.recovery.conversion import Conversion, TrainerHooks
from moevement.recovery.live_state import Rejoin, load_live_state
from moevement.recovery.localized import Recovery
from moevement.recovery.relaid_restart import RelayTarget, find_relaid_window
from moevement.recovery.relayout import DataParallel, NewPlace, sharding_of
from moevement.recovery.replay import PipelineReplay, StageRef
from moevement.recovery.restart import CheckHeader, RestartPoint, find_restart_checkpoint, snapshot_identity_check
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
from trainer.lifecycle.start_plan import StartPlan
from trainer.run.host_paths import claim_host_state, host_job_dir, host_rank_dir, persist_root
from trainer.step import DropoutSeeder, forward_backward, replay_update

RELAID_BASELINES = ("gemini", "checkfreq")  # checkpoints of every operator: re-laid in an elastic job's new layout


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


def _rejoin(rank_dir: Path, job_meta: dict, plan: StartPlan, from_dense: bool, prebuilt: str | None) -> Rejoin:
    """This process's place in the run (collective unless `from_dense`): the live state this rank kept (in
    memory when it survived a death in place, in its host directory after a torchrun restart; none at
    attempt 0, nor when the start is `from_dense`), whether any rank kept one, and what a warm standby built
    of it before its activation (`prebuilt`)."""
    name, live = plan.name(), plan.kept
    if from_dense:
        return Rejoin(name, None, False, plan.process.startup.marks, False)
    if not plan.in_place and name["attempt"] > 0:
        live, why = load_live_state(rank_dir, {**job_meta, "run_id": name["run_id"]}, name["attempt"])
        if live is None and why != "no live state":
            print(f"restart: rank {dist.get_rank()} cannot use its live state: {why}", flush=True)
    kept = torch.tensor([int(live is not None)])
    if dist.is_initialized():
        collectives.all_reduce(kept)
    marks = plan.process.startup.marks  # still being taken
    return Rejoin(name, live, bool(kept.item()), marks, plan.in_place, plan.fault, prebuilt)


def build_strategy(
    cfg: Config,
    model: ModelParts,
    optimizer,
    dims: ParallelDims,
    seeder: DropoutSeeder,
    train_batches,
    line,
    plan: StartPlan,
    dense_step: int = 0,
    prebuilt: str | None = None,
) -> CheckpointStrategy:
    """`checkpoint.strategy` on this rank (collective over all ranks).

    MoEvement first looks for a persisted sparse checkpoint of this job to restart from (a torchrun
    restart, or a relaunch of the same job) and the live state this rank kept. An elastic job
    (`parallelism.elastic`) starts every torchrun round from the dense checkpoint train.py loaded (at
    `dense_step`), or from a newer window in host memory (or in persist_dir) re-laid into the round's layout
    (`find_relaid_window`; gemini's and checkfreq's checkpoints are windows of W = 1 of every operator, so
    they re-lay the same way; MoC's partial ones do not); its in-place generations recover from sparse
    state as any job's. The rank's host directory stays as it is until training goes on
    (`MoEvement.begin`), so a death before then loses nothing. An interval baseline, after a torchrun
    restart of this run, restores its newest checkpoint (gemini's from host memory) and starts with an
    empty host directory. `prebuilt`: what a warm standby built of this rank (`trainer/run/prebuilt.py`), for
    the recovery's report."""
    strategy = cfg.checkpoint.strategy
    if strategy == "none":
        return NoCheckpointing()
    lock = claim_host_state(cfg, dist.get_rank() if dist.is_initialized() else 0, plan.process.locks)
    topo = gather_topology(dims, host_job_dir(cfg))
    rank_dir = host_rank_dir(cfg, topo.rank)
    identity = RunIdentity.of_sparse(cfg)
    job_meta = _job_meta(cfg, dims, identity, plan.run_id)
    disk = persist_root(cfg)
    from_dense = cfg.parallelism.elastic and not plan.in_place
    rejoin = _rejoin(rank_dir, job_meta, plan, from_dense, prebuilt)
    checks = _identity_checks(dims, identity, rejoin)
    found = None if from_dense else _restart_point(strategy, rank_dir, disk, checks, rejoin, line, plan.restarted)
    ops = build_registry(model.view, stacked_operators(model.view)) if strategy != "moevement" else []
    if from_dense and strategy in RELAID_BASELINES and dist.is_initialized():
        target = _relay_target(dims, topo, ops, identity, job_meta, dense_step)
        found = find_relaid_window(rank_dir.parent, target, line, _baseline_disk(cfg, strategy))
    if strategy != "moevement":
        if dist.is_initialized():
            collectives.barrier()  # every rank holds its copy before any rank clears its directory
        remove_tree(rank_dir, rank_dir.parent)  # loaded, or of no use to any restart
    new_checkpointer = _checkpointer_factory(cfg, model, optimizer, dims, rank_dir, topo, job_meta)
    if strategy != "moevement":
        restarted = plan.restarted and not from_dense or found is not None  # found, from_dense: a re-laid one
        restart = RestartState(rejoin.live, found, checks["run"], rejoin.fault) if restarted else None
        return _interval_baseline(cfg, model, dims, ops, new_checkpointer, line, lock, rejoin, restart)
    checkpointer = new_checkpointer(dataclasses.replace(cfg.checkpoint, persist_dir=str(disk or "")))
    if from_dense and dist.is_initialized():
        target = _relay_target(dims, topo, checkpointer.ops, identity, job_meta, dense_step)
        found = find_relaid_window(rank_dir.parent, target, line, disk)
    log = UpstreamLog(model.parts, model.stage_ids, model.n_stages) if cfg.parallelism.pp > 1 else None
    hooks = _trainer_hooks(cfg, model, optimizer, dims, seeder, log, topo, train_batches, line)
    recovery = _recovery(cfg, checkpointer, optimizer, topo, hooks, log, dims.device, line)
    return MoEvement(checkpointer, log, recovery, found, lock, rejoin)


def _recovery(
    cfg: Config,
    checkpointer: SparseCheckpointer,
    optimizer,
    topo: Topology,
    hooks: TrainerHooks,
    log: UpstreamLog | None,
    device: torch.device,
    line,
) -> Recovery:
    """MoEvement's recovery on this rank: localized (or, with `fault.scope` global, every stage) rollback to
    the persisted window and sparse-to-dense conversion, replaying through the trainer's `hooks`."""
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
    cfg: Config, model: ModelParts, optimizer, dims: ParallelDims, rank_dir: Path, topo: Topology, job_meta: dict
) -> Callable[..., SparseCheckpointer]:
    """`SparseCheckpointer` bound to this rank's model, layout and host directory; a strategy passes its own
    checkpoint config (and policy)."""
    state = CheckpointedModel(
        model.view, optimizer, DTYPES[cfg.training.mixed_precision], dims.device, stacked_operators(model.view)
    )
    place = CheckpointerPlace(topo, rank_dir, job_meta, _same_node_dirs(cfg), cfg.fault.timeout_s)
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


def _relay_target(
    dims: ParallelDims, topo: Topology, ops: list, identity: RunIdentity, job_meta: dict, dense_step: int
) -> RelayTarget:
    """What a window of another layout must become on this rank's operators `ops` (`find_relaid_window`)."""
    place = NewPlace(DataParallel(dims.cfg.dp, dims.cfg.ep), dims.dp_rank, topo.rank)
    sharding = sharding_of(ops)
    return RelayTarget(dims.pp_rank, place, sharding, job_meta, identity.elastic_mismatch, dense_step)


def _identity_checks(dims: ParallelDims, identity: RunIdentity, rejoin: Rejoin) -> dict[str, CheckHeader]:
    """Snapshot checks: "job" refuses another job, rank or config (a relaunch of the job passes), "run"
    also another torchrun run."""
    where = {"dp_rank": dims.dp_rank, "pp_rank": dims.pp_rank}
    return {
        "job": snapshot_identity_check(where, identity.mismatch),
        "run": snapshot_identity_check({**where, "run_id": rejoin.name["run_id"]}, identity.mismatch),
    }


def _restart_point(
    strategy: str,
    rank_dir: Path,
    disk: Path | None,
    checks: dict[str, CheckHeader],
    rejoin: Rejoin,
    line,
    restarted: bool,
) -> RestartPoint | None:
    """MoEvement: the persisted sparse checkpoint a restart or relaunch converts (in a rejoin, also a newer
    complete one that ends by the survivors' iteration); gemini, after a death in this run (`restarted`):
    its newest replicated checkpoint in host memory (collective). A rank whose process died uses its
    peers' replicas, not what its predecessor left in its own directory."""
    own = rejoin.live is not None or not rejoin.survivors
    if strategy == "moevement":
        resume_at = rejoin.live.next_iteration if rejoin.live is not None else 0
        return find_restart_checkpoint(rank_dir.parent, disk, checks["job"], line, own, resume_at)
    if strategy == "gemini" and restarted:
        return find_restart_checkpoint(rank_dir.parent, None, checks["run"], line, own_copies=own)
    return None


def _interval_baseline(
    cfg: Config,
    model: ModelParts,
    dims: ParallelDims,
    ops: list[Operator],
    new_checkpointer: Callable[..., SparseCheckpointer],
    line,
    lock: JobLock,
    rejoin: Rejoin,
    restart: RestartState | None,
) -> IntervalBaseline:
    """gemini (dense, host memory, replicated), checkfreq (dense, persisted to disk), moc (partial, disk), over
    this rank's operators `ops`.

    A new run removes this rank's disk checkpoints; a torchrun restart of the run (`restart`) resumes
    from them."""
    strategy, ck_cfg = cfg.checkpoint.strategy, cfg.checkpoint
    names = [op.name for op in ops]
    moc, keep = None, 2
    if strategy == "moc":
        moc = _moc_state(cfg, ops, dims)
        keep = math.ceil(cfg.model.n_routed_experts / moc.selector.k) + 1  # every expert's newest save stays
        select = moc.selector.next_checkpoint
    else:
        select = lambda: names  # noqa: E731  (dense: every operator)
    if strategy != "gemini":  # snapshot in host memory, then persist asynchronously to disk
        persist = _baseline_disk(cfg, strategy)
        ck_cfg = dataclasses.replace(ck_cfg, replicas=0, persist_dir=str(persist), persist_every=1)
        if restart is None:  # an earlier run's checkpoints must not be restored into this one
            for old in private_subdirs(persist, "window-", f"rank{dist.get_rank():05d}"):
                remove_tree(old, persist)
    policy = IntervalPolicy(strategy, ck_cfg.interval, expected_mtbf_iters(cfg), select)
    checkpointer = new_checkpointer(ck_cfg, policy=policy, disk_keep=keep)
    rollback = GlobalRollback(
        strategy,
        checkpointer,
        policy,
        model.n_stages,
        lambda: initial_parameters(cfg.model, dims, cfg.job.seed),
        line,
        moc,
    )
    return IntervalBaseline(checkpointer, rollback, moc, lock, rejoin, restart)


def _baseline_disk(cfg: Config, strategy: str) -> Path | None:
    """Where checkfreq and moc persist their checkpoints (`checkpoint.persist_dir`, else a folder beside the
    run records); gemini keeps them in host memory only (None)."""
    if strategy == "gemini":
        return None
    return persist_root(cfg, str(Path(cfg.job.output_dir) / f"{strategy}-checkpoints"))


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


def _trainer_hooks(
    cfg: Config,
    model: ModelParts,
    optimizer,
    dims: ParallelDims,
    seeder: DropoutSeeder,
    log: UpstreamLog | None,
    topo: Topology,
    train_batches,
    line,
) -> TrainerHooks:
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
        batch=functools.partial(train_batches.local_batch, dp_rank=dims.dp_rank, dp_size=dp),
        begin_iteration=seeder.begin,
        forward_backward=run,
        optimizer_step=functools.partial(replay_update, model, optimizer),
        initial_parameters=functools.partial(initial_parameters, cfg.model, dims, cfg.job.seed),
        line=line,
    )


def stacked_operators(model: torch.nn.Module) -> dict[str, Stacked]:
    """The model's stacked expert parameters as the operator registry sees them: each slice one expert's tensor."""
    return {name: Stacked(names, module.set_frozen) for name, (module, names) in stacked_experts(model).items()}
