"""Whole-job restart (DESIGN.md §4): find the newest sparse checkpoint that every rank still has.

After every process died (say under `torchrun --max-restarts`), each rank looks for the snapshots
of its persisted checkpoints in three places, in this order:

  1. its own shared-memory buffers (`<host_dir>/<job>/rank<r>/local`), which outlive the process;
  2. the replicas its peers hold in their shared-memory directories on this node
     (`<host_dir>/<job>/rank<q>/replicas/from<r>`);
  3. the disk copies under `checkpoint.persist_dir`.

A window counts when all W of its snapshots are committed. The ranks agree on the newest window all
of them have; each then loads it, verifying every checksum and falling back to the next copy when
one fails. `Recovery.restart` converts it with a full-pipeline replay (global rollback).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from moevement.hostmem import map_bytes, read_header
from moevement.persist import read_window
from moevement.snapshot import SnapshotError, SnapshotHeader, read_entries

Loaded = list[tuple[SnapshotHeader, dict]]  # (header, {(role, name): tensor}) per slot, in slot order


@dataclass
class Found:
    """The checkpoint a restarted rank converts: window [window_start, window_start + window)."""

    window_start: int
    window: int
    snapshots: Loaded
    source: str  # which copy was used
    last_iteration: int  # newest iteration any surviving snapshot records (the job died after it)
    seconds: float  # time spent finding and loading


def _host_windows(directory: Path) -> tuple[dict[int, list[Path]], int]:
    """({window_start: buffer paths in slot order} of complete windows, newest iteration seen) in a buffer dir."""
    slots: dict[int, dict[int, Path]] = defaultdict(dict)
    sizes, newest = {}, 0
    for json_path in directory.glob("w*-s*.json"):
        header = read_header(json_path.with_suffix(""))
        if header is None:
            continue
        slots[header["window_start"]][header["slot"]] = json_path.with_suffix("")
        sizes[header["window_start"]] = header["window"]
        newest = max(newest, header["iteration"])
    complete = {start: [by_slot[i] for i in range(sizes[start])] for start, by_slot in slots.items()
                if set(by_slot) == set(range(sizes[start]))}
    return complete, newest


def _load_host(paths: list[Path]) -> Loaded:
    out = []
    for path in paths:
        header = SnapshotHeader.from_json(read_header(path))
        out.append((header, read_entries(map_bytes(path), header, source=str(path.with_suffix(".bin")))))
    return out


def _candidates(rank: int, job_dir: Path, persist_dir: str) -> tuple[dict[int, list[tuple[str, Callable]]], int]:
    """{window_start: [(source, loader), ...] in preference order}, newest iteration seen locally."""
    found: dict[int, list[tuple[str, Callable]]] = defaultdict(list)
    local, newest = _host_windows(job_dir / f"rank{rank:05d}" / "local")
    for start, paths in local.items():
        found[start].append(("local shared memory", lambda p=paths: _load_host(p)))
    for holder in sorted(job_dir.glob("rank*")):
        replicas, _ = _host_windows(holder / "replicas" / f"from{rank}")
        for start, paths in replicas.items():
            found[start].append((f"replica on {holder.name}", lambda p=paths: _load_host(p)))
    if persist_dir:
        for directory in Path(persist_dir).glob(f"window-*/rank{rank:05d}"):
            start = int(directory.parent.name.removeprefix("window-"))
            found[start].append((f"disk {directory}", lambda d=directory: read_window(d)))
    return found, newest


def find_restart_checkpoint(job_dir: Path, persist_dir: str, expect: dict, line: Callable[[str], None]
                            ) -> Found | None:
    """The newest persisted sparse checkpoint every rank can load, loaded (collective over all ranks).

    `expect` holds header metadata that must match (seed, pp_rank, dp_rank): a snapshot of another
    job or layout is rejected with its file named. None when no common checkpoint survives.
    """
    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    candidates, newest = _candidates(rank, job_dir, persist_dir)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (sorted(candidates), newest))
    common = set.intersection(*(set(starts) for starts, _ in gathered))
    last_iteration = max(n for _, n in gathered)
    if not common:
        line("restart: no persisted sparse checkpoint survives on every rank; starting from the initial state")
        return None
    start = max(common)
    for source, load in candidates[start]:
        try:
            snapshots = load()
        except (SnapshotError, OSError) as e:
            print(f"restart: rank {rank} rejected the copy in {source}: {e}; trying the next one", flush=True)
            continue
        _check_job(snapshots, expect, source)
        return Found(start, len(snapshots), snapshots, source, last_iteration, time.perf_counter() - started)
    raise SnapshotError(f"rank {rank}: every copy of the sparse checkpoint of window {start} failed its checksums "
                        f"(tried {', '.join(s for s, _ in candidates[start])})")


def _check_job(snapshots: Loaded, expect: dict, source: str) -> None:
    for header, _ in snapshots:
        for key, value in expect.items():
            if header.meta.get(key) != value:
                raise SnapshotError(f"{source}: snapshot of iteration {header.iteration} has {key}="
                                    f"{header.meta.get(key)!r}, this job has {value!r} (another job or layout)")

