"""Process-group set-up: torchrun's environment, or a one-process group otherwise.

The rule every group of the trainer follows (docs/design/models-and-parallelism.md, "Process groups and collectives"):
it serves CPU tensors (control tensors, object collectives, host-memory snapshots) and the model's device. The default
group is `cpu:gloo,cuda:nccl` on GPU and gloo (which serves both) on CPU; the device mesh's groups take the default
group's backend, the replication group is gloo. Every collective goes through `parallelisms.collectives`,
which checks it."""

from __future__ import annotations

import datetime
import functools
import gc
import os
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_backend(device: str) -> str:
    """The default group's backend when the model lives on `device` ("cpu" or "cuda"): it serves both."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
STORE_ERRORS = (RuntimeError, dist.DistError)  # what a store operation raises when the store is gone or hung
KEPT_STORE = "MOEVEMENT_KEPT_STORE"  # set where rank 0's shell keeps the round's store (trainer.lifecycle.store_keeper)
# ProcessGroupNCCL's ErrorHandlingMode: 0 NoHandling, 1 TearDown, 2 CleanUpOnly, 3 SkipCleanUp
_NCCL_MODES = {"0": "NoHandling", "1": "TearDown", "2": "CleanUpOnly", "3": "SkipCleanUp"}


def configure_nccl_error_handling() -> str | None:
    """Before the first nccl group, under torchrun: how nccl's watchdog handles a failed or timed-out
    operation. 2 (CleanUpOnly) aborts the communicators and leaves the process alive, so the error reaches
    the training thread as `DistBackendError` and a survivor of a peer's death keeps its state
    (trainer/lifecycle/survival.py). torchrun's agent sets 1 (TearDown: the watchdog kills the process, state and all)
    whenever its own environment names no value, and a worker cannot tell that default from a user's 1: 1 is
    replaced by 2, and so is no value (nccl's own default is 3). A user's 0 or 3 is kept (3 tears the process
    down without cleaning up: use it only when `ncclCommAbort` itself hangs). Returns the line saying what
    was set or kept (printed by rank 0)."""
    value = os.environ.get(NCCL_ERROR_HANDLING)
    if value in (None, "1"):
        os.environ[NCCL_ERROR_HANDLING] = "2"
        was = "unset (nccl's default: 3, SkipCleanUp)" if value is None else "1 (TearDown, torchrun's default)"
        line = f"nccl: {NCCL_ERROR_HANDLING}=2 (CleanUpOnly) instead of {was}"
        line += ", so a rank that outlives a failed peer keeps its state"
    else:
        mode = _NCCL_MODES.get(value, "unknown")
        line = f"nccl: {NCCL_ERROR_HANDLING}={value} ({mode}) kept as set"
        if value != "2":
            line += "; a rank that outlives a failed peer may not keep its state (2, CleanUpOnly, lets it)"
    if os.environ.get("RANK") == "0":
        print(line, flush=True)
    return line


def init_distributed(
    timeout_s: float | None = None,
    backend: str | None = None,
    generation: int = 0,
    watch: Callable[[], None] | None = None,
    later_join_s: float | None = None,
    store: dist.Store | None = None,
) -> tuple[int, int]:
    """Initialise the default process group; return (rank, world).

    `timeout_s`: a collective or point-to-point operation that makes no progress for this long fails
    (a hung or stopped peer is detected, not waited for); None keeps PyTorch's default. Groups created
    later are given the same bound by their creator (`bounded_backend`, the device mesh). `backend`: None
    for `default_backend` of this machine; another string serving both devices (`cpu:gloo,cuda:gloo`: two
    processes sharing one GPU, which nccl refuses) only for checks. `generation`: under torchrun, the
    in-place generation this process joins (`join_generation`, bounded by `later_join_s` and polling `watch`
    meanwhile when it is a later one), on torchrun's `store` (`connect_torchrun_store`; None: connect for
    this join only)."""
    if not dist.is_initialized():
        backend = backend or default_backend(device_type())
        if "RANK" in os.environ:  # launched by torchrun
            if "nccl" in backend:
                configure_nccl_error_handling()
            if device_type() == "cuda":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            join_generation(generation, backend, watch, timeout_s, later_join_s, store)
        else:
            if device_type() == "cuda":
                torch.cuda.init()  # the current device, chosen before DeviceMesh would guess one (and warn)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def workers_share_agent_store() -> bool:
    """Whether torchrun's workers use their agent's store (its default; `TORCHELASTIC_USE_AGENT_STORE`), which
    outlives every worker and keeps earlier rounds' keys, rather than a store of each round's own (hosted by
    rank 0, or by rank 0's store keeper: `trainer.lifecycle.store_keeper`, whose clients are told they use an
    agent's store)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(False) and KEPT_STORE not in os.environ


def store_round() -> str:
    """The prefix of this torchrun round's keys on the workers' store, the same on every rank of the round.

    By default torchrun's workers share their agent's store, which keeps the keys of earlier rounds: a round
    is named by torchrun's restart count. Where every round's workers get a store of their own
    (`TORCHELASTIC_USE_AGENT_STORE` false, as `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` makes it: an elastic
    job a node comes back to needs it, `parallelisms/elastic.py`), nothing of an earlier round is there, and
    restart counts name nothing: a node that joined later counts fewer restarts than the others."""
    if not workers_share_agent_store():
        return "round"
    return f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


_WATCH_S = 0.5  # how often a later generation's join asks whether the generation can still form


def join_generation(
    generation: int,
    backend: str | None = None,
    watch: Callable[[], None] | None = None,
    timeout_s: float | None = None,
    later_join_s: float | None = None,
    store: dist.Store | None = None,
) -> None:
    """Start the default group of in-place generation `generation` of this torchrun attempt, with every rank
    of the job under its own number (collective: it returns once all have joined, or raises after the bound).

    Each generation and each torchrun restart meets on its own keys of torchrun's `store` (a restarted job
    or generation would otherwise read the old one's gloo addresses and be refused): the one this process
    connected to once (`connect_torchrun_store`) and keeps for its later generations (None: connect for this
    join only).

    A later generation is waited for `later_join_s` (longer than the bound `timeout_s`: a peer that died
    while the previous generation started may have left the others waiting for it in that generation's
    group creation, which fails only after the bound; `trainer.lifecycle.fault_bounds`); the group's
    operations get the bound itself once every rank has joined (None: PyTorch's default). While a later
    generation is waited for, `watch` is called about twice a second: it raises to give up on a generation
    that can no longer form (the job has ended meanwhile)."""
    store = dist.PrefixStore(
        f"{store_round()}/generation{generation}", store if store is not None else connect_torchrun_store()
    )
    bound = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    join_s = later_join_s if generation else timeout_s
    limit = {} if join_s is None else {"timeout": datetime.timedelta(seconds=join_s)}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = backend or default_backend(device_type())
    join = functools.partial(dist.init_process_group, backend, store=store, rank=rank, world_size=world, **limit)
    _on_a_thread(join, watch if generation else None)
    if bound is not None and generation > 0:
        dist.distributed_c10d._set_pg_timeout(bound)


def _on_a_thread(call, watch: Callable[[], None] | None = None) -> None:
    """Run `call` on a helper thread while the main thread waits in short sleeps, so a signal (SIGTERM from
    torchrun) is handled at once instead of after a blocking wait for peers that may never come; `watch`, if
    given, is called every `_WATCH_S` and may raise to stop waiting (the helper thread is a daemon: it ends
    with the process)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # re-raised on the calling thread
            failure.append(e)

    thread = threading.Thread(target=run, name="moevement-join", daemon=True)
    thread.start()
    watched = time.monotonic()
    while thread.is_alive():
        thread.join(0.05)
        if watch is not None and time.monotonic() - watched >= _WATCH_S:
            watch()
            watched = time.monotonic()
    if failure:
        raise failure[0]


def connect_torchrun_store() -> dist.Store:
    """Under torchrun: this process's handle on torchrun's store (its agent's, which outlives every worker
    and restart; or, where each round has a store of its own, the one rank 0 hosts), made once per process
    and kept by its caller for every later generation (`trainer.lifecycle.process_state.ProcessState`)."""
    return next(dist.rendezvous("env://"))[0]


def _stop_key() -> str:
    return f"{store_round()}/stopped-with-an-error"


def announce_clean_stop(store: dist.Store | None, rank: int) -> None:
    """This rank stops with a clean error (one line, exit status 2): tell the other ranks through torchrun's
    `store` (None: this process joined no generation under torchrun), so that they stop the same way instead
    of treating its departure as a death."""
    if store is not None:
        try:
            store.set(_stop_key(), str(rank))
        except STORE_ERRORS:
            pass  # the store is gone: the job is ending anyway


def torchrun_store_client(timeout_s: float) -> dist.TCPStore:
    """A client of its own to torchrun's store (MASTER_ADDR:MASTER_PORT), usable before any process group and
    beside another thread's blocking waits on the joined client."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def said_once_for_the_job(say: Callable[[], None], wait_s: float = 10.0) -> None:
    """The job's one error line. Under torchrun the first rank of this round to claim it on torchrun's store
    `say`s its error and marks it said; every other rank says nothing, and waits for that mark (at most
    `wait_s`) before it exits, since torchrun stops the other workers as soon as one exits and could stop
    the sayer before its line. So an error every rank meets (a bad config, a host directory that cannot be
    made, a damaged data shard every rank reads its own part of) is one line for the job, whichever rank met
    it first. Without torchrun, or when its store cannot be reached, the process says its own."""
    if "MASTER_ADDR" not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        say()
        return
    key = f"{store_round()}/error"
    try:
        store = torchrun_store_client(wait_s)
        first = store.add(f"{key}/claimed", 1) == 1
    except (*STORE_ERRORS, ValueError):
        say()  # no store: better a line per rank than none
        return
    if first:
        say()
    try:
        if first:
            store.set(f"{key}/said", "1")
        else:
            store.wait([f"{key}/said"], datetime.timedelta(seconds=wait_s))
    except (*STORE_ERRORS, ValueError):
        pass  # the store is gone, or the sayer did not get there in time: exit all the same


def peer_stopped_with_an_error(store: dist.Store | None) -> bool:
    """Whether another rank of this attempt stopped with a clean error (`announce_clean_stop`) on torchrun's
    `store` (None: no store, no peer's word)."""
    if store is None:
        return False
    try:
        return store.check([_stop_key()])
    except STORE_ERRORS:
        return False


def sever_connections() -> int:
    """A peer died and this rank leaves its generation: shut down its TCP connections to the other ranks
    (not those of torchrun's store, on either end: rank 0 hosts it where every round's workers have a store
    of their own; nor listening sockets), so that every operation waiting on them fails at
    once, on a thread of this process or on a peer; returns how many. gloo has no abort (pytorch issue
    130345) and closes a group's connections only once nothing refers to the group, which a replication
    round blocked on a live peer would delay by `fault.timeout_s`."""
    store_port = int(os.environ.get("MASTER_PORT", "0"))
    severed = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue  # not a socket (or already closed)
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                ends = (sock.getpeername()[1], sock.getsockname()[1])
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and store_port not in ends:
                    sock.shutdown(socket.SHUT_RDWR)
                    severed += 1
        except OSError:
            pass  # not connected
        finally:
            sock.detach()  # the descriptor stays its owner's
    return severed


def leave_generation() -> None:
    """A peer died: shut every group of this generation down. nccl's communicators are aborted first (all at
    once: one by one can deadlock); a gloo group's connections close once nothing refers to it any more, so
    the caller has dropped its model, pipeline and checkpointer before, and peers still waiting on this rank
    fail at once instead of after the bound."""
    if not dist.is_initialized():
        return
    if "nccl" in dist.get_backend():
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
    gc.collect()


def bounded_backend(timeout_s: float | None) -> tuple[str, object] | None:
    """(backend, options) under which a device mesh's new group gets the default group's backend and the
    bound `timeout_s` (`fault.timeout_s`; its groups are otherwise created with PyTorch's 30-minute default,
    and gloo reads its receive timeout at creation); None without a bound or in a one-process run.

    torch 2.13's `init_device_mesh` takes the timeout only from the options (`_timeout`) and passes it to
    `new_group(timeout=)`, which gives it to every backend of a `cpu:gloo,cuda:nccl` group; the options
    themselves reach the nccl backend only (which requires its own class), gloo's is built from the timeout."""
    if timeout_s is None or dist.get_world_size() == 1:
        return None
    backend = dist.get_backend()
    options = dist.ProcessGroupNCCL.Options() if "nccl" in backend else dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return backend, options


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
