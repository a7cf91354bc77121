"""A survivor's live training state, kept across a torchrun restart (docs/design/lifecycle/torchrun-restart.md).

When a worker really dies, the torchrun agent stops every other worker (SIGTERM) and starts them all
again. A survivor notices (the signal, or a collective that fails because its peer is gone), stops at a
consistent point and writes `<rank_dir>/live.{bin,json}` in node-local shared memory: the FP32 state of
every operator (weights, buffers, optimizer state), the upstream log and the scalar log, all checksummed,
with `next_iteration` (the first iteration its state has not applied) and the job's identity and torchrun
attempt in the header (the strategy's `keep_live_state`: `keep_in_memory`, then `save_kept`; a survivor
replaced in place keeps it in memory and writes it only if it cannot rejoin). The restarted process reads
it back; a missing, foreign or corrupt file means the rank counts as failed (its stage replays). The file
stays until the rank trains on, so an attempt that dies while it starts up (setup, rejoin) leaves it to
the next one.

Training thread only (the survivor has stopped training when it saves).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from moevement.operators import Operator
from moevement.recovery.replay import load_master
from moevement.recovery.report import ShellFault
from moevement.recovery.upstream_log import UpstreamLog
from moevement.storage.host_memory import HostBuffer, map_bytes, read_header
from moevement.storage.private_files import HostMemoryError
from moevement.storage.snapshot import FORMAT as CHECKSUM_FORMAT
from moevement.storage.snapshot import (
    Entry,
    SnapshotError,
    entries_of,
    layout_of,
    read_entries,
)
from moevement.storage.snapshot_copy import Throttle, copy_entries

LIVE = "live"


@dataclass
class LiveState:
    """What a survivor kept: state_{next_iteration}, logs, and how it learned of the failure."""

    next_iteration: int
    log_from: int  # first iteration whose upstream log and scalars it holds
    scalars: dict[int, dict]
    tensors: dict[tuple[str, str], torch.Tensor]
    detected: dict  # {"how": ..., "time": unix seconds}
    meta: dict = field(default_factory=dict)  # kept in memory: the job's identity, for `save_kept`

    def survival(self) -> Survival:
        """What this rank tells the others of its kept state when the job starts again."""
        return Survival(self.next_iteration, self.log_from, self.detected)


class Survival(NamedTuple):
    """A survivor's word to the others after a restart (sent with `all_gather_object`; None: it kept nothing)."""

    next_iteration: int  # the first iteration its state has not applied
    log_from: int  # the first iteration whose logs it holds
    detected: dict  # how and when it learned of the failure: {"how", "time", "kept" (unix seconds)}


@dataclass(frozen=True)
class LiveHeader:
    """The header of `live.{bin,json}`: where each tensor lies in the buffer (the snapshot's `Entry`) and the
    checksums of its chunks, so that the snapshot's own `read_entries` verifies and reads it back."""

    iteration: int  # next_iteration: the state is state_{iteration}
    log_from: int  # the first iteration whose upstream log and scalars it holds
    entries: list[Entry]
    nbytes: int
    meta: dict  # the job's identity, "attempt", "scalars" {iteration: ...}, "detected"
    checksums: list[list]  # [first entry, end entry, XXH3-64] per chunk
    checksum_format: str = CHECKSUM_FORMAT

    def to_json(self) -> dict:
        """What `live.json` records (`from_json` reads it back)."""
        return {**vars(self), "entries": [dict(vars(e)) for e in self.entries]}

    @classmethod
    def from_json(cls, payload: dict) -> LiveHeader:
        """SnapshotError unless `payload` is a live state header."""
        try:
            return cls(**{**payload, "entries": entries_of(payload, "live state header")})
        except (KeyError, TypeError) as e:
            raise SnapshotError(f"malformed live state header: {e}") from None


@dataclass(frozen=True)
class Rejoin:
    """This process's place in a torchrun run: its attempt, and what it kept from the previous one
    (decided once, before the strategy is built: `trainer/run/start_facts.py`)."""

    name: dict  # {"run_id": TORCHELASTIC_RUN_ID, "attempt": TORCHELASTIC_RESTART_COUNT}
    live: LiveState | None = None  # this rank's kept state (None: it died, or kept nothing usable)
    survivors: bool = False  # some rank of the job kept its state: rejoin instead of a whole-job restart
    timeline: dict[str, float] = field(default_factory=dict)  # unix time this process reached each set-up stage
    in_place: bool = False  # the survivors stayed alive: a dead worker was replaced in place
    fault: ShellFault | None = None  # a replacement: the fault it replaces, as its rank shell saw it
    prebuilt: str | None = None  # what a warm standby built of this rank before its activation ("data+model")


