"""The one place a starting rank gathers where its state may come from (`moevement.recovery.start_source`).

It reads the live state this rank kept (in memory in place; in its host directory after a torchrun restart),
looks for the strategy's persisted sparse window, its newest replicated checkpoint in host memory or a
window to re-lay into an elastic round's layout (each only where `start_source.surveys` says so), takes the
dense checkpoint train.py loaded as a fact, and lets `start_source.choose` pick the source. Collective over
all ranks (every survey is: the same surveys run on every rank, since the table's inputs agree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moevement.operators import Operator
from moevement.recovery.live_state import Rejoin, load_live_state
from moevement.recovery.relaid_restart import RelayTarget, find_relaid_window
from moevement.recovery.relayout import DataParallel, NewPlace, sharding_of
from moevement.recovery.restart import CheckHeader, RestartPoint, find_restart_checkpoint, snapshot_identity_check
from moevement.recovery.start_source import Facts, Source, Survey, choose, surveys, why_it_starts
from moevement.topology import Topology
from parallelisms import collectives
from parallelisms.mesh import ParallelDims
from trainer.checkpoint.identity import RunIdentity
from trainer.lifecycle.start_plan import StartPlan


@dataclass(frozen=True)
class StartPoint:
    """Where this rank's state comes from (`source`) and what was found for it."""

    source: Source
    rejoin: Rejoin  # this process's place in the run and the live state it kept (if any)
    found: RestartPoint | None  # the window or checkpoint found for `source` (None: none found or none needed)
    checks: dict[str, CheckHeader]  # "job" refuses a snapshot of another job, rank or config; "run" also another run


@dataclass(frozen=True)
class RankPlace:
    """This rank in the job: its layout, node topology, host directory and the meta its state carries."""

    dims: ParallelDims
    topo: Topology
    rank_dir: Path
    identity: RunIdentity
    job_meta: dict


@dataclass(frozen=True)
class Restorable:
    """What a strategy can start from: the sources it `restores`, where it persists (`disk`; None: host memory
    only) and its operators (`operators()`: what a re-laid window must fit, built only where one is sought)."""

    restores: frozenset[Source]
    disk: Path | None
    operators: Callable[[], list[Operator]]


def gather_start(
    place: RankPlace,
    plan: StartPlan,
    elastic: bool,
    strategy: Restorable,
    dense_step: int,
    line,
    prebuilt: str | None = None,
) -> StartPoint:
    """This rank's start: the facts `surveys` asks for of a `strategy` that can restore what it says, then
    `choose`'s source. Collective."""
    restores, disk = strategy.restores, strategy.disk
    why = why_it_starts(plan.attempt, plan.generation, elastic)
    survey = surveys(why, restores)
    rejoin = _rejoin(place.rank_dir, place.job_meta, plan, survey.live_state, prebuilt)
    checks = _identity_checks(place.dims, place.identity, rejoin)
    found = _restart_point(survey, place.rank_dir, disk, checks, rejoin, line)
    if survey.relaid_window and dist.is_initialized():
        found = find_relaid_window(
            place.rank_dir.parent, _relay_target(place, strategy.operators(), dense_step), line, disk
        )
    facts = Facts(
        survivors=rejoin.survivors,
        persisted_window=survey.persisted_window and found is not None,
        relaid_window=survey.relaid_window and found is not None,
        dense_checkpoint=dense_step > 0,
    )
    return StartPoint(choose(why, facts, restores), rejoin, found, checks)


def _rejoin(rank_dir: Path, job_meta: dict, plan: StartPlan, look: bool, prebuilt: str | None) -> Rejoin:
    """This process's place in the run (collective if it `look`s for live state): the live state this rank
    kept (in memory when it survived a death in place, in its host directory after a torchrun restart; none
    at attempt 0), whether any rank kept one, and what a warm standby built of it before its activation."""
    name, live = plan.name(), plan.kept
    if not look:
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


def _identity_checks(dims: ParallelDims, identity: RunIdentity, rejoin: Rejoin) -> dict[str, CheckHeader]:
    """Snapshot checks: "job" refuses another job, rank or config (a relaunch of the job passes), "run"
    also another torchrun run."""
    where = {"dp_rank": dims.dp_rank, "pp_rank": dims.pp_rank}
    return {
        "job": snapshot_identity_check(where, identity.mismatch),
        "run": snapshot_identity_check({**where, "run_id": rejoin.name["run_id"]}, identity.mismatch),
    }


def _restart_point(
    survey: Survey, rank_dir: Path, disk: Path | None, checks: dict[str, CheckHeader], rejoin: Rejoin, line
) -> RestartPoint | None:
    """The persisted sparse window a restart or relaunch converts (in a rejoin, also a newer complete one that
    ends by the survivors' iteration), or the newest replicated checkpoint in host memory after a death in
    this run (collective where `survey` looks). A rank whose process died uses its peers' replicas, not what
    its predecessor left in its own directory."""
    own = rejoin.live is not None or not rejoin.survivors
    if survey.persisted_window:
        resume_at = rejoin.live.next_iteration if rejoin.live is not None else 0
        return find_restart_checkpoint(rank_dir.parent, disk, checks["job"], line, own, resume_at)
    if survey.host_checkpoint:
        return find_restart_checkpoint(rank_dir.parent, None, checks["run"], line, own_copies=own)
    return None


def _relay_target(place: RankPlace, ops: list[Operator], dense_step: int) -> RelayTarget:
    """What a window of another layout must become on this rank's operators `ops` (`find_relaid_window`)."""
    dims = place.dims
    new_place = NewPlace(DataParallel(dims.cfg.dp, dims.cfg.ep), dims.dp_rank, place.topo.rank)
    return RelayTarget(
        dims.pp_rank, new_place, sharding_of(ops), place.job_meta, place.identity.elastic_mismatch, dense_step
    )
