"""A trainer process from its start to its exit status: what each way of ending means for torchrun.

`run_process` runs the process's work and maps how it ended to one exit status
(`trainer/lifecycle/exit_codes.py`) and at most one line: a clean error is said once for the job (the
first rank to meet one says it, `said_once_for_the_job`) and the process leaves at once; a state the job
reached (finished, a generation that cannot form) is said by the rank that met it.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from moevement.recovery.fetch import RecoveryError
from moevement.storage.private_files import HostMemoryError
from moevement.storage.snapshot import SnapshotError
from parallelisms.distributed import announce_clean_stop, said_once_for_the_job, shutdown_distributed
from trainer.checkpoint.dense import CheckpointError
from trainer.checkpoint.identity import IdentityError
from trainer.config import ConfigError
from trainer.data.batches import DataError
from trainer.error_line import error_line
from trainer.lifecycle import exit_codes, job_end, verdict
from trainer.lifecycle.generations import GenerationNotJoined, NothingToRecover, PeerStopped
from trainer.lifecycle.process_state import ProcessState
from trainer.lifecycle.verdict import Ending, Said

# The errors that end a rank with one `error:` line (exit status 2), announced to the other ranks.
CLEAN_ERRORS = (ConfigError, CheckpointError, DataError, HostMemoryError, IdentityError, SnapshotError, RecoveryError)

# How the process ended -> how that is said and its exit status (`verdict.Ending`); the first row whose
# types the exception is an instance of. An exception no row names propagates (a traceback, exit status 1).
ENDINGS: tuple[tuple[tuple[type[Exception], ...], Ending], ...] = (
    ((GenerationNotJoined, job_end.GenerationCannotForm), verdict.REACHED_FALLBACK),
    ((job_end.JobFinished, NothingToRecover), verdict.REACHED_THE_END),
    ((PeerStopped,), verdict.PEERS_ERROR),
    (CLEAN_ERRORS, verdict.CLEAN_ERROR),
)


def ending_of(error: BaseException) -> Ending | None:
    """The row of `ENDINGS` for `error`, or None: not a way of ending this module knows."""
    return next((ending for types, ending in ENDINGS if isinstance(error, types)), None)


def run_process(work: Callable[[], None], process: ProcessState) -> int:
    """Run `work` (load the config, train, in `process`); the exit status for how it ended (`ENDINGS`). One said by a
    peer or once for the job does not return: the process leaves at once (`leave_now`). An error of no kind
    named there propagates (a traceback, exit status 1: a bug, or a failure nothing classifies)."""
    try:
        work()
    except Exception as error:
        ending = ending_of(error)
        if ending is None:
            raise
        return end_as(ending, error, process.store)
    finally:
        shutdown_distributed()
    return exit_codes.DONE


def end_as(ending: Ending, error: Exception, store: dist.Store | None) -> int:
    """Say `error` as `ending` says it (a clean error announced on torchrun's `store`); its exit status
    (returned only where the rank says it itself)."""
    if ending.said is Said.BY_THIS_RANK:
        print(error, flush=True)
        return ending.status
    if ending.said is Said.ONCE_FOR_THE_JOB:
        announce_clean_stop(store, int(os.environ.get("RANK", "0")))
        said_once_for_the_job(functools.partial(print_error, error))
    leave_now(ending.status)


def leave_now(status: int) -> NoReturn:
    """Exit with `status` now, its output flushed, without the interpreter's teardown. The process has said
    what it had to and kept what it had to keep; the teardown only waits: for a background thread still in a
    collective or a save, for data loader workers, for process groups whose peers are gone. It can take
    longer than torchrun's 30 s between SIGTERM and SIGKILL, and a SIGTERM that arrives then is never
    handled (Python runs no signal handler once it tears down), so the job would end only when torchrun
    kills it. Its data loader workers go with it (they would notice its end only seconds later, holding the
    job's output open meanwhile)."""
    for worker in multiprocessing.active_children():
        worker.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def print_error(error: Exception) -> None:
    """The `error:` line, written whole in one call: ranks that share torchrun's stderr pipe never interleave
    inside a line (a write of up to PIPE_BUF bytes to a pipe is atomic)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (error_line(error) + "\n").encode())
