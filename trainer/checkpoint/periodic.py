"""Periodic dense checkpoints (`checkpoint.dense_interval`): the training state after every N-th iteration,
as `<checkpoint.folder>/step-<N>` in the dense format (`trainer.checkpoint.dense`), written off the
training thread, recording the run's lineage (`trainer.checkpoint.lineage`).

At the end of iteration N (its update applied, its step line printed), on the training thread, every rank
together: rank 0 tidies the folder (`step_folder.tidy`) and checks that `step-<N>` is not another run's
(`step_folder.refusal`), makes the step's temporary directory and every rank checks it (`open_temporary`),
and each rank copies the tensors it owns to host memory (`owned_tensors(copy=True)`: sharded ones
assembled within their group): the state of iteration N, whatever the next iterations change. In the
background, one thread per rank (`_run`): the rank writes its files, then a record `.rank-<r>.done` of
their sha256; a rank that cannot (a full disk) removes its own files and records its error instead, naming
the bytes it needed and those free, so that rank 0 learns it at once. Rank 0's thread then waits, up to
`fault.timeout_s`, for every rank's record, publishes the directory (`meta.json` sealed, renamed into
place) and prunes its lineage's oldest beyond `checkpoint.keep_latest` (`step_folder.prune`), saying each
through `say` (rank 0's `MetricsLogger.line`: `trainer.checkpoint.events`).

A save that cannot be made (a step directory of another run, no room for the temporary, a rank's error)
is one `not saved` line and training goes on; the next due save is tried like any other. A save still
being written when the next one is due is waited for first (it holds a copy of the state), and the end of
the run waits for the last one. A rank that dies before its record leaves the step unpublished: rank 0
gives it up at `fault.timeout_s`, or as soon as the next generation starts in place (`PeriodicCheckpoints`
settles the process's earlier saves: every rank's own writers finish, then rank 0's gives up on the records
still missing), removing its temporary; a temporary whose writer died with its process is removed before
the next save. A dense checkpoint is not a recovery mechanism here: recoveries never read or delete one.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.dense import KINDS, dense_meta, open_temporary, owned_specs, publish_records, write_owned
from trainer.checkpoint.events import CheckpointNotSaved, CheckpointSaved
from trainer.checkpoint.publish import CheckpointError, remove_temporary, shard_file, write_owner_only
from trainer.checkpoint.rank0 import all_records, from_rank0, is_rank0
from trainer.checkpoint.state import owned_tensors, training_plan
from trainer.checkpoint.step_folder import KEY, checkpoint_folder, make_folder, prune, refusal, step_dir, tidy

_POLL_S = 0.05  # how often rank 0 looks for the other ranks' records
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the file system (or this process's limit) has no room


def _record_name(rank: int) -> str:
    return f".rank-{rank:05d}.done"


@dataclass
class SaveWork:
    """One rank's part of one periodic save, handed to its background thread: its owned tensors' copies,
    the temporary to write them into, and (rank 0) what publishing needs."""

    step: int
    rank: int
    world: int
    tmp: Path
    refused: str | None  # why this rank may not write into `tmp` (its record then says so)
    tensors: list[tuple[str, torch.Tensor]]
    specs: dict
    target: Path
    meta: dict
    old_files: list[str]
    keep_latest: int
    lineage: str | None  # the run's lineage: pruning deletes only its checkpoints
    timeout_s: float
    strike: Callable[[str, int], None]  # the `dense_save` / `dense_prune` fault injection (a no-op unless armed)
    say: Callable[[object], None]  # prints and records a checkpoint event (rank 0)
    abandoned: threading.Event = field(default_factory=threading.Event)  # stop waiting for missing records
    needed: int = 0  # bytes of this rank's files

    def __post_init__(self) -> None:
        self.needed = sum(t.numel() * t.element_size() for _, t in self.tensors)


def _striking(tensors: list, strike: Callable[[], None]) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, calling `strike` after the first (the `dense_save` kill: a death in mid-write)."""
    for i, item in enumerate(tensors):
        yield item
        if i == 0:
            strike()


