"""MoEvement trainer entry point.

python train.py --config train_configs/debug_moe.toml [--section.key value ...]
torchrun --nproc_per_node N train.py --config ...
python train.py --config ... --dry-run      # parameter counts and per-rank host memory, on the meta device
python train.py --config ... --print-config # the resolved config as TOML; --help lists every key
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import dataclass

from trainer.lifecycle import entry  # imports no torch
from trainer.lifecycle.startup import STARTUP  # first: it notes when the interpreter reached this file

if __name__ == "__main__":
    entry.become_shell_if_wanted(sys.argv[1:])  # under torchrun: supervise, train in a child
    entry.await_word_to_prepare()  # a shell's standby: imports once its shell says so
    entry.set_openmp_wait_policy(sys.argv[1:])

# MKL's GEMMs give the same bits at any thread count, so a replaying rank may use its paused
# neighbours' cores without breaking bit-exactness (moevement/recovery/replay_threads.py). Read at MKL's
# first call; at one thread it costs no measurable time.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import torch

from models import count_params
from moevement.failures import FaultPlan
from moevement.recovery.report import RecoveryFigures
from moevement.storage.cpu_cost import CpuMark
from moevement.strategy import CheckpointStrategy
from parallelisms import collectives
from parallelisms.distributed import device_type, init_distributed, workers_share_agent_store
from parallelisms.elastic import fitting_worlds
from parallelisms.mesh import ParallelDims, build_mesh
from parallelisms.parallelize import BuildOptions, MaterializedStages, ModelParts, parallelize
from trainer import event_writer
from trainer.allocator import reuse_freed_host_memory
from trainer.checkpoint.dense import check_save_target, save_dense
from trainer.checkpoint.events import FinalCheckpointSaved
from trainer.checkpoint.periodic import PeriodicCheckpoints
from trainer.checkpoint.resume import Start, load_start
from trainer.checkpoint.state import training_state_digest
from trainer.config import Config, ConfigError, fault_plan, fit_world, load_config
from trainer.config_help import help_text, to_toml
from trainer.data.batches import TokenBatches, build_data, make_loader
from trainer.estimates import host_estimate, memory_check
from trainer.lifecycle import exit_codes, job_end, rank_shell
from trainer.lifecycle.fault_bounds import fault_bounds
from trainer.lifecycle.generations import after_training_failure, train_generations
from trainer.lifecycle.node_presence import NodeWatch, start_node_beat, this_node
from trainer.lifecycle.process import run_process
from trainer.lifecycle.process_state import ProcessState
from trainer.lifecycle.start_plan import StartPlan, agree_on_attempt, plan_start
from trainer.lifecycle.stop_guard import StopGuard
from trainer.lifecycle.survival import keep_for_torchrun_restart
from trainer.lifecycle.survivor_lines import PREEMPTED, SurvivorLine
from trainer.optim import build_optimizer
from trainer.records.accounting import RunAccounting, kept_path
from trainer.records.event_lines import ElasticLayout, FaultStrike, FinalLine
from trainer.records.metrics import MetricsLogger
from trainer.records.run_record import (
    open_run_record,
    publish_run_folder,
    published_run_folder,
    tell_the_shell_the_run_folder,
)
from trainer.records.window_profile import write_window_profile
from trainer.run.fault_injection import KillSwitch, arm_kill, fired, kill_if_joining, record_fired
from trainer.run.host_paths import claim_host_state
from trainer.run.prebuilt import Prebuilt, prebuild
from trainer.run.strategy_factory import TrainingParts, build_strategy
from trainer.step import DropoutSeeder, evaluate, set_aux_grad_scale, take_expert_load, train_step
from trainer.strategy_registry import strategy_entry

STARTUP.mark("imports")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    # The key listing parses the config classes' source (0.1 s): only for --help, never at a (re)start.
    epilog = help_text() if {"-h", "--help"} & set(argv) else None
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="TOML file under train_configs/")
    parser.add_argument("--dry-run", action="store_true", help="print parameter counts and per-rank host memory; exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    return parser.parse_known_args(argv)


def configure_determinism(cfg: Config) -> None:
    if cfg.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def build_training(cfg: Config, dims: ParallelDims, stages: MaterializedStages | None = None):
    """This rank's model parts (FP32 master weights; bf16 compute via FSDP2 if asked) and their AdamW;
    `stages`: its stage modules as a warm standby materialised them (None: built here)."""
    t = cfg.training
    micro_batch_shape = (t.batch_size // (t.micro_batches * cfg.parallelism.dp), t.seq_len)
    opts = BuildOptions(
        seed=cfg.job.seed,
        micro_batch_shape=micro_batch_shape,
        micro_batches=t.micro_batches,
        mixed_precision=t.mixed_precision,
        cpu_bf16_gemm=t.cpu_bf16_gemm,
        loss_chunk_tokens=t.loss_chunk_tokens,
        activation_checkpoint=t.activation_checkpoint,
        compile_blocks=t.compile,
    )
    model = parallelize(cfg.model, dims, opts, stages)
    # A pipeline schedule divides all gradients by the micro-batch count itself.
    set_aux_grad_scale(model.view, 1.0 if model.schedule is not None else 1.0 / t.micro_batches)
    return model, build_optimizer(model.view, t)


def stop_guard(cfg: Config, rank: int, plan: StartPlan) -> StopGuard:
    """SIGTERM (the torchrun agent stopping the workers after a death, or a scheduler's preemption notice).

    Before training starts the rank exits at once (a survivor joining a new generation in place first
    writes the state it kept in memory to host memory); during training it stops at a consistent point and keeps
    its live state in host memory for a torchrun restart (trainer/lifecycle/survival.py). Host state is committed
    atomically (docs/design/safety.md, "Atomicity"), so nothing is left half-written."""

    def preempted_line(step: int, kept: str, detected_unix: float | None = None) -> SurvivorLine:
        strategy = cfg.checkpoint.strategy
        resumes = {
            "moevement": "a torchrun restart resumes from it, a relaunch from the newest persisted sparse checkpoint",
            "none": "no checkpoint: a restart or relaunch starts over",
        }.get(strategy, f"a torchrun restart resumes from the newest {strategy} checkpoint, a relaunch starts over")
        if cfg.parallelism.elastic:
            resumes = "an elastic job's restart or relaunch resumes from the newest periodic dense checkpoint"
        return SurvivorLine(PREEMPTED, rank, step, kept=kept, detected_unix=detected_unix, resumes=resumes)

    keep = None
    if plan.kept is not None or plan.accounting is not None:
        keep = functools.partial(keep_for_torchrun_restart, cfg, plan)
    held = plan.kept.next_iteration - 1 if plan.kept is not None else 0  # a survivor holds a later state
    return StopGuard(rank, preempted_line, plan.process, keep, step=held)


def inject_failures(job: Job, step: int, elapsed_s: float) -> int:
    """Before iteration `step`: crash this process, or fail ranks in place and recover them.

    Returns the iteration to run next: `step`, or an interval baseline's rollback target."""
    faults, rank = job.faults, job.rank
    if faults.crashes_at(step, rank) and not fired(job.plan.process.store, f"crash/{step}/{rank}"):
        job.logger.line(FaultStrike(rank, step), every_rank=True)
        record_fired(job.plan.process.store, f"crash/{step}/{rank}")
        os._exit(exit_codes.INJECTED_CRASH)
    if faults.timed:  # rank 0's clock decides when a timed failure strikes
        clock = torch.tensor([elapsed_s], dtype=torch.float64)
        collectives.broadcast(clock, src=0)
        elapsed_s = float(clock)
    events = faults.at(step, elapsed_s)
    if not events:
        return step
    started = time.perf_counter()
    with job.guard.recovering():
        resume = job.ft.recover(step, events)
    figures = job.ft.last_recovery()
    job.accounting.recovered(len(events), time.perf_counter() - started, figures)
    job.logger.recovery(figures)
    return resume


@dataclass
class Job:
    """Everything one rank's training loop works with."""

    cfg: Config
    rank: int
    dims: ParallelDims
    model: ModelParts
    optimizer: torch.optim.Optimizer
    seeder: DropoutSeeder
    train_batches: TokenBatches
    val_data: list
    logger: MetricsLogger
    ft: CheckpointStrategy
    faults: FaultPlan
    kill: KillSwitch  # this rank's `fault.kill`, if any: the loop names the points it fires at
    guard: StopGuard  # where SIGTERM may stop this rank, and what state it then holds
    accounting: RunAccounting
    plan: StartPlan  # how this process took its place in the job
    periodic: PeriodicCheckpoints  # `checkpoint.dense_interval`'s saves


def fit_layout(cfg: Config, world: int, rank: int) -> tuple[Config, ElasticLayout | None]:
    """The config this rank trains with on `world` processes (`fit_world`), and an elastic job's layout, which
    rank 0 prints in one line now (its run record keeps it once the run folder is open: `open_logger`)."""
    fitted = fit_world(cfg, world)
    if not cfg.parallelism.elastic or rank != 0:
        return fitted, None
    p, configured = fitted.parallelism, cfg.parallelism
    layout = ElasticLayout(
        world, p.pp, p.dp, p.ep, fitted.training.micro_batches, configured.dp, cfg.training.micro_batches
    )
    print(layout.line(), flush=True)
    if "TORCHELASTIC_RUN_ID" in os.environ and workers_share_agent_store():
        print(
            "WARNING: elastic: the workers share their torchrun agent's store, which a node that comes back "
            "cannot join (torch 2.13): launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            flush=True,
        )
    return fitted, layout


def elastic_worlds_line(cfg: Config) -> str:
    """The dry run's line for an elastic job: the process counts it can shrink to, and each one's layout."""
    fits = fitting_worlds(cfg.parallelism, cfg.training.micro_batches)
    worlds = ", ".join(f"{world} (dp={fit.parallelism.dp} micro_batches={fit.micro_batches})" for world, fit in fits)
    return f"elastic: runs on {worlds} processes"


def setup(cfg: Config, plan: StartPlan) -> tuple[Job, int, float]:
    """Process group, data, model, optimizer, optional resume and fault tolerance; (job, last step done, its loss).

    The same steps in the same order at a start and in every later generation (the groups are created in
    the same order on every rank). A `checkpoint.save_final` target that saving would have to destroy is
    refused before anything else."""
    rank_shell.report(f"generation {plan.generation}")
    prebuilt = plan.process.take_prebuilt()  # a warm standby's, in its first generation
    guard = stop_guard(cfg, int(os.environ.get("RANK", "0")), plan)
    # a later generation may not form: the job has ended, or a node is gone with its ranks
    bounds = plan.process.bounds
    watch = job_end.GenerationWatch(plan.generation, NodeWatch(plan.generation, bounds.node_loss_s, *this_node()))
    store = plan.process.join_store()  # torchrun's, kept for the process's later generations
    rank, world = init_distributed(
        bounds.timeout_s, generation=plan.generation, watch=watch, later_join_s=bounds.later_join_s, store=store
    )
    job_end.check_not_finished_earlier(store)  # torchrun restarted every worker after the job's end
    plan = agree_on_attempt(plan)
    plan.process.startup.mark("process_group")
    cfg, layout = fit_layout(cfg, world, rank)
    prebuilt = prebuilt if prebuilt is not None and prebuilt.fits(cfg, rank) else None
    if cfg.checkpoint.strategy != "none":  # before the run record: a refused second run leaves nothing behind
        claim_host_state(cfg, rank, plan.process.locks)
    faults = fault_plan(cfg, world)
    kill_if_joining(faults, rank, plan.kept.next_iteration if plan.kept else None, cfg.fault.kill_signal, store)
    if cfg.checkpoint.save_final:
        check_save_target(cfg.checkpoint.save_final)
    configure_determinism(cfg)
    dims = build_mesh(cfg.parallelism, device_type(), bounds.timeout_s)
    memory_check.warn_if_over(cfg, rank, dims.device)  # before anything of the model is allocated
    if dims.device.type == "cpu" and cfg.training.cpu_reuse_memory:
        reuse_freed_host_memory()
    plan.process.startup.mark("mesh")
    train_batches, val_batches = prebuilt.data if prebuilt else training_data(cfg)
    model, optimizer = build_training(cfg, dims, prebuilt.stages if prebuilt else None)
    plan.process.startup.mark("model")
    seeder = DropoutSeeder(model, cfg.job.seed, dims.dp_rank)
    start = load_start(cfg, model.view, optimizer, plan.in_place)
    logger, lineage = open_logger(cfg, rank, world, dims, plan, start, layout)
    built = prebuilt.parts() if prebuilt else None
    parts = TrainingParts(model, optimizer, dims, seeder, train_batches)
    ft = build_strategy(cfg, parts, logger.line, plan, start.step, built)
    folder = published_run_folder(store)  # past the strategy's collectives: rank 0 has named it
    if rank != 0:
        event_writer.record_events_in(folder)  # a rank on rank 0's host records its own lines
    tell_the_shell_the_run_folder(folder)
    plan.process.startup.mark("strategy")
    optimizer.register_step_pre_hook(guard.optimizer_step_begins)  # after the checkpointer's copy wait
    say = functools.partial(logger.line, every_rank=True)  # a dying rank's `fault:` line, recorded where it can be
    kill = arm_kill(faults, rank, model, optimizer, guard, seeder, cfg.fault.kill_signal, say)
    step, loss = ft.resume(start.step, start.loss)
    rank_shell.report(f"training {step + 1}")  # set up and recovered: the shell's standby may prepare now
    logger.start(step + 1)
    restarted = ft.last_recovery()  # a restarted generation's rejoin or restart, if it was one
    logger.recovery(restarted)
    logger.catch_up(step, ft.logged_scalars)  # iterations the survivors finished after rank 0 died
    val_data = validation_data(cfg, val_batches, dims)
    job = Job(
        cfg,
        rank,
        dims,
        model,
        optimizer,
        seeder,
        train_batches,
        val_data,
        logger,
        ft,
        faults,
        kill,
        guard,
        run_accounting(cfg, rank, step, plan, restarted),
        plan,
        PeriodicCheckpoints(cfg, bounds.timeout_s, kill.in_background, lineage, logger.line),
    )
    return job, step, loss


def prebuild_standby() -> Prebuilt | None:
    """In a rank shell's standby, before its activation: what it can build of its rank without the job
    (`trainer/run/prebuilt.py`), when `fault.standby_prebuild` asks. Anything that goes wrong leaves it to
    setup after the activation, which reports a bad config or data itself (one line here, on stderr)."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        args, overrides = parse_args(sys.argv[1:])
        cfg = load_config(args.config, overrides)
        if not cfg.fault.standby_prebuild:
            return None
        configure_determinism(cfg)
        if device_type() == "cpu" and cfg.training.cpu_reuse_memory:
            reuse_freed_host_memory()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return prebuild(cfg, rank, world, training_data, cfg.fault.standby_warm_up)
    except Exception as error:
        print(f"standby: rank {rank}: nothing prebuilt ({type(error).__name__}: {error})", file=sys.stderr, flush=True)
        return None


def training_data(cfg: Config):
    """(training batches, validation batches) of `cfg.data`, refusing a model whose vocabulary is smaller than
    the tokenizer's."""
    tokenizer, train_batches, val_batches = build_data(
        cfg.data, cfg.training.seq_len, cfg.training.batch_size, cfg.training.micro_batches, cfg.job.seed
    )
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"config key 'model.vocab_size' ({cfg.model.vocab_size}) is smaller than the "
            f"tokenizer's vocabulary ({tokenizer.vocab_size}, data.tokenizer={cfg.data.tokenizer!r})"
        )
    return train_batches, val_batches


