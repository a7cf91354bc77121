"""Periodic dense checkpoints (`checkpoint.dense_interval`): the training state after every N-th iteration,
as `<checkpoint.folder>/step-<N>` in the dense format (`trainer.checkpoint.dense`), written off the
training thread.

At the end of iteration N (its update applied, its step line printed), on the training thread, every rank
together: rank 0 makes the step's temporary directory and every rank checks it (`open_temporary`), and
each rank copies the tensors it owns to host memory (`owned_tensors(copy=True)`: sharded ones assembled
within their group): the state of iteration N, whatever the next iterations change. In the background, one
thread per rank (`BackgroundSave`): the rank writes its files, then a record `.rank-<r>.done` of their
sha256 (or of its error); rank 0's thread then waits, up to `fault.timeout_s`, for every rank's record,
publishes the directory (`meta.json` sealed, renamed into place) and deletes the oldest periodic
checkpoints beyond `checkpoint.keep_latest` (`step_folder.prune`). A rank that dies before its record
leaves the step unpublished (rank 0 removes the temporary and says so in one line): the checkpoints
before it stay as they were. A save still being written when the next one is due is waited for first, and
the end of the run waits for the last one. A dense checkpoint is not a recovery mechanism here: recoveries
never read or delete one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.dense import dense_meta, open_temporary, owned_specs, publish_records, write_owned
from trainer.checkpoint.publish import CheckpointError, remove_temporary, write_owner_only
from trainer.checkpoint.rank0 import is_rank0
from trainer.checkpoint.state import owned_tensors, training_plan
from trainer.checkpoint.step_folder import KEY, checkpoint_folder, make_folder, prune, step_dir

_POLL_S = 0.05  # how often rank 0 looks for the other ranks' records


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
    timeout_s: float
    strike: Callable[[int], None]  # the `dense_save` fault injection (a no-op unless armed)


def _striking(tensors: list, strike: Callable[[], None]) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, calling `strike` after the first (the `dense_save` kill: a death in mid-write)."""
    for i, item in enumerate(tensors):
        yield item
        if i == 0:
            strike()


def write_part(work: SaveWork) -> None:
    """This rank's files of the save, then its record (files and sha256, or its error), published
    atomically in the temporary. Background thread."""
    files, error = {}, work.refused
    if error is None:
        try:
            tensors = _striking(work.tensors, lambda: work.strike(work.step))
            files = write_owned(work.tmp, work.rank, tensors, work.specs)
        except (OSError, ValueError) as e:
            error = f"{KEY}: cannot save step {work.step} to {work.target} ({e})"
    work.tensors.clear()  # the copies go as soon as they are written
    record = work.tmp / _record_name(work.rank)
    try:
        write_owner_only(Path(f"{record}.tmp"), json.dumps({"files": files, "error": error}).encode())
        os.replace(f"{record}.tmp", record)
    except OSError:
        pass  # the temporary is gone or full: rank 0 sees no record and gives the step up


def _records(work: SaveWork) -> list[tuple[dict, str | None]] | None:
    """Every rank's (files, error) record, once all are there; None after `timeout_s` without them."""
    deadline = time.monotonic() + work.timeout_s
    names = [work.tmp / _record_name(r) for r in range(work.world)]
    while not all(name.is_file() for name in names):
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)
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
    and prune the oldest ones, or give the step up; one line either way. Background thread."""
    records = _records(work)
    if records is None:
        remove_temporary(work.tmp)
        missing = [r for r in range(work.world) if not (work.tmp / _record_name(r)).exists()]
        print(f"checkpoint: step {work.step} not saved to {work.target}: ranks {missing} did not finish", flush=True)
        return
    error = publish_records(work.tmp, work.target, work.old_files, work.meta, records, KEY)
    if error is not None:
        print(f"checkpoint: step {work.step} not saved: {error}", flush=True)
        return
    print(
        f"checkpoint: saved step {work.step} to {work.target} ({time.perf_counter() - started:.1f} s in the "
        "background)",
        flush=True,
    )
    for line in prune(work.target.parent, work.keep_latest):
        print(line, flush=True)


class PeriodicCheckpoints:
    """This rank's periodic dense checkpoints of one generation: `after_iteration` on the training thread
    (collective at a due step), `close` at the end of the run (waits for the last save)."""

    def __init__(self, cfg, strike: Callable[[int], None]):
        self.cfg, self.strike = cfg, strike
        self.every = cfg.checkpoint.dense_interval
        self.folder = checkpoint_folder(cfg)
        self.thread: threading.Thread | None = None
        if self.every and is_rank0():
            make_folder(self.folder)

    def after_iteration(self, step: int, loss: float, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """At the end of iteration `step`: when one is due, copy this rank's part of the state and start
        writing it in the background (collective). CheckpointError when rank 0 cannot make the temporary."""
        if not self.every or step % self.every:
            return
        self.close()  # the previous save is written first
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        target = step_dir(self.folder, step)
        tmp, old_files, where, refused = open_temporary(target, KEY)
        plan = training_plan(model, optimizer)
        try:
            tensors = list(owned_tensors(plan, copy=True))
        except BaseException:  # a peer's death in the walk: the step is not saved, its temporary goes
            if tmp is not None:
                remove_temporary(tmp)
            raise
        work = SaveWork(
            step, rank, world, where, refused, tensors, owned_specs(plan), target, dense_meta(step, loss, self.cfg),
            old_files, self.cfg.checkpoint.keep_latest, self.cfg.fault.timeout_s, self.strike,
        )  # fmt: skip
        self.thread = threading.Thread(target=self._run, args=(work, tmp is not None), name="moevement-dense-save")
        self.thread.daemon = True  # a process that dies or exits leaves an unpublished temporary, nothing else
        self.thread.start()

    @staticmethod
    def _run(work: SaveWork, publishes: bool) -> None:
        started = time.perf_counter()
        write_part(work)
        if publishes:
            try:
                publish_part(work, started)
            except (OSError, CheckpointError) as e:
                print(f"checkpoint: step {work.step} not saved to {work.target} ({e})", flush=True)

    def close(self) -> None:
        """Wait for the save being written, if any (rank 0: until it is published or given up)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
