"""Whole-job restart (docs/design/lifecycle/start.md, "Whole-job restart"): the newest persisted sparse checkpoint of
this job that every rank can load.

Runs at every start of a `moevement` job: after torchrun restarted every process, or when the same
job is launched again (a relaunch after preemption). Each rank lists its copies of each window:

  1. its own shared-memory buffers (`<host_dir>/<job>/rank<r>/local`), which outlive the process;
  2. the replicas its peers hold in their shared-memory directories on this node
     (`<host_dir>/<job>/rank<q>/replicas/from<r>`);
  3. the disk copies under `<persist_dir>/<job>/window-*/rank<r>`;
  4. the replicas peers on other nodes hold, sent over the process group when none of the above is
     intact (every rank also lists the replicas it holds for the others).

Only persisted windows count: a copy in host memory counts if its window is no newer than the newest
window any rank's manifest (`persisted.json`) records as persisted (a newer one may be complete
locally but not yet replicated); disk copies are written only once persisted. A rejoin also accepts a
newer window complete in host memory that ends by the survivors' iteration (`resume_at`). The ranks agree on the
windows every rank has a copy of and try them newest first: each rank loads its copies in order,
verifying every checksum and the run identity (`check`), and names every file it rejects; if some
rank has no intact copy, every rank falls back to the next older window, then to the initial state,
loudly. `Recovery.restart` converts the chosen window with a full-pipeline replay (global rollback), or
`Recovery.rejoin` the failed stages' part of it; the restarted job then keeps it as its persisted window
(`SparseCheckpointer.adopt`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from moevement.recovery.fetch import recv_slot, send_slot
from moevement.storage.host_memory import map_bytes, private_subdirs, read_header, remove_tree
from moevement.storage.persistence import read_window
from moevement.storage.private_files import HostMemoryError
from moevement.storage.snapshot import SnapshotError, SnapshotHeader, read_entries
from parallelisms import collectives

Loaded = list[tuple[SnapshotHeader, dict]]  # (header, {(role, name): tensor}) per slot, in slot order
CheckHeader = Callable[[SnapshotHeader, str], None]  # raises when a snapshot belongs to another run
UNUSABLE = (SnapshotError, HostMemoryError, OSError)
REJECTS = (*UNUSABLE, RuntimeError, ValueError, KeyError, TypeError)  # any fault of one copy rejects it


@dataclass
class RestartPoint:
    """The checkpoint a restarted rank converts: window [window_start, window_start + window)."""

    window_start: int
    window_size: int
    snapshots: Loaded
    sources: list[str]  # which copy every rank used, by rank
    last_iteration: int  # newest iteration any surviving snapshot records (the job died after it)
    seconds: float  # time spent finding and loading
    window_index: int = 0  # the index the restarted job gives it (`SparseCheckpointer.adopt`)
    relaid: bool = False  # re-laid from another data-parallel layout (`moevement.recovery.relaid_restart`)


@dataclass
class _Copy:
    source: str
    load: Callable[[], Loaded]
    in_host_memory: bool
    file_of: Callable[[SnapshotHeader], str]  # the file a snapshot of this copy was read from
    window_size: int = 0  # W of a host copy


@dataclass
class _Survey:
    """What one rank found: copies by window start, the newest persisted window its manifest records."""

    copies: dict[int, list[_Copy]] = field(default_factory=lambda: defaultdict(list))
    persisted: int = -1
    index: int = -1  # the window index its manifest records (-1: none)
    newest_iteration: int = 0
    anything: bool = False  # any state of this job at all (a fresh job finds none and says nothing)
    held: dict[int, dict[int, list[Path]]] = field(default_factory=dict)  # {rank: {start: paths}} held for others

    def add(self, found: HostWindows) -> HostWindows:
        """Count what a buffer directory showed; returns it."""
        self.anything |= found.seen
        self.newest_iteration = max(self.newest_iteration, found.newest_iteration)
        return found


@dataclass
class _Agreement:
    """What the ranks' surveys say together (every rank computes the same from the same all-gather)."""

    persisted: int  # the newest window start any rank's manifest records as persisted
    last_iteration: int  # the newest iteration any rank's snapshots record
    any_state: bool  # whether any rank found state of this job
    index: int  # the index the restarted job gives the window it keeps (past every manifest's)
    resume_at: int  # the iteration the survivors of a rejoin resume at (0: none)
    remote: dict[int, dict[int, list[int]]] = field(default_factory=dict)  # `_remote_holders`

    def host_copy_usable(self, start: int, window_size: int) -> bool:
        """Whether a copy in host memory of window [start, start + window) may be restarted from."""
        return start <= self.persisted or start + window_size <= self.resume_at


