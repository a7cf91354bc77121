"""Process-group set-up: torchrun's environment, or a one-process group otherwise."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


_TIMEOUT: datetime.timedelta | None = None  # the bound `init_distributed` was given


def init_distributed(timeout_s: float | None = None) -> tuple[int, int]:
    """Initialise the default process group (gloo on CPU, nccl on GPU); return (rank, world).

    `timeout_s`: a collective or point-to-point operation that makes no progress for this long fails
    (a hung or stopped peer is detected, not waited for); None keeps PyTorch's default. Groups created
    later get the same bound (`bounded_backend`)."""
    global _TIMEOUT
    if not dist.is_initialized():
        _TIMEOUT = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        limit = {} if _TIMEOUT is None else {"timeout": _TIMEOUT}
        backend = "nccl" if device_type() == "cuda" else "gloo"
        if "RANK" in os.environ:  # launched by torchrun
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if attempt:
                # A restarted job may meet the same agent store as the attempt before: keys of its own
                # (the old attempt's gloo addresses would otherwise be read and refused).
                store, rank, world = next(dist.rendezvous("env://"))
                dist.init_process_group(
                    backend, store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank, world_size=world, **limit
                )
            else:
                dist.init_process_group(backend, **limit)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def bounded_backend() -> tuple[str, object] | None:
    """(backend, options) under which a new group gets the default group's bound (a device mesh's groups are
    otherwise created with PyTorch's 30-minute default, and gloo reads its receive timeout at creation);
    None without a bound or in a one-process run."""
    if _TIMEOUT is None or dist.get_world_size() == 1:
        return None
    backend = dist.get_backend()
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = _TIMEOUT
    return backend, options


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
