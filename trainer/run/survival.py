"""What a rank does when another worker really dies (docs/design.md §4, real deaths).

Under torchrun a dead worker makes the agent send SIGTERM to every other worker of the job, then start
them all again (`--max-restarts`). A survivor learns of the death from that signal, or earlier from a
communication call that fails because its peer is gone or made no progress for `fault.timeout_s`. Such a
failure is recognised by its type or by where it was raised, never by its wording (`communication_failure`).
It stops at a consistent point and keeps its live state for the restarted process:

- while an iteration computes (forward, backward, gradient reduction, the gradient-norm all-reduce) its
  weights and optimizer state are still `state_T`: SIGTERM stops it at once (`WorkerStopped`);
- from the optimizer step of T until the iteration is logged (`end(T)`), SIGTERM waits: the rank then
  holds `state_{T+1}` and the scalar log of T;
- after the last iteration, until the job has gathered its final state: SIGTERM stops it at once, and it
  holds `state_{last+1}`;
- during a recovery it keeps nothing (its stage may be half-replayed): it counts as failed.

The gradient-norm all-reduce is global, so a survivor that finished it knows every rank entered it; the
survivors that did not finish it hold `state_T` and the restarted job widens the scope to their stages
(`Recovery.rejoin`), so no case ends in a wrong state.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from moevement.recovery.live_state import save_kept
from moevement.storage.host_memory import write_json_atomic
from parallelisms import collectives
from parallelisms.distributed import sever_connections
from trainer.run import rank_shell
from trainer.run.fault_tolerance import host_job_dir, host_rank_dir
from trainer.run.startup import process_start_time

# Where communication code runs: torch.distributed (its collectives, functional collectives, FSDP's and
# pipelining's waits) and the trainer's one door to it.
_TORCH_DISTRIBUTED = Path(dist.__file__).resolve().parent
_COLLECTIVES = Path(collectives.__file__).resolve()
_TORCH_OPS = (Path(dist.__file__).resolve().parent.parent / "_ops.py").resolve()  # torch's operator dispatch
_COMMUNICATION_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
# What the one-line summary quotes of a gloo error when it carries one of these (display only).
GLOO_GISTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out")


_SIGTERM_AT: list[float] = []  # when SIGTERM reached this process: a later generation's guard stops at once


class WorkerStopped(BaseException):
    """SIGTERM while this rank's state is consistent: the torchrun agent is stopping the job's workers.

    A BaseException, so library code that catches `Exception` cannot swallow it."""


def peer_failure(error: BaseException) -> bool:
    """Whether `error` (or an error it wraps, as pipelining's stage errors and the replication thread's
    do) is the job stopping or a failed communication (a peer gone, an operation without progress for
    `fault.timeout_s`), rather than a bug here."""
    return _peer_error(error) is not None


def communication_failure(error: BaseException) -> bool:
    """Whether `error` is a failed communication, by type or origin, whatever its message says:

    - a `torch.distributed.DistError`: nccl's watchdog aborting a timed-out or failed operation
      (`DistBackendError`, the process kept alive by `TORCH_NCCL_ASYNC_ERROR_HANDLING=2`, see
      `parallelisms.distributed.configure_nccl_error_handling`), the store, the network;
    - a plain `RuntimeError` raised inside communication code (its innermost frame is in `torch.distributed`
      or `parallelisms/collectives.py`, or is torch's operator dispatch running a c10d operator, as the wait
      of a functional collective does inside DTensor's `full_tensor`): gloo reports a closed connection or a
      timeout untyped, from the wait of the operation. A wrong argument is caught before the call
      (`collectives.DeviceNotServed`, a `ValueError`)."""
    if isinstance(error, dist.DistError):
        return True
    if type(error) is not RuntimeError or error.__traceback__ is None:
        return False
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = Path(tb.tb_frame.f_code.co_filename).resolve()
    return where == _COLLECTIVES or _TORCH_DISTRIBUTED in where.parents or _c10d_operator(tb.tb_frame, where)


def _c10d_operator(frame, where: Path) -> bool:
    """Whether `frame` (at `where`) is torch's operator dispatch (`torch/_ops.py`) running an operator of a
    communication namespace (`c10d`, `_c10d_functional`, ...): told by the operator object, not by a message."""
    if where != _TORCH_OPS:
        return False
    op = frame.f_locals.get("self")
    name = getattr(op, "_qualified_op_name", None)  # an operator's packet
    if name is None and callable(getattr(op, "name", None)):  # one of its overloads
        name = op.name()
    return isinstance(name, str) and name.partition("::")[0] in _COMMUNICATION_NAMESPACES


def _peer_error(error: BaseException | None) -> BaseException | None:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, WorkerStopped) or communication_failure(error):
            return error
        error = error.__cause__ or error.__context__
    return None


class StopGuard:
    """Turns SIGTERM into `WorkerStopped` at points where this rank's state is consistent.

    `phase`: "setup" (SIGTERM exits at once, as a preemption), "training", "applying" (optimizer step of
    `step` to its `end`; SIGTERM waits), "recovering", "stopping" (SIGTERM is ignored; `stopped_in` is the
    phase it stopped in). `applied`: the last iteration whose update is done. `keep_at_setup`: what a
    SIGTERM in the setup phase keeps first (a survivor's state kept in memory), returning what it kept."""

    def __init__(self, rank: int, preempted_line, keep_at_setup=None):
        self.rank, self.preempted_line, self.keep_at_setup = rank, preempted_line, keep_at_setup
        self.phase, self.stopped_in, self.step, self.applied = "setup", "", 0, 0
        self.sigterm_at: float | None = None
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if _SIGTERM_AT:  # torchrun stopped the job while this process left its previous generation
            self._on_sigterm(signal.SIGTERM, None)

    def stop(self) -> None:
        """The rank stops training now (an error or SIGTERM); later signals only wait for its exit."""
        if self.phase != "stopping":
            self.stopped_in, self.phase = self.phase, "stopping"

    def _on_sigterm(self, signum, _frame) -> None:
        self.sigterm_at = self.sigterm_at or time.time()
        _SIGTERM_AT.append(self.sigterm_at)
        if self.phase in ("training", "recovering"):
            self.stop()
            raise WorkerStopped("SIGTERM from the torchrun agent")
        if self.phase == "setup":
            kept = self.keep_at_setup() if self.keep_at_setup else "nothing new to keep"
            print(self.preempted_line(self.step, kept), flush=True)
            os._exit(128 + signum)

    def optimizer_step_begins(self, *_args) -> None:
        """Optimizer step pre-hook: from here until `applied`, the update of `step` must complete."""
        if self.phase == "training":
            self.phase = "applying"

    def done(self, step: int) -> None:
        """Iteration `step` is applied and logged; a SIGTERM that arrived meanwhile stops the rank now."""
        self.phase, self.applied = "training", step
        if self.sigterm_at is not None:
            self.stop()
            raise WorkerStopped("SIGTERM from the torchrun agent")

    @contextmanager
    def recovering(self):
        self.phase = "recovering"
        try:
            yield
        finally:
            self.phase = "training"


def keep_state_and_exit(guard: StopGuard, keep_live_state, error: BaseException) -> None:
    """Another worker died (or the job is stopping): keep this rank's live state if it is consistent, say
    so in one line, and exit at once (torchrun restarts the job; nothing else here is needed)."""
    error = _peer_error(error) or error
    sigterm = isinstance(error, WorkerStopped)
    how = "SIGTERM from the torchrun agent" if sigterm else _first_line(error)
    detected = {"how": how, "time": guard.sigterm_at if sigterm else time.time()}
    guard.stop()
    if guard.stopped_in == "recovering":
        kept = "no live state (it was recovering; its stage replays)"
    else:
        next_iteration = guard.step + 1 if guard.stopped_in == "applying" else guard.applied + 1
        nbytes = keep_live_state(next_iteration, detected)
        kept = f"live state of iteration {next_iteration}, {nbytes / 1e6:.1f} MB" if nbytes else "no live state"
    when = f" (detected at unix={detected['time']:.3f})"
    if sigterm:
        print(guard.preempted_line(guard.step, kept) + when, flush=True)
    else:
        print(f"failure detected: rank {guard.rank} at step {guard.step} by {how}; kept {kept}{when}", flush=True)
        if not isinstance(error, dist.DistError) and not any(g in str(error) for g in GLOO_GISTS):
            # told only by where it was raised, with no gist we know: the whole record, to stderr
            traceback.print_exception(error, file=sys.stderr)
            sys.stderr.flush()
    os._exit(143 if sigterm else 75)


def _first_line(error: BaseException) -> str:
    """The gist of a collective's error: the gloo gist it carries, else its first line."""
    text = str(error)
    marker = next((m for m in GLOO_GISTS if m in text), None)
    if marker is not None:
        return f"a collective failed ({marker})"
    lines = text.strip().splitlines()
    return (lines[0] if lines else "")[:160]


def rejoins_in_place(error: BaseException) -> bool:
    """Whether this rank survives the death behind `error` in place: it runs under a rank shell, which
    replaces the dead worker (trainer/run/rank_shell.py), and learned of the death from a failed communication
    (SIGTERM means torchrun is stopping every worker: its restart takes over)."""
    under_shell = os.environ.get(rank_shell.ROLE) == "trainer"
    return under_shell and not isinstance(_peer_error(error), WorkerStopped)


def survive_in_place(job, error: BaseException):
    """Another worker died and its rank shell starts a replacement: keep this rank's state in memory if it
    is consistent (as `keep_state_and_exit` decides), release its host state, say so in one line; returns
    the plan of the next generation. The caller drops the job before leaving its groups."""
    guard, detected_at = job.guard, time.time()
    how = _first_line(_peer_error(error) or error)
    guard.stop()
    if guard.stopped_in == "recovering":
        kept, what = None, "no live state (it was recovering; its stage replays)"
    else:
        next_iteration = guard.step + 1 if guard.stopped_in == "applying" else guard.applied + 1
        kept = job.ft.keep_in_memory(next_iteration, {"how": how, "time": detected_at})
        what = f"live state of iteration {next_iteration} in memory" if kept else "no live state"
    accounting = job.accounting.record(detected_at)
    sever_connections()  # peers and this rank's background threads stop waiting on it now
    job.ft.abandon()
    job.logger.close()
    plan = job.plan.next_generation(kept, accounting)
    print(
        f"survivor: rank {guard.rank} pid {os.getpid()} (running since unix={process_start_time():.3f}) at step "
        f"{guard.step}: {how}; kept {what}; joins generation {plan.generation} (detected at unix={detected_at:.3f})",
        flush=True,
    )
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
