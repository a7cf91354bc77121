"""Whether an exception is a peer's death (a failed communication, or torchrun's SIGTERM) or a bug here.

Under torchrun a dead worker makes the agent send SIGTERM to every other worker of the job; a survivor
learns of the death from that signal (`WorkerStopped`, raised by the stop guard) or earlier from a
communication call that fails because its peer is gone or made no progress for `fault.timeout_s`. Such a
failure is recognised by its type or by where it was raised, never by its wording (`communication_failure`).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from parallelisms import collectives

# Where communication code runs: torch.distributed (its collectives, functional collectives, FSDP's and
# pipelining's waits) and the trainer's one door to it.
_TORCH_DISTRIBUTED = Path(dist.__file__).resolve().parent
_COLLECTIVES = Path(collectives.__file__).resolve()
_TORCH_OPS = (Path(dist.__file__).resolve().parent.parent / "_ops.py").resolve()  # torch's operator dispatch
_COMMUNICATION_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
# What the one-line summary quotes of a gloo error when it carries one of these (display only).
GLOO_GISTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out")


class WorkerStopped(BaseException):
    """SIGTERM while this rank's state is consistent: the torchrun agent is stopping the job's workers.

    A BaseException, so library code that catches `Exception` cannot swallow it."""


def peer_failure(error: BaseException) -> bool:
    """Whether `error` (or an error it wraps, as pipelining's stage errors and the replication thread's
    do) is the job stopping or a failed communication (a peer gone, an operation without progress for
    `fault.timeout_s`), rather than a bug here."""
    return peer_error(error) is not None


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


def peer_error(error: BaseException | None) -> BaseException | None:
    """The peer failure `error` is or wraps (its cause or context chain), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, WorkerStopped) or communication_failure(error):
            return error
        error = error.__cause__ or error.__context__
    return None


def stopped_by_sigterm(error: BaseException) -> bool:
    """Whether the peer failure behind `error` is torchrun's SIGTERM (it stops every worker) rather than a
    failed communication."""
    return isinstance(peer_error(error), WorkerStopped)


def gist(error: BaseException) -> str:
    """The gist of a collective's error: the gloo gist it carries, else its first line."""
    text = str(error)
    marker = next((m for m in GLOO_GISTS if m in text), None)
    if marker is not None:
        return f"a collective failed ({marker})"
    lines = text.strip().splitlines()
    return (lines[0] if lines else "")[:160]