def reject(rank: int, source: str, error: Exception) -> None:
    print(f"restart: rank {rank} rejected {source}: {error}", flush=True)


@dataclass
class HostWindows:
    """What one buffer directory holds: its complete windows ({window_start: buffer paths in slot order}),
    whether it held any commit record at all, and the newest iteration one names."""

    windows: dict[int, list[Path]]
    seen: bool = False
    newest_iteration: int = 0


def host_windows(rank: int, directory: Path) -> HostWindows:
    """The complete windows in a buffer directory (a header that cannot be read is rejected, with a line)."""
    slots: dict[int, dict[int, Path]] = defaultdict(dict)
    sizes = {}
    found = HostWindows({})
    for json_path in sorted(directory.glob("w*-s*.json")):
        found.seen = True
        try:
            header = read_header(json_path.with_suffix(""))
            start, slot, window_size = header["window_start"], header["slot"], header["window"]
            found.newest_iteration = max(found.newest_iteration, int(header["iteration"]))
        except (*UNUSABLE, KeyError, TypeError, ValueError) as e:
            reject(rank, str(json_path), e)
            continue
        slots[start][slot] = json_path.with_suffix("")
        sizes[start] = window_size
    found.windows = {
        start: [by_slot[i] for i in range(sizes[start])]
        for start, by_slot in slots.items()
        if set(by_slot) == set(range(sizes[start]))
    }
    return found


def load_host(paths: list[Path]) -> Loaded:
    out = []
    for path in paths:
        header = SnapshotHeader.from_json(read_header(path))
        data = map_bytes(path) if header.nbytes else torch.empty(0, dtype=torch.uint8)  # an empty slot: no bytes
        out.append((header, read_entries(data, header, source=str(path.with_suffix(".bin")))))
    return out


def _survey(rank: int, job_dir: Path, persist_root: Path | None, own_copies: bool) -> _Survey:
    survey = _Survey()
    own = job_dir / f"rank{rank:05d}"
    try:
        manifest = read_header(own / "persisted")
        if manifest is not None:
            survey.persisted, survey.anything = int(manifest["window_start"]), True
            survey.index = int(manifest["window_index"])
    except (*UNUSABLE, KeyError, TypeError, ValueError) as e:
        reject(rank, str(own / "persisted.json"), e)
    holders = [("local shared memory", own / "local")] if own_copies else []
    holders += [(f"replica on {d.name}", d / "replicas" / f"from{rank}") for d in sorted(job_dir.glob("rank*[0-9]"))]
    for source, directory in holders:
        found = survey.add(host_windows(rank, directory))
        for start, paths in found.windows.items():
            survey.copies[start].append(
                _Copy(
                    source,
                    lambda p=paths: load_host(p),
                    True,
                    lambda h, p=paths: str(p[h.slot].with_suffix(".bin")),
                    len(paths),
                )
            )
    for directory in sorted((own / "replicas").glob("from*[0-9]")):
        source = int(directory.name.removeprefix("from"))
        if source != rank:
            survey.held[source] = survey.add(host_windows(rank, directory)).windows
    if persist_root is not None:
        for directory in private_subdirs(persist_root, "window-", f"rank{rank:05d}"):
            survey.anything = True
            start = int(directory.parent.name.removeprefix("window-"))
            survey.copies[start].append(
                _Copy(
                    f"disk {directory}",
                    lambda d=directory: read_window(d),
                    False,
                    lambda h, d=directory: str(d / f"s{h.slot}.bin"),
                )
            )
    return survey


def _load_first_intact(rank: int, copies: list[_Copy], check: CheckHeader) -> tuple[Loaded, str] | None:
    """The first copy that loads with valid checksums and belongs to this run (rejections are printed)."""
    for copy in copies:
        try:
            snapshots = copy.load()
            for header, _ in snapshots:
                check(header, copy.file_of(header))
            return snapshots, copy.source
        except REJECTS as e:
            reject(rank, copy.source, e)
    return None