def write_part(work: SaveWork) -> None:
    """This rank's files of the save, then its record (files and sha256, or its error), published
    atomically in the temporary. A rank that cannot write them removes what it wrote, so that its record
    still fits and says why. Background thread."""
    files, error = {}, work.refused
    if error is None:
        try:
            tensors = _striking(work.tensors, lambda: work.strike("dense_save", work.step))
            files = write_owned(work.tmp, work.rank, tensors, work.specs)
        except (OSError, ValueError) as e:
            _remove_own_files(work)
            error = _write_error(work, e)
    work.tensors.clear()  # the copies go as soon as they are written
    try:
        _write_record(work, files, error)
    except OSError as e:
        _remove_own_files(work)  # room for the record that says why
        with suppress(OSError):  # the temporary is gone: rank 0 gives the step up at fault.timeout_s
            _write_record(work, {}, error or _write_error(work, e))


def _write_record(work: SaveWork, files: dict, error: str | None) -> None:
    record = work.tmp / _record_name(work.rank)
    write_owner_only(Path(f"{record}.tmp"), json.dumps({"files": files, "error": error}).encode())
    os.replace(f"{record}.tmp", record)


def _remove_own_files(work: SaveWork) -> None:
    for name in [*(shard_file(kind, work.rank) for kind in KINDS), f"{_record_name(work.rank)}.tmp"]:
        with suppress(OSError):
            (work.tmp / name).unlink()


def _write_error(work: SaveWork, error: Exception) -> str:
    """Rank `work.rank`'s reason for the `not saved` line: for a full file system, the bytes its files need
    and those free in the folder."""
    if isinstance(error, OSError) and error.errno in _FULL:
        try:
            st = os.statvfs(work.target.parent)
            free = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MB free"
        except OSError:
            free = "free space unknown"
        return (
            f"rank {work.rank} could not write its {work.needed / 2**20:.1f} MB ({free} in {work.target.parent}: "
            f"{error.strerror})"
        )
    return f"rank {work.rank} could not write its files ({error})"