def open_logger(
    cfg: Config,
    rank: int,
    world: int,
    dims: ParallelDims,
    plan: StartPlan,
    start: Start,
    layout: ElasticLayout | None,
) -> tuple[MetricsLogger, str | None]:
    """The run's console lines and records, and the run's lineage (rank 0; None elsewhere): rank 0 opens the
    run record (a new folder, with the config as `start` resolved it and the checkpoint it loaded, or the
    folder of the run a restarted generation continues), records its events there from now on (the elastic
    `layout` it printed first), names it for the other ranks and the rank shells, and says where the run
    starts (`start.events`)."""
    run_dir, continued, lineage = None, False, None
    if rank == 0:
        record = open_run_record(start.resolved, world, sys.argv, plan.restarted, start.source)
        run_dir, continued, lineage = record.path, record.continued, record.lineage
        event_writer.record_events_in(run_dir)
        publish_run_folder(plan.process.store, run_dir)
    logger = MetricsLogger(cfg, rank, dims.pp_rank, run_dir, continued, dims.device)
    logger.line(f"run: {run_dir}" + (" (continued by a later generation of the run)" if continued else ""))
    if layout is not None:
        event_writer.record(layout)
    for event in start.events:
        logger.line(event)
    return logger, lineage


def validation_data(cfg: Config, val_batches: TokenBatches | None, dims: ParallelDims) -> list:
    """This data-parallel rank's share of the first `training.val_batches` validation batches (none without
    a validation split)."""
    if val_batches is None:
        return []
    count = min(cfg.training.val_batches, val_batches.num_batches)
    return [val_batches.val_batch(i, dims.dp_rank, cfg.parallelism.dp) for i in range(count)]


