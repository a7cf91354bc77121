"""A trainer process's generations: it trains in one and, after a peer's death replaced in place, goes on
in the next, in this same process (docs/design/lifecycle/survival.md). Here the facts of a failure are gathered, the
verdict is taken (`trainer/lifecycle/verdict.py`) and carried out; nothing else decides.

Two places meet a failure: the training loop (`after_training_failure`, where the stop guard knows which
state the rank holds) and the rest of a generation, its start and its finish (`train_generations`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from parallelisms.distributed import leave_generation, peer_stopped_with_an_error, sever_connections
from trainer import event_writer
from trainer.lifecycle import job_end, rank_shell
from trainer.lifecycle.fault_bounds import LATER_GENERATION_JOIN_FACTOR, FaultBounds
from trainer.lifecycle.peer_failure import peer_failure, stopped_by_sigterm
from trainer.lifecycle.start_plan import StartPlan
from trainer.lifecycle.survival import keep_for_torchrun_restart, keep_state_and_exit, survive_in_place
from trainer.lifecycle.survivor_lines import START_FAILED, SurvivorLine
from trainer.lifecycle.verdict import Happened, Verdict, decide


class PeerStopped(Exception):  # noqa: N818 (a state reached, not an error)
    """Another rank stopped with a clean error and said so (one line for the job): this one stops too."""


class NothingToRecover(Exception):  # noqa: N818 (a state reached, not an error)
    """A peer died after the job finished: this rank ends with success."""

    def __init__(self, step: int):
        super().__init__(
            f"rank {dist.get_rank() if dist.is_initialized() else os.environ.get('RANK', '0')} pid {os.getpid()}: "
            f"a peer died after the job finished at step {step}; nothing to recover"
        )


class GenerationNotJoined(Exception):  # noqa: N818 (a state reached, not an error)
    """Not every rank joined an in-place generation within its bound (a hung peer, a replacement that could
    not start): the rank shell hands the recovery to torchrun's restart of every worker."""

    def __init__(self, generation: int, bounds: FaultBounds):
        super().__init__(
            f"restart: generation {generation} was not joined by every rank within {bounds.later_join_s:g} s "
            f"({LATER_GENERATION_JOIN_FACTOR} x fault.timeout_s): torchrun restarts every worker"
        )


class Rejoining(Exception):  # noqa: N818 (a state reached, not an error)
    """Another worker died and is replaced in place: this rank goes on in `plan`'s generation."""

    def __init__(self, plan: StartPlan):
        super().__init__(f"generation {plan.generation}")
        self.plan = plan


def happened(error: BaseException, training: bool, store: dist.Store | None) -> Happened:
    """The facts of `error` for a verdict; torchrun's `store` is asked only about a peer's failure."""
    peer = peer_failure(error)
    return Happened(
        peer_failure=peer,
        sigterm=peer and stopped_by_sigterm(error),
        job_finished=peer and job_end.finished_step(store) is not None,
        peer_said_error=peer and peer_stopped_with_an_error(store),
        under_shell=os.environ.get(rank_shell.ROLE) == "trainer",
        training=training,
        in_a_group=dist.is_initialized(),
    )


def _verdict(error: BaseException, training: bool, store: dist.Store | None) -> Verdict:
    """The verdict on `error` (torchrun's `store` says what peers recorded); the two that end the job's work
    quietly (`DONE`, `PEER_STOPPED`) are raised here, the same wherever the failure struck."""
    verdict = decide(happened(error, training, store))
    if verdict is Verdict.DONE:
        raise NothingToRecover(job_end.finished_step(store)) from None
    if verdict is Verdict.PEER_STOPPED:
        raise PeerStopped from None
    return verdict


def after_training_failure(job, error: BaseException) -> NoReturn:
    """The training loop of `job` ended with `error` (the stop guard stopped the rank): carry out its
    verdict. A survivor replaced in place raises `Rejoining`; one restarted by torchrun exits here."""
    verdict = _verdict(error, True, job.plan.process.store)
    if verdict is Verdict.REJOIN:
        raise Rejoining(survive_in_place(job, error)) from None
    if verdict is Verdict.EXIT_FOR_TORCHRUN:
        job.accounting.keep(job.plan.name(), job.guard.sigterm_at or time.time())
        keep_state_and_exit(job.guard, job.ft.keep_live_state, error)
    raise error


def train_generations(cfg, plan: StartPlan, generation: Callable[[StartPlan], None]) -> None:
    """Run `generation(plan)` (set up, train, finish) and, while a verdict says so, the next generation in
    this process: a survivor of a death replaced in place, or a rank whose peer died while a generation
    started (joined, rebuilt, replayed), with the state it kept before."""
    while True:
        try:
            generation(plan)
            return
        except Rejoining as rejoining:
            plan = rejoining.plan
        except job_end.GenerationCannotForm:
            keep_for_torchrun_restart(cfg, plan)
            raise
        except BaseException as error:
            plan = _after_generation_failure(cfg, plan, error)
        leave_generation()  # the caller's job is gone: nothing refers to this generation's groups any more
        plan.process.startup.marks.clear()  # the next generation's set-up is timed afresh


def _after_generation_failure(cfg, plan: StartPlan, error: BaseException) -> StartPlan:
    """A generation failed outside its training loop: the next generation's plan, or the verdict's raise."""
    verdict = _verdict(error, False, plan.process.store)
    if verdict is Verdict.FALLBACK:
        keep_for_torchrun_restart(cfg, plan)
        raise GenerationNotJoined(plan.generation, plan.process.bounds) from None
    if verdict is not Verdict.REJOIN:
        raise error
    plan = plan.next_generation(plan.kept, plan.accounting, plan.fault)  # the same failure, still to recover
    sever_connections()
    event_writer.say(SurvivorLine(START_FAILED, dist.get_rank(), pid=os.getpid(), generation=plan.generation))
    return plan
