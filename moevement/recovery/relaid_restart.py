"""The newest sparse window an elastic job can restart from in its new layout (collective;
docs/design/lifecycle/elastic.md).

At the first start of every torchrun round of an elastic job (`parallelism.elastic`) the world may have
changed size. Every rank looks in its node's host memory for the job's windows: each rank directory's own
buffers (`rank<r>/local`) and the replicas it holds for peers (`rank<q>/replicas/from<r>`), then in
`checkpoint.persist_dir` (`window-<t0>/rank<r>`) if the job writes one, which a whole lost job still has.
The headers name each window's old coordinates (`pp_rank`, `dp_rank`) and layout (`layout`). A window
counts if it is persisted (no newer than the newest start any manifest records, or written to persist_dir)
and ends after the dense checkpoint the start loaded. The ranks agree on the newest window of which every
part each rank needs (`old_ranks_needed`) is on some node, then try it: each rank loads the parts its node
(or the persist_dir it sees) holds, receives the others from a rank of
a node that holds them, verifies checksums and the run (`RunIdentity.elastic_mismatch`: `dp` and
micro-batches may differ, a micro-batch's rows may not) and re-lays them (`relaid_window`). If any rank
fails, every rank tries the next older window, then keeps the dense checkpoint.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from moevement.recovery.relayout import DataParallel, NewPlace, Sharded, Slot, old_ranks_needed, relaid_window
from moevement.recovery.restart import (
    REJECTS,
    CheckHeader,
    RestartPoint,
    host_windows,
    load_host,
    receive_window,
    reject,
    send_window,
    snapshot_identity_check,
)
from moevement.storage.host_memory import read_header
from moevement.storage.private_files import HostMemoryError, check_private
from moevement.storage.snapshot import SnapshotError, SnapshotHeader
from parallelisms import collectives

Part = tuple[int, int]  # an old rank's (pp_rank, dp_rank)
Copy = tuple[str, list[Path]]  # a copy of a part on this node: where (`rank<q>/replicas/from<r>`), buffers by slot
PERSIST_DIR = "persist_dir"  # how a copy's `where` names a persisted window on disk


@dataclass(frozen=True, order=True)
class WindowOf:
    """A window of some layout: its start, its W and the data-parallel layout it was taken in."""

    start: int
    window_size: int
    dp: int
    ep: int


@dataclass
class NodeSurvey:
    """The job's windows in this node's host memory: {window: {part: copies, each its buffer paths by slot}}."""

    copies: dict[WindowOf, dict[Part, list[Copy]]] = field(default_factory=lambda: defaultdict(dict))
    durable: set[WindowOf] = field(default_factory=set)  # windows with a part in persist_dir: persisted
    persisted: int = -1  # the newest window start a manifest here records
    index: int = -1  # the newest window index a manifest here records
    newest_iteration: int = 0


@dataclass(frozen=True)
class RelayTarget:
    """What the new layout asks of a window: this rank's place, its model's sharding, its snapshots' `meta`, the
    run check (`elastic_mismatch` of this run's identity) and the dense step the start loaded."""

    pp_rank: int
    place: NewPlace
    sharding: dict[str, Sharded]
    meta: dict
    run_mismatch: Callable[[object], list[str]]
    dense_step: int


def find_relaid_window(
    job_dir: Path, target: RelayTarget, line: Callable[[str], None], disk: Path | None = None
) -> RestartPoint | None:
    """The newest window of this job that every rank can re-lay into the new layout, from host memory or
    from `disk` (`<persist_dir>/<job>`), re-laid (collective over all ranks); None when there is none, with
    a line when some window was found."""
    started, rank = time.perf_counter(), dist.get_rank()
    survey = survey_node(rank, job_dir, disk)
    gathered: list = [None] * dist.get_world_size()
    held = {key: sorted(parts) for key, parts in survey.copies.items()}
    mine = (survey.persisted, survey.index, survey.newest_iteration, held, sorted(survey.durable))
    collectives.all_gather_object(gathered, mine)
    holders: dict[WindowOf, dict[Part, list[int]]] = defaultdict(lambda: defaultdict(list))
    for holder, (_, _, _, windows, _) in enumerate(gathered):
        for key, parts in windows.items():
            for part in parts:
                holders[key][part].append(holder)
    persisted = max(g[0] for g in gathered)
    durable = {key for g in gathered for key in g[4]}
    where = "host memory" if disk is None else "host memory or persist_dir"
    for key in _candidates(holders, persisted, durable, target):
        relaid, sources = _relay(rank, key, survey, holders[key], target)
        if all(sources):
            line(
                f"restart: re-laid window {key.start} (W={key.window_size}) of dp={key.dp} into "
                f"dp={target.place.layout.dp} from {_kinds(sources)}"
            )
            index = max(g[1] for g in gathered) + 1
            last = max(g[2] for g in gathered)
            seconds = time.perf_counter() - started
            return RestartPoint(key.start, key.window_size, relaid, sources, last, seconds, index, relaid=True)
        line(f"restart: window {key.start} of dp={key.dp} cannot be re-laid on every rank; trying an older one")
    if holders:
        line(
            f"restart: no window in {where} re-lays into dp={target.place.layout.dp} past step "
            f"{target.dense_step}; resuming from the dense checkpoint"
        )
    return None


def _kinds(sources: list[str]) -> str:
    """Where every rank's parts came from: host memory, persist_dir, or both."""
    disk = [PERSIST_DIR in source for source in sources]
    return "persist_dir" if all(disk) else "host memory and persist_dir" if any(disk) else "host memory"


def survey_node(rank: int, job_dir: Path, disk: Path | None = None) -> NodeSurvey:
    """Every complete window of the job in this node's host memory, then in `disk` (a persist_dir's job
    directory), by its layout and old coordinates."""
    survey = NodeSurvey()
    for rank_dir in sorted(job_dir.glob("rank*[0-9]")):
        try:
            manifest = read_header(rank_dir / "persisted")
            if manifest is not None:
                survey.persisted = max(survey.persisted, int(manifest["window_start"]))
                survey.index = max(survey.index, int(manifest["window_index"]))
        except REJECTS as e:
            reject(rank, str(rank_dir / "persisted.json"), e)
        for directory in [rank_dir / "local", *sorted((rank_dir / "replicas").glob("from*[0-9]"))]:
            found = host_windows(rank, directory)
            survey.newest_iteration = max(survey.newest_iteration, found.newest_iteration)
            where = str(directory.relative_to(job_dir))
            for paths in found.windows.values():
                placed = _placed(rank, paths[0])
                if placed is not None:
                    survey.copies[placed[0]].setdefault(placed[1], []).append((where, paths))
    for rank_dir in sorted(disk.glob("window-*[0-9]/rank*[0-9]")) if disk is not None else []:
        _survey_disk(rank, disk, rank_dir, survey)
    return survey


def _survey_disk(rank: int, disk: Path, rank_dir: Path, survey: NodeSurvey) -> None:
    """One old rank's persisted window (`window-<t0>/rank<r>`: `s<slot>.{json,bin}`, written whole, then renamed
    into place) into `survey`, if its directory is this user's, owner-only, and its slots are all there."""
    try:
        check_private(rank_dir)
    except (HostMemoryError, OSError) as e:
        reject(rank, str(rank_dir), e)
        return
    slots = sorted(int(p.stem[1:]) for p in rank_dir.glob("s*.json") if p.stem[1:].isdigit())
    paths = [rank_dir / f"s{slot}" for slot in slots]
    placed = _placed(rank, paths[0]) if paths else None
    if placed is not None and slots == list(range(placed[0].window_size)):
        survey.copies[placed[0]].setdefault(placed[1], []).append(
            (f"{PERSIST_DIR} {rank_dir.relative_to(disk)}", paths)
        )
        survey.durable.add(placed[0])


def _placed(rank: int, first_slot: Path) -> tuple[WindowOf, Part] | None:
    """The window and old coordinates a slot's header names (None: a window that does not say its layout)."""
    try:
        header = read_header(first_slot)
        meta, layout = header["meta"], header["meta"].get("layout")
        if layout is None:
            return None
        key = WindowOf(int(header["window_start"]), int(header["window"]), int(layout["dp"]), int(layout["ep"]))
        return key, (int(meta["pp_rank"]), int(meta["dp_rank"]))
    except REJECTS as e:
        reject(rank, str(first_slot.with_suffix(".json")), e)
        return None


def _candidates(
    holders: dict[WindowOf, dict[Part, list[int]]], persisted: int, durable: set[WindowOf], target: RelayTarget
) -> list[WindowOf]:
    """Windows to try, newest first: persisted (by a manifest, or `durable`: in persist_dir), newer than the
    dense step, of this `ep`, with every part each rank needs held on some node or disk (collective: every
    rank's needs count)."""
    new = target.place.layout
    usable = []
    for key in sorted(holders, reverse=True):
        if (key.start > persisted and key not in durable) or key.start + key.window_size - 1 <= target.dense_step:
            continue
        if key.ep != new.ep or key.dp % key.ep:
            continue
        needed = old_ranks_needed(target.sharding, target.place, DataParallel(key.dp, key.ep))
        if all((target.pp_rank, d) in holders[key] for d in needed):
            usable.append(key)
    gathered: list = [None] * dist.get_world_size()
    collectives.all_gather_object(gathered, usable)
    common = set.intersection(*(set(keys) for keys in gathered))
    return sorted(common, reverse=True)


def _relay(
    rank: int, key: WindowOf, survey: NodeSurvey, holders: dict[Part, list[int]], target: RelayTarget
) -> tuple[list[Slot], list]:
    """Window `key` re-laid on every rank (collective): this rank's slots, and every rank's sources (None
    where a rank could not get its parts)."""
    old = DataParallel(key.dp, key.ep)
    needed = [(target.pp_rank, d) for d in old_ranks_needed(target.sharding, target.place, old)]
    loaded, sources = {}, []
    for part in needed:
        for where, paths in survey.copies.get(key, {}).get(part, []):
            try:
                loaded[part] = _checked(load_host(paths), key, part, target, str(paths[0].parent))
                sources.append(where)
                break
            except REJECTS as e:
                reject(rank, str(paths[0].parent), e)
    received = _fetch_parts(rank, key, [p for p in needed if p not in loaded], survey, holders, target)
    loaded.update(received)
    sources += [f"pp {p} dp {d} over the network" for p, d in received]
    relaid, source = [], None
    if len(loaded) == len(needed):
        try:
            relaid = relaid_window(
                {d: loaded[(p, d)] for p, d in needed}, target.sharding, target.place, old, target.meta
            )
            source = f"dp={key.dp}: " + ", ".join(sources)
        except REJECTS as e:
            reject(rank, f"window {key.start} of dp={key.dp}", e)
    every: list = [None] * dist.get_world_size()
    collectives.all_gather_object(every, source)  # also: no rank re-uses a buffer another still reads
    return relaid, every


def _checked(slots: list[Slot], key: WindowOf, part: Part, target: RelayTarget, source: str) -> list[Slot]:
    """`slots` if they are window `key`'s part `part` of this run; SnapshotError naming `source` otherwise."""
    for header, _ in slots:
        _check(header, key, part, target, source)
    return slots


def _check(header: SnapshotHeader, key: WindowOf, part: Part, target: RelayTarget, source: str) -> None:
    """SnapshotError naming `source` unless `header` is of window `key`, part `part`, and this run."""
    if (header.window_start, header.window) != (key.start, key.window_size):
        raise SnapshotError(f"{source}: snapshot of iteration {header.iteration} is not of window {key}")
    expect = {"layout": {"dp": key.dp, "ep": key.ep}, "pp_rank": part[0], "dp_rank": part[1]}
    snapshot_identity_check(expect, target.run_mismatch)(header, source)


def _fetch_parts(
    rank: int,
    key: WindowOf,
    missing: list[Part],
    survey: NodeSurvey,
    holders: dict[Part, list[int]],
    target: RelayTarget,
) -> dict[Part, list[Slot]]:
    """The parts this rank could not load from its node, received from ranks of nodes that hold them
    (collective: every exchange runs in one global order, receiving rank then part, so blocking sends cannot
    deadlock; a rejected copy is asked of the next holder)."""
    gathered: list = [None] * dist.get_world_size()
    collectives.all_gather_object(gathered, missing)
    wanted = [(r, tuple(part)) for r, parts in enumerate(gathered) for part in parts if _holders_for(holders, part, r)]
    got: dict[Part, list[Slot]] = {}
    attempt = 0
    while wanted:
        for r, part in wanted:
            holder = _holders_for(holders, part, r)[attempt]
            if rank == holder:
                send_window(r, survey.copies[key][part][0][1])
            elif rank == r:
                check: CheckHeader = lambda h, source, p=part: _check(h, key, p, target, source)  # noqa: E731
                received = receive_window(holder, check)
                if received is not None:
                    got[part] = received[0]
        flags: list = [None] * dist.get_world_size()
        collectives.all_gather_object(flags, sorted(got))
        attempt += 1
        wanted = [
            (r, part)
            for r, part in wanted
            if part not in {tuple(p) for p in flags[r]} and attempt < len(_holders_for(holders, part, r))
        ]
    return got


def _holders_for(holders: dict[Part, list[int]], part: Part, rank: int) -> list[int]:
    """The ranks, other than `rank`, that can send `part`, in the order they are asked."""
    return [h for h in holders.get(part, []) if h != rank]