def run_accounting(
    cfg: Config, rank: int, step: int, plan: StartPlan, restarted: RecoveryFigures | None
) -> RunAccounting:
    """The run's accounting from iteration step+1 on, carried on from an earlier generation if any, with the
    recovery that restarted this one (`restarted`: its line's figures). Collective; kept in memory by
    survivors of an in-place replacement, else in the job's host directory (`kept_path`)."""
    tokens = cfg.training.batch_size * cfg.training.seq_len
    accounting = RunAccounting(step + 1, tokens, kept_path(cfg, rank))
    accounting.carry_on(plan.name(), plan.accounting, plan.in_place, restarted)
    return accounting


def iteration(job: Job, step: int, inputs: torch.Tensor, labels: torch.Tensor, started: float) -> float:
    """Run iteration `step` (snapshot, forward/backward, optimizer step), log it; returns its loss."""
    cfg, ft = job.cfg, job.ft
    job.seeder.begin(step)
    ft.begin(step)
    job.kill.at("snapshot")
    result = train_step(
        job.model, job.optimizer, inputs, labels, step, cfg.training, job.dims, lambda: job.kill.at("clip")
    )
    tokens, gate_probs = take_expert_load(job.model.view)
    scalars = {"loss": result.loss, "aux_loss": result.aux_loss, "lr": result.lr, "grad_norm": result.grad_norm}
    ft.end(step, {**scalars, "clip_coef": result.clip_coef, "loss_scale": 1.0, "skipped": False}, tokens, gate_probs)
    elapsed = time.perf_counter() - started
    job.accounting.iteration(step, elapsed)  # before `done`: a rank stopped there keeps iteration `step` done
    job.guard.done(step)
    job.kill.at("replication")
    job.logger.step(step, scalars, ft.metrics(), tokens, elapsed, job.accounting.elapsed())
    validate_if_due(job, step)
    job.periodic.after_iteration(step, result.loss, job.model.view, job.optimizer)
    return result.loss