def find_restart_checkpoint(
    job_dir: Path,
    persist_root: Path | None,
    check: CheckHeader,
    line: Callable[[str], None],
    own_copies: bool = True,
    resume_at: int = 0,
) -> RestartPoint | None:
    """The newest persisted sparse checkpoint of this job that every rank can load, loaded (collective
    over all ranks); None, with a line saying so when any state of the job was found, otherwise.

    `own_copies=False`: a rank whose process died uses its peers' replicas and the disk, not what its
    dead predecessor left in its own directory. `resume_at` (a rejoin: the iteration a survivor resumes
    at, 0 elsewhere; the largest over the ranks counts): a host copy of a window newer than the persisted
    one is usable too if it ends by then. Its snapshots are complete (every slot committed) and their
    checksums are verified like any other; the death only kept the all-reduce that marks it persisted
    from running, and rolling back to it replays a window less."""
    started = time.perf_counter()
    rank = dist.get_rank()
    survey = _survey(rank, job_dir, persist_root, own_copies)
    agreed = _agree(survey, resume_at)
    usable, candidates = _candidate_windows(survey, agreed)
    for start in candidates:
        loaded, sources = _load_on_every_rank(rank, start, usable.get(start, []), agreed, survey.held, check)
        if all(source is not None for source in sources):
            drop_newer_disk_windows(rank, persist_root, start)
            snapshots = loaded[0]
            seconds = time.perf_counter() - started
            return RestartPoint(start, len(snapshots), snapshots, sources, agreed.last_iteration, seconds, agreed.index)
        missing = [r for r, source in enumerate(sources) if source is None]
        line(
            f"restart: window {start} has no intact copy on rank(s) {'+'.join(map(str, missing))}; "
            f"falling back to the next older window"
        )
    if agreed.any_state:
        line(
            "restart: no intact persisted sparse checkpoint of this job survives on every rank; "
            "STARTING FROM THE INITIAL STATE"
        )
    return None


def _agree(survey: _Survey, resume_at: int) -> _Agreement:
    """Every rank's survey summed up, and who holds which replica (collective)."""
    gathered: list = [None] * dist.get_world_size()
    held = {r: {start: len(paths) for start, paths in windows.items()} for r, windows in survey.held.items()}
    collectives.all_gather_object(
        gathered, (survey.persisted, survey.newest_iteration, survey.anything, survey.index, resume_at, held)
    )
    agreed = _Agreement(
        persisted=max(g[0] for g in gathered),
        last_iteration=max(g[1] for g in gathered),
        any_state=any(g[2] for g in gathered),
        index=max(-1, *(g[3] for g in gathered)) + 1,  # not the buffers of the newest manifest's window
        resume_at=max(g[4] for g in gathered),
    )
    agreed.remote = _remote_holders([g[5] for g in gathered], agreed.host_copy_usable)
    return agreed


def _candidate_windows(survey: _Survey, agreed: _Agreement) -> tuple[dict[int, list[_Copy]], list[int]]:
    """This rank's usable copies by window start, and the starts every rank has a copy of (its own or a
    peer's replica), newest first (collective)."""
    usable = {
        start: [c for c in copies if not c.in_host_memory or agreed.host_copy_usable(start, c.window_size)]
        for start, copies in survey.copies.items()
    }
    starts = sorted(start for start, copies in usable.items() if copies)
    gathered: list = [None] * dist.get_world_size()
    collectives.all_gather_object(gathered, starts)
    common = set.intersection(*(set(s) | set(agreed.remote[r]) for r, s in enumerate(gathered)))
    return usable, sorted(common, reverse=True)


def _load_on_every_rank(
    rank: int,
    start: int,
    copies: list[_Copy],
    agreed: _Agreement,
    held: dict[int, dict[int, list[Path]]],
    check: CheckHeader,
) -> tuple[tuple[Loaded, str] | None, list]:
    """Window `start` loaded and verified on every rank (collective): each rank loads its first intact copy,
    and the ranks without one receive it from a peer's replica. Returns this rank's (snapshots, source)
    (None: no intact copy) and every rank's source (None where a rank has none)."""
    sources: list = [None] * dist.get_world_size()
    loaded = _load_first_intact(rank, copies, check)
    collectives.all_gather_object(sources, loaded[1] if loaded else None)
    if not all(sources):
        loaded = _fetch_over_network(rank, start, sources, agreed.remote, held, check) or loaded
        collectives.all_gather_object(sources, loaded[1] if loaded else None)
    return loaded, sources