def _live_items(
    ops: list[Operator], optimizer: torch.optim.Optimizer, log: UpstreamLog | None, next_iteration: int, log_from: int
) -> list[tuple]:
    """(operator, name, role, tensor, dtype) of every FP32 master tensor, and of the logs of iterations
    `log_from..next_iteration-1`."""
    items = [(op.name, name, "master", t, t.dtype) for op in ops for name, t in op.master_tensors(optimizer)]
    if log is not None:
        for (kind, it, stage, micro), t in sorted(log.entries.items()):
            if log_from <= it < next_iteration:
                items.append(("", f"{kind}.{it}.{stage}.{micro}", "log", t, t.dtype))
    return items


def keep_in_memory(
    ops: list[Operator],
    optimizer: torch.optim.Optimizer,
    log: UpstreamLog | None,
    scalars: dict[int, dict],
    next_iteration: int,
    log_from: int,
    detected: dict,
    meta: dict,
) -> LiveState:
    """state_{next_iteration} of this rank with its logs, kept in this process for its next generation (a
    dead peer is replaced in place): references to the tensors themselves, nothing copied. The caller drops
    the model and optimizer, so nothing changes them afterwards. `meta`: the job's identity, should the
    state have to be written after all (`save_kept`)."""
    items = _live_items(ops, optimizer, log, next_iteration, log_from)
    tensors = {(role, name): t.detach() for _, name, role, t, _ in items}
    kept = {t: s for t, s in scalars.items() if log_from <= t < next_iteration}
    return LiveState(next_iteration, log_from, kept, tensors, {**detected, "kept": time.time()}, meta)


def save_kept(rank_dir: Path, live: LiveState) -> int:
    """Write a kept state (a survivor that could not rejoin in place, or one stopping for torchrun's restart
    of every worker) to `<rank_dir>/live.{bin,json}`; returns the bytes."""
    items = [("", name, role, t, t.dtype) for (role, name), t in live.tensors.items()]
    entries, sources, nbytes = layout_of(items)
    buffer = HostBuffer(rank_dir / LIVE)
    buffer.invalidate()
    checksums = copy_entries(buffer.ensure(max(nbytes, 1)), entries, sources, Throttle())
    meta = {**live.meta, "scalars": {str(t): s for t, s in live.scalars.items()}}
    meta["detected"] = {**live.detected, "kept": time.time()}
    buffer.commit(LiveHeader(live.next_iteration, live.log_from, entries, nbytes, meta, checksums).to_json())
    buffer.release()
    return nbytes


def load_live_state(rank_dir: Path, expect: dict, attempt: int) -> tuple[LiveState | None, str]:
    """This rank's live state if it is intact, of this job (`expect`: header meta keys and their required
    values) and kept by an earlier torchrun attempt than `attempt`; (None, why) otherwise.

    An older attempt's state is as good as the last one's: a process removes what its predecessors
    left once it trains on (`SparseCheckpointer.drop_leftovers`), so a state still here is the newest
    this rank holds."""
    path = rank_dir / LIVE
    try:
        raw = read_header(path)
        if raw is None:
            return None, "no live state"
        header = LiveHeader.from_json(raw)
        differ = sorted(k for k, v in expect.items() if header.meta.get(k) != v)
        kept_by = header.meta.get("attempt")  # an older version's header names it "generation": refused
        if not (type(kept_by) is int and 0 <= kept_by < attempt):
            differ.append("attempt")
        if differ:
            return None, f"{path}.json belongs to another run or attempt ({', '.join(differ)})"
        tensors = read_entries(map_bytes(path), header, source=f"{path}.bin")
        scalars = {int(t): s for t, s in header.meta["scalars"].items()}
    except (HostMemoryError, SnapshotError, OSError, KeyError, TypeError, ValueError, AttributeError) as e:
        return None, f"{path}: unusable ({e})"
    return LiveState(header.iteration, header.log_from, scalars, tensors, header.meta.get("detected", {})), ""


def restore_live_state(
    live: LiveState, ops: list[Operator], optimizer: torch.optim.Optimizer, log: UpstreamLog | None
) -> None:
    """Put a survivor's kept state back into its operators, optimizer and upstream log."""
    for op in ops:
        load_master(op, live.tensors, optimizer)
    if log is None:
        return
    for (role, name), tensor in live.tensors.items():
        if role == "log":
            kind, it, stage, micro = name.split(".")
            log.put(kind, int(it), int(stage), int(micro), tensor)