def validate_if_due(job: Job, step: int) -> None:
    """The validation loss after iteration `step` when `training.val_every` asks for one (collective)."""
    cfg = job.cfg
    if cfg.training.val_every and step % cfg.training.val_every == 0 and job.val_data:
        job.kill.at("validation")
        job.logger.validation(step, evaluate(job.model, job.val_data, job.dims, cfg.training.micro_batches))


def run(job: Job, step: int, loss: float) -> tuple[int, float, str | None]:
    """Train iterations step+1..last (a baseline's recovery rolls back and the loader restarts there), then
    digest the final training state where it lives (collective; rank 0 gets the digest). Returns (last step,
    its loss, the state digest).

    When another worker dies before every rank has taken part in the digest, this rank keeps its live state and exits
    (trainer/lifecycle/survival.py): a restarted job then has at most the dead ranks' stages to replay."""
    job.guard.phase, job.guard.applied = "training", step
    try:
        try:
            first, cpu = step, CpuMark.now()
            if step > 0:  # resumed after `step`: a death may have cut its validation short, so it runs again
                validate_if_due(job, step)
            step, loss = train_loop(job, step, loss)
            if job.cfg.metrics.cpu_cost:
                print(CpuMark.now().line_since(cpu, job.rank, step - first), flush=True)
            job.kill.at("digest")
            digest = training_state_digest(job.model.view, job.optimizer)
            save_final_if_asked(job, step, loss, digest)
            job.guard.phase = "setup"  # finishing: SIGTERM exits at once again
            return step, loss, digest
        except BaseException:
            job.guard.stop()  # a SIGTERM from here on only waits (one arriving before this line lands below)
            raise
    except BaseException as error:
        after_training_failure(job, error)  # the verdict: rejoin in place, exit for torchrun, or raise