def _remote_holders(held_by: list[dict], usable: Callable[[int, int], bool]) -> dict[int, dict[int, list[int]]]:
    """{rank r: {window start: the ranks holding a usable replica of r's window}} from every rank's list."""
    remote: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for holder, held in enumerate(held_by):
        for source, windows in held.items():
            for start, window_size in windows.items():
                if source != holder and usable(start, window_size):
                    remote[source][start].append(holder)
    return remote


def _fetch_over_network(
    rank: int,
    start: int,
    sources: list,
    remote: dict[int, dict[int, list[int]]],
    held: dict[int, dict[int, list[Path]]],
    check: CheckHeader,
) -> tuple[Loaded, str] | None:
    """Ranks without an intact copy of window `start` receive it from the peers holding its replica (another
    node's shared memory), trying the next holder when one's copy is rejected. Collective: every exchange
    runs in one global order (receiving rank, then holder), so the blocking sends cannot deadlock."""
    got: tuple[Loaded, str] | None = None
    needing = [r for r, source in enumerate(sources) if source is None]
    for attempt in range(max((len(remote[r][start]) for r in needing), default=0)):
        for r in needing:
            holders = remote[r][start]
            if attempt >= len(holders):
                continue
            if rank == holders[attempt]:
                send_window(r, held[r][start])
            elif rank == r and got is None:
                got = receive_window(holders[attempt], check)
        flags: list = [None] * len(sources)
        collectives.all_gather_object(flags, rank not in needing or got is not None)
        needing = [r for r in needing if not flags[r]]
    return got


def send_window(dst: int, paths: list[Path]) -> None:
    """The number of slots, then each slot (`send_slot`; none for a slot that can no longer be read)."""
    collectives.send(torch.tensor([len(paths)]), dst)
    for path in paths:
        try:
            header = read_header(path)
            data = map_bytes(path) if header["nbytes"] else None
        except (*UNUSABLE, KeyError, TypeError):
            header, data = None, None
        send_slot(dst, header, data)


def receive_window(src: int, check: CheckHeader) -> tuple[Loaded, str] | None:
    """The window `send_window` sends, every checksum and the run identity verified, and where it came
    from (`rank<src>:network`); None if rejected."""
    source = f"replica on rank {src}, over the network"
    n_slots = torch.zeros(1, dtype=torch.int64)
    collectives.recv(n_slots, src)
    received = [recv_slot(src, lambda n: torch.empty(n, dtype=torch.uint8)) for _ in range(int(n_slots))]
    try:
        loaded = []
        for slot, (header, data) in enumerate(received):
            if header is None:
                raise SnapshotError(f"{source}: slot {slot} unreadable on the holder")
            parsed = SnapshotHeader.from_json(header)
            check(parsed, source)
            loaded.append((parsed, read_entries(data, parsed, source=source)))
        return loaded, f"rank{src}:network"
    except REJECTS as e:
        reject(dist.get_rank(), source, e)
        return None


def drop_newer_disk_windows(rank: int, persist_root: Path | None, start: int) -> None:
    """This rank's disk windows newer than the one restarted from are unusable: training re-creates them."""
    if persist_root is None:
        return
    for directory in private_subdirs(persist_root, "window-", f"rank{rank:05d}"):
        if int(directory.parent.name.removeprefix("window-")) > start:
            remove_tree(directory, persist_root)


def snapshot_identity_check(expect: dict, identity_mismatch: Callable[[object], list[str]]) -> CheckHeader:
    """A `CheckHeader` refusing snapshots whose rank coordinates differ from `expect` or whose run
    identity (`meta["run"]`) differs from this run's (`identity_mismatch` lists the differences)."""

    def check(header: SnapshotHeader, source: str) -> None:
        for key, value in expect.items():
            if header.meta.get(key) != value:
                raise SnapshotError(
                    f"{source}: snapshot of iteration {header.iteration} has {key}="
                    f"{header.meta.get(key)!r}, this rank has {value!r}"
                )
        differ = identity_mismatch(header.meta.get("run"))
        if differ:
            raise SnapshotError(
                f"{source}: snapshot of iteration {header.iteration} belongs to another run: {'; '.join(differ)}"
            )

    return check