def _records(work: SaveWork) -> list[tuple[dict, str | None]] | None:
    """Every rank's (files, error) record, once all are there; None after `timeout_s` without them, or once
    the save is abandoned (its generation ended in a death)."""
    deadline = time.monotonic() + work.timeout_s
    names = [work.tmp / _record_name(r) for r in range(work.world)]
    while not all(name.is_file() for name in names):
        if time.monotonic() > deadline or work.abandoned.wait(_POLL_S):
            return None
    records = []
    for name in names:
        try:
            record = json.loads(name.read_text())
            records.append((dict(record["files"]), record["error"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            records.append(({}, f"{KEY}: {name}: unreadable record ({e})"))
        name.unlink(missing_ok=True)
    return records


def publish_part(work: SaveWork, started: float) -> None:
    """Rank 0, once its own files are written: wait for every rank's record, publish the step's directory
    and prune the lineage's oldest ones, or give the step up; a line for each. Background thread."""
    records = _records(work)
    if records is None:
        missing = [r for r in range(work.world) if not (work.tmp / _record_name(r)).exists()]
        remove_temporary(work.tmp)
        when = "a rank died while it was written" if work.abandoned.is_set() else f"fault.timeout_s={work.timeout_s:g}"
        work.say(CheckpointNotSaved(work.step, str(work.target), f"ranks {missing} recorded no files ({when})"))
        return
    error = publish_records(work.tmp, work.target, work.old_files, work.meta, records, KEY)
    if error is not None:
        work.say(CheckpointNotSaved(work.step, str(work.target), error))
        return
    work.say(CheckpointSaved(work.step, str(work.target), time.perf_counter() - started))
    folder, strike = work.target.parent, lambda: work.strike("dense_prune", work.step)
    for event in prune(folder, work.keep_latest, work.lineage, work.step, strike):
        work.say(event)


_EARLIER: list[PeriodicCheckpoints] = []  # this process's periodic saves, of this and earlier generations


def _settle_earlier_generations() -> None:
    """A new generation starts: the saves this process began in earlier ones end first. Collective (every
    rank of a job that saves periodically): each rank's own writers finish, then rank 0's publisher stops
    waiting for the records of ranks that died, publishing what is whole and removing the rest."""
    earlier, _EARLIER[:] = list(_EARLIER), []
    for old in earlier:
        if not old.publishing:
            old.close()
    all_records(None)  # every rank's writers of earlier generations are done
    for old in earlier:
        old.abandoned.set()
        old.close()


class PeriodicCheckpoints:
    """This rank's periodic dense checkpoints of one generation: `after_iteration` on the training thread
    (collective at a due step), `close` at the end of the run (waits for the last save). Collective when
    made (with `checkpoint.dense_interval`). `timeout_s`: how long rank 0 waits for every rank's record
    (`FaultBounds.timeout_s`, `trainer/lifecycle/fault_bounds.py`); `lineage`: the run's (rank 0's is the one
    written); `say`: prints and records a checkpoint event, from the training thread or the rank's save thread."""

    def __init__(
        self,
        cfg,
        timeout_s: float,
        strike: Callable[[str, int], None],
        lineage: str | None,
        say: Callable[[object], None],
    ):
        self.cfg, self.timeout_s, self.strike, self.lineage, self.say = cfg, timeout_s, strike, lineage, say
        self.every = cfg.checkpoint.dense_interval
        self.folder = checkpoint_folder(cfg)
        self.thread: threading.Thread | None = None
        self.abandoned = threading.Event()
        self.publishing = is_rank0()
        if self.every:
            _settle_earlier_generations()
            if self.publishing:
                make_folder(self.folder, lineage)
            _EARLIER.append(self)

    def after_iteration(self, step: int, loss: float, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """At the end of iteration `step`: when one is due, copy this rank's part of the state and start
        writing it in the background (collective); a save that cannot start is one `not saved` line."""
        if not self.every or step % self.every:
            return
        self.close()  # the previous save is written first
        target = step_dir(self.folder, step)
        why = from_rank0(self._refusal(target) if self.publishing else None)
        if why is None:
            try:
                tmp, old_files, where, refused = open_temporary(target, KEY)
            except CheckpointError as e:
                why = str(e)
        if why is not None:
            self.say(CheckpointNotSaved(step, str(target), why))
            return
        plan = training_plan(model, optimizer)
        try:
            tensors = list(owned_tensors(plan, copy=True))
        except BaseException:  # a peer's death in the walk: the step is not saved, its temporary goes
            if tmp is not None:
                remove_temporary(tmp)
            raise
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        c, meta = self.cfg.checkpoint, dense_meta(step, loss, self.cfg, self.lineage)
        work = SaveWork(
            step, rank, world, where, refused, tensors, owned_specs(plan), target, meta, old_files, c.keep_latest,
            self.lineage, self.timeout_s, self.strike, self.say, self.abandoned,
        )  # fmt: skip
        self.thread = threading.Thread(target=self._run, args=(work, tmp is not None), name="moevement-dense-save")
        self.thread.daemon = True  # a process that dies or exits leaves an unpublished temporary, nothing else
        self.thread.start()

    def _refusal(self, target: Path) -> str | None:
        """Rank 0, before a save to `target`: the folder tidied; why the save may not replace `target`."""
        with suppress(OSError):
            tidy(self.folder, self.lineage)
        return refusal(target, self.lineage)

    @staticmethod
    def _run(work: SaveWork, publishes: bool) -> None:
        started = time.perf_counter()
        write_part(work)
        if publishes:
            try:
                publish_part(work, started)
            except (OSError, CheckpointError) as e:
                work.say(CheckpointNotSaved(work.step, str(work.target), str(e)))

    def close(self) -> None:
        """Wait for the save being written, if any (rank 0: until it is published or given up)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