def save_final_if_asked(job: Job, step: int, loss: float, digest: str | None) -> None:
    """`checkpoint.save_final` after the last iteration `step`, every rank writing its part (collective),
    under the training loop's survival rules: a peer's death before the publication leaves this rank its
    state of `step` to rejoin with, and the next generation saves again. Once the checkpoint is published,
    rank 0 prints the `final` line (`digest`: the state's) and records the job's end, before it tells the
    others (trainer/lifecycle/job_end.py): the line is printed once, whoever dies when."""
    target = job.cfg.checkpoint.save_final
    if not target:
        return
    job.kill.at("save")

    def published() -> None:
        if job.rank == 0:
            job.logger.line(FinalLine(step, loss, digest))
            job_end.record_finished(job.plan.process.store, step)
        job.kill.at("saved")

    save_dense(target, job.model.view, job.optimizer, step, loss, job.cfg, published)
    job.logger.line(FinalCheckpointSaved(step, str(target)))


def train_loop(job: Job, step: int, loss: float) -> tuple[int, float]:
    cfg = job.cfg
    last_step = cfg.training.stop_at or cfg.training.steps
    next_step = step + 1
    while next_step <= last_step:
        loader = make_loader(
            job.train_batches,
            next_step,
            job.dims.dp_rank,
            cfg.parallelism.dp,
            cfg.data.num_workers,
            end_step=last_step + 1,
        )
        next_step = last_step + 1
        started = time.perf_counter()  # an iteration's time includes loading its batch, not a recovery
        for step, inputs, labels in loader:
            job.guard.step = step
            rank_shell.report(f"step {step}")  # the iteration a death strikes in (the recovery's fault_step=)
            if job.faults:
                resume = inject_failures(job, step, job.accounting.elapsed())
                if resume != step:
                    next_step = resume
                    break
                started = max(started, job.accounting.last_recovery_end)
            loss = iteration(job, step, inputs, labels, started)
            started = time.perf_counter()
    return step, loss


