"""The job's end, a state of the whole job like a generation (docs/design/lifecycle/job-end.md).

Once rank 0 holds the final state digest and the dense checkpoint asked for (`checkpoint.save_final`) is
published, the job has *finished*: a death after that is nothing to recover. Two records on torchrun's store
(its agent's: it outlives every worker of the attempt) say how far the end has come:

- `attempt<a>/finished` = the last step: set by rank 0 before it prints the `final` line (after the
  checkpoint's publication when one is saved), so a rank that dies afterwards is not replaced;
- `attempt<a>/left/<rank>` = the last step: set by each rank once it has passed the job's last collective,
  so nobody waits for it in a later generation.

A trainer tells its rank shell `finished <step>` once it knows the job finished (rank 0 when it records it,
every other rank when it sees the record); a shell whose trainer then dies exits with success and starts no
replacement. A trainer that died earlier is replaced, and its replacement (or a survivor) waiting to join a
generation that can no longer form gives up at once (`check_generation_can_form`): with success when the
job finished, else through torchrun's restart of every worker. A torchrun restart after the job's end (a
worker, or a stopped shell that its child killed, ended after the `final` line) trains nothing again: every
rank of the new attempt finds an earlier attempt's `finished` record and exits with success
(`check_not_finished_earlier`; where the workers share their agent's store, which keeps every attempt's keys).

Training thread only; each call is given torchrun's store (`ProcessState.store`); a missing store (no torchrun)
makes every call here a no-op.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch.distributed as dist

from parallelisms.distributed import STORE_ERRORS, store_round, torchrun_store_client, workers_share_agent_store
from trainer.lifecycle import rank_shell
from trainer.lifecycle.verdict import CannotForm, Waiting, cannot_form


class JobFinished(Exception):  # noqa: N818 (a state reached, not an error)
    """A generation this process waited to join will not form: the job finished at `step`."""

    def __init__(self, generation: int, step: int):
        super().__init__(
            f"rank {os.environ.get('RANK', '0')} pid {os.getpid()}: generation {generation} will not form: "
            f"the job finished at step {step}; nothing to recover"
        )
        self.step = step


class FinishedEarlier(JobFinished):
    """torchrun restarted every worker after the job finished in an earlier attempt of the run."""

    def __init__(self, attempt: int, step: int):
        Exception.__init__(
            self,
            f"rank {os.environ.get('RANK', '0')} pid {os.getpid()}: the job finished at step {step} in attempt "
            f"{attempt} of this torchrun run; nothing to train again",
        )
        self.step = step


class GenerationCannotForm(Exception):  # noqa: N818 (a state reached, not an error)
    """A generation this process waited to join will not form, and the job did not finish: torchrun's restart
    of every worker takes over."""


class PeersLeft(GenerationCannotForm):
    """A generation this process waited to join will not form: every other rank left the job, which did not
    finish (rank 0 died before recording its end): torchrun's restart of every worker takes over."""

    def __init__(self, generation: int):
        super().__init__(
            f"restart: generation {generation} will not form: every other rank has left the job, which did not "
            "record its end: torchrun restarts every worker"
        )


def _finished_key() -> str:
    return f"{store_round()}/finished"


def _left_key(rank: int) -> str:
    return f"{store_round()}/left/{rank}"


def record_finished(store: dist.Store | None, step: int) -> None:
    """Rank 0, the job's results out (the digest held, the checkpoint asked for published): the job finished
    at `step`, recorded on torchrun's `store` (`ProcessState.store`); its shell hears it too."""
    if store is not None:
        try:
            store.set(_finished_key(), str(step))
        except STORE_ERRORS:
            return  # the store is gone: the job is ending anyway
        rank_shell.report(f"finished {step}")


def await_finished(store: dist.Store | None, timeout_s: float) -> int | None:
    """Any rank but 0, past the job's last collective: wait up to `timeout_s` for rank 0's record of the end
    (it comes right after that collective) and tell the shell; the step, or None (no store, or rank 0 died
    before recording it: this rank's death is then replaced, and its replacement gives up)."""
    if store is None:
        return None
    try:
        store.wait([_finished_key()], datetime.timedelta(seconds=timeout_s))
        step = int(store.get(_finished_key()))
    except STORE_ERRORS:
        return None
    rank_shell.report(f"finished {step}")
    return step


def record_left(store: dist.Store | None, rank: int, step: int) -> None:
    """This rank passed the job's last collective: no later generation is to wait for it."""
    if store is not None:
        try:
            store.set(_left_key(rank), str(step))
        except STORE_ERRORS:
            pass  # the store is gone: the job is ending anyway


def check_not_finished_earlier(store: dist.Store | None) -> None:
    """At a start under torchrun: raise `FinishedEarlier` if an earlier attempt of this torchrun run recorded the
    job's end (nothing to check where each round has a store of its own)."""
    if store is None or not workers_share_agent_store():
        return
    for attempt in range(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))):
        key = f"attempt{attempt}/finished"  # `_finished_key` of that attempt (`store_round`)
        try:
            if store.check([key]):
                raise FinishedEarlier(attempt, int(store.get(key)))
        except STORE_ERRORS:
            return  # the store cannot answer: train (a second `final` line of the same state at worst)


def finished_step(store: dist.Store | None) -> int | None:
    """The step the job finished at, if rank 0 recorded its end on `store` (None: not yet, or no store)."""
    try:
        return int(store.get(_finished_key())) if store is not None and store.check([_finished_key()]) else None
    except STORE_ERRORS:
        return None


class GenerationWatch:
    """Polled while this rank waits to join in-place generation `generation`: raises `JobFinished`,
    `PeersLeft`, or the `NodeLost` that `nodes` (given the store) returns for a node gone with its ranks
    (`trainer.lifecycle.node_presence.NodeWatch`), once the generation can no longer form
    (`verdict.cannot_form`). It reads the store through a client of its own: the joining thread's client is
    held by its blocking waits."""

    def __init__(self, generation: int, nodes: Callable[[dist.Store], GenerationCannotForm | None] | None = None):
        self.generation, self.nodes = generation, nodes
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.store: dist.Store | None = None

    def __call__(self) -> None:
        store = self._client()
        if store is None:
            return
        try:
            finished = store.check([_finished_key()])
            others = [_left_key(r) for r in range(self.world) if r != self.rank]
            left = not finished and bool(others) and store.check(others)
            lost = self.nodes(store) if self.nodes is not None and not (finished or left) else None
            why = cannot_form(Waiting(finished, left, lost is not None))
            if why is CannotForm.JOB_FINISHED:
                raise JobFinished(self.generation, int(store.get(_finished_key())))
        except STORE_ERRORS:
            return  # the store cannot answer now: keep waiting for the generation
        if why is CannotForm.PEERS_LEFT:
            raise PeersLeft(self.generation)
        if why is CannotForm.NODE_LOST:
            raise lost

    def _client(self) -> dist.Store | None:
        if self.store is None and "MASTER_ADDR" in os.environ:
            try:
                self.store = torchrun_store_client(30)
            except STORE_ERRORS:
                return None
        return self.store
