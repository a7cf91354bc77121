"""What a survivor keeps when another worker really dies, and where (docs/design/lifecycle/survival.md,
docs/design/lifecycle/torchrun-restart.md).

The verdict (`verdict.decide`) says which of these runs: `survive_in_place` keeps the state in memory for
the next in-place generation; `keep_state_and_exit` writes it to host memory for torchrun's restart of every
worker and exits; `keep_for_torchrun_restart` writes what an earlier generation kept in memory, when the
next generation cannot form. Which state a rank holds when it stops is the stop guard's
(`trainer/lifecycle/stop_guard.py`), and which state it then keeps is `verdict.kept_iteration`'s table.

The gradient-norm all-reduce is global, so a survivor that finished it knows every rank entered it; the
survivors that did not finish it hold `state_T` and the restarted job widens the scope to their stages
(`Recovery.rejoin`), so no case ends in a wrong state.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch.distributed as dist

from moevement.recovery.live_state import save_kept
from moevement.storage.private_files import write_json_atomic
from parallelisms.distributed import sever_connections
from trainer import event_writer
from trainer.lifecycle import exit_codes
from trainer.lifecycle.host_dirs import host_job_dir, host_rank_dir
from trainer.lifecycle.peer_failure import GLOO_GISTS, WorkerStopped, gist, peer_error
from trainer.lifecycle.startup import process_start_time
from trainer.lifecycle.stop_guard import StopGuard
from trainer.lifecycle.survivor_lines import DETECTED, REJOINS, SurvivorLine
from trainer.lifecycle.verdict import kept_iteration

NOTHING_KEPT = "no live state (it was recovering; its stage replays)"


def keep_state_and_exit(guard: StopGuard, keep_live_state, error: BaseException) -> None:
    """Another worker died (or the job is stopping): keep this rank's live state if it is consistent, say
    so in one line (printed and recorded: `event_writer.say`), and exit at once (torchrun restarts the job;
    nothing else here is needed)."""
    error = peer_error(error) or error
    sigterm = isinstance(error, WorkerStopped)
    how = "SIGTERM from the torchrun agent" if sigterm else gist(error)
    detected = {"how": how, "time": guard.sigterm_at if sigterm else time.time()}
    guard.stop()
    next_iteration = kept_iteration(guard.stopped_in, guard.step, guard.applied)
    if next_iteration is None:
        kept = NOTHING_KEPT
    else:
        nbytes = keep_live_state(next_iteration, detected)
        kept = f"live state of iteration {next_iteration}, {nbytes / 1e6:.1f} MB" if nbytes else "no live state"
    if sigterm:
        event_writer.say(guard.preempted_line(guard.step, kept, detected["time"]))
    else:
        line = SurvivorLine(DETECTED, guard.rank, guard.step, how=how, kept=kept, detected_unix=detected["time"])
        event_writer.say(line)
        if not isinstance(error, dist.DistError) and not any(g in str(error) for g in GLOO_GISTS):
            # told only by where it was raised, with no gist we know: the whole record, to stderr
            traceback.print_exception(error, file=sys.stderr)
            sys.stderr.flush()
    os._exit(exit_codes.STOPPED if sigterm else exit_codes.FALLBACK)


def survive_in_place(job, error: BaseException):
    """Another worker died and its rank shell starts a replacement: keep this rank's state in memory if it
    is consistent (as `keep_state_and_exit` decides), release its host state, say so in one line (printed
    and recorded); returns the plan of the next generation. The caller drops the job before leaving its
    groups."""
    guard, detected_at = job.guard, time.time()
    how = gist(peer_error(error) or error)
    guard.stop()
    next_iteration = kept_iteration(guard.stopped_in, guard.step, guard.applied)
    if next_iteration is None:
        kept, what = None, NOTHING_KEPT
    else:
        kept = job.ft.keep_in_memory(next_iteration, {"how": how, "time": detected_at})
        what = f"live state of iteration {next_iteration} in memory" if kept else "no live state"
    accounting = job.accounting.record(detected_at)
    sever_connections()  # peers and this rank's background threads stop waiting on it now
    job.ft.abandon()
    job.logger.close()
    plan = job.plan.next_generation(kept, accounting)
    line = SurvivorLine(
        REJOINS, guard.rank, guard.step, os.getpid(), process_start_time(), how, what, plan.generation, detected_at
    )
    event_writer.say(line)
    return plan


def keep_for_torchrun_restart(cfg, plan) -> str:
    """A survivor that does not join the next generation in place (not joined in time, or stopped by
    torchrun): write the state and the accounting it kept in memory where torchrun's restart of every
    worker looks for them (the host directory); returns what it kept."""
    rank = int(os.environ.get("RANK", "0"))
    if plan.accounting is not None:
        record = {**plan.name(), "accounting": plan.accounting}
        write_json_atomic(host_job_dir(cfg) / f"accounting-rank{rank:05d}.json", record)
    if plan.kept is None:
        return "no live state"
    nbytes = save_kept(host_rank_dir(cfg, rank), plan.kept)
    return f"live state of iteration {plan.kept.next_iteration}, {nbytes / 1e6:.1f} MB"