def finish(job: Job, step: int, loss: float, digest: str | None) -> None:
    """Close the periodic saves and the checkpointer, print the accounting and final lines, and record the
    job's end (trainer/lifecycle/job_end.py): rank 0 once its results are out (before its `final` line; with
    `checkpoint.save_final`, both already happened at its publication), every rank once past the last
    collective."""
    cfg = job.cfg
    job.periodic.close()
    if cfg.metrics.profile and job.rank == 0 and strategy_entry(cfg.checkpoint.strategy).window_profile:
        inputs = job.ft.planned_window()
        job.logger.line(write_window_profile(cfg.metrics.profile, inputs, cfg.checkpoint.replicas))
    totals = job.ft.close()
    job.logger.line(job.accounting.summary(totals, totals.get("lost_tokens", 0.0)))
    job.accounting.drop()
    job.kill.at("accounting")
    if not cfg.checkpoint.save_final:  # else both happened once the checkpoint was published
        if job.rank == 0:
            job_end.record_finished(job.plan.process.store, step)
        if digest is not None:
            job.logger.line(FinalLine(step, loss, digest))
    job_end.record_left(job.plan.process.store, job.rank, step)
    if job.rank != 0:
        job_end.await_finished(job.plan.process.store, job.plan.process.bounds.timeout_s)
    job.kill.at("final")
    job.logger.close()


def one_generation(cfg: Config, plan: StartPlan) -> None:
    """Set up, train and finish this rank's part of the job in the generation `plan` names."""
    job, step, loss = setup(cfg, plan)
    finish(job, *run(job, step, loss))


def main(argv: list[str] | None = None, prebuilt: Prebuilt | None = None) -> int:
    """Train (or `--dry-run`, `--print-config`) as the command line `argv` says; `prebuilt`: what this process
    built as a rank shell's warm standby before its activation."""
    # The ranks of a job share one stdout; with unbuffered output (PYTHONUNBUFFERED) `print` writes a
    # line's text and its newline separately and another rank's line could land between them.
    # Line-buffered text is written whole.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True, write_through=False)
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)

    def work() -> None:
        cfg = load_config(args.config, overrides)
        if args.print_config:
            print(to_toml(cfg), end="")
        elif args.dry_run:
            total, active = count_params(cfg.model)
            print(f"params total={total} active={active}")
            from trainer.estimates import memory_report  # the dry run's own: meta-device traces

            print("\n".join(memory_report.report(cfg)))
            print("\n".join(host_estimate.report(cfg)))
            from trainer.estimates import placement_report  # the replicas' placement under node losses

            print(placement_report.line(cfg))
            if cfg.parallelism.elastic:
                print(elastic_worlds_line(cfg))
        else:
            plan = plan_start(process)
            process.bounds = fault_bounds(cfg.fault)
            train_generations(cfg, plan, functools.partial(one_generation, cfg))

    process = ProcessState(STARTUP, prebuilt=prebuilt)  # what outlives this process's generations
    return run_process(work, process)


if __name__ == "__main__":
    prebuilt = entry.await_standby_activation(prebuild_standby)  # a rank shell's warm standby: built, waiting
    if prebuilt is not None:
        prebuilt.activated()  # activated: its host buffers' watch stops before anything is built
    start_node_beat()  # a shell's trainer: its node is there
    sys.exit(main(prebuilt=prebuilt))
