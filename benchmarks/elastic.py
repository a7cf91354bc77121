"""Throughput of a job that loses a node for good and gets it back, under three policies, interleaved.

    python -m benchmarks.elastic [--steps 48] [--repair-s 20] [--seed 0] [--policies elastic,wait,restart]
        [--rounds 1] [--strategy none] [--node-loss-s 10] [--dense-interval 4] [--logs DIR]

The job is `debug_moe` at 4 layers on 4 ranks (pp=2 dp=2, a dense checkpoint every `--dense-interval` iterations,
`parallelism.elastic` on) as two emulated nodes of 2 workers each (benchmarks/emulated_nodes.py: two
torchrun agents on this machine). Node 1 is lost for good (its agent and workers SIGKILLed) once the
iteration drawn for the round (`random.Random(seed)`, between 25% and 50% of the steps) has been logged,
and comes back `--repair-s` seconds after the loss. The policies:

- `elastic`: `--nnodes 1:2`: the survivors go on alone (pp=2 dp=1) from the newest dense checkpoint, and
  the job grows back to 4 ranks, again from the newest dense checkpoint, when node 1 returns (a job that
  finishes on node 0 alone before that ends there: node 1 is not started, or stopped if too late to join);
- `wait`: `--nnodes 2:2`: the survivors wait in the rendezvous until node 1 returns, then all resume;
- `restart`: `--nnodes 2:2`, and once a survivor has detected the failure the whole job is stopped (node
  0 killed too) and launched again, as a fresh rendezvous, when node 1 is back.

Each resumes from the newest dense checkpoint of the same folder. With `--strategy` (moevement, or a baseline)
the workers run under rank shells: the survivors first wait for replacements, until node 1 has said nothing
for `--node-loss-s` (`fault.node_loss_s`), and only then exit to torchrun. Each node keeps its host memory in a
directory of its own (a node is a host and its `checkpoint.host_dir`), which a lost node takes with it; with
MoEvement every restart resumes from a newer window in the host memory that remains, re-laid into the new
layout, where there is one (`restart: re-laid window`). Per run it prints every restart of the
job's workers (`event`: the world after it; `detect_s` from its cause, the node's loss or return, to the
first `survivor` record's detection time (a `failure detected`, `preempted` or `survivor` line); `restart_s`
from there to the next generation's `elastic` record; `load_s` to `checkpoint: loaded` (or `restart: re-laid
window`); `resume_s` to its first `step` record, the first iteration not done before it (an iteration done
again is not logged again, so this includes the iterations redone); `lost_iters` the iterations reached
before and done again), then the run's line

    round=<r> policy=<p> tokens_per_s=<x> wall_s=<x> lost_iters=<n> detect_s=<x> restart_s=<x> load_s=<x>
        resume_s=<x> down_s=<x> shrunk_s=<x> final_step=<n> state_digest=<hex>

tokens = steps x batch_size x seq_len (iterations done again are not counted twice), wall from the first
agent's start to the end of every agent; the event costs are summed over the run's restarts where
measured (an event shows nan for a line it lacks: a generation started after the job's last iteration
runs none, and its `restart_s` counts from its cause where no worker said it stopped), `down_s` is
their cause to first new iteration, `shrunk_s` the time spent on fewer ranks. What happened is read from the
run's records (trainer/records/event_log.py), when from the printed lines: a record's time is when this harness
read its line (the workers flush every line; `stamp` pairs each record with its line). Then one `policy=`
line each, the median over rounds (with `tokens_per_s_spread=` max - min when rounds > 1), and the ratios
of median throughputs `elastic/restart=` and `elastic/wait=`. The state digests differ between policies
legitimately: their iterations ran in different layouts, and the data-parallel reduction order decides
some bits (`wait` and `restart` run the same layouts from the same checkpoint, and end with the same
digest).

Everything is written under a temporary directory, removed at the end (`--logs` keeps each run's lines,
with their arrival times). On a machine with fewer cores than the 4 workers, the shrunk job's 2 ranks
are not slower per iteration than 4 ranks: what this measures there is the cost of the restarts.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.emulated_nodes import Node, Output, free_port, start_node
from trainer.config import load_config
from trainer.lifecycle.survivor_lines import SurvivorLine
from trainer.records.event_lines import ElasticLayout, FinalLine, StepLine
from trainer.records.event_log import RunEvent, run_events

CONFIG = "train_configs/debug_moe.toml"
OVERRIDES = [
    *("--metrics.tensorboard", "false", "--metrics.log_every", "1", "--training.val_every", "0"),
    *("--model.n_layers", "4", "--parallelism.pp", "2", "--parallelism.dp", "2"),
    *("--checkpoint.dense_interval", "4", "--parallelism.elastic"),
]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
POLICIES = ("elastic", "wait", "restart")
WORKERS_PER_NODE = 2
RUN_TIMEOUT_S = 900  # for node 0's agent to end once node 1 is back
JOIN_TIMEOUT_S = 120  # for node 1's agent to end after node 0's

LOADED_RE = re.compile(r"^checkpoint: loaded step (\d+) ")
RELAID_RE = re.compile(r"^restart: re-laid window (\d+) \(W=(\d+)\)")  # MoEvement: the state after t0 + W - 2


@dataclass(frozen=True)
class Line:
    at: float  # unix time this harness read it
    text: str
    event: RunEvent | None = None  # the record this line prints, if it is one (`stamp`)


def stamp(lines: list[Line], events: list[RunEvent]) -> list[Line]:
    """`lines` with each of the run's recorded `events` beside the line that printed it (the first unpaired
    line of the same text; a record whose line this harness did not read is left out)."""
    pending: dict[str, list[RunEvent]] = {}
    for event in events:
        pending.setdefault(event.line() + "\n", []).append(event)
    return [Line(line.at, line.text, (pending.get(line.text) or [None]).pop(0)) for line in lines]


def _detected(line: Line) -> float | None:
    """When a survivor's record says it learnt of the death (or of SIGTERM), if `line` prints one."""
    event = line.event
    return event.detected_unix if isinstance(event, SurvivorLine) else None


def _world(line: Line) -> int | None:
    """The processes of the generation whose `elastic` record `line` prints, if it prints one."""
    return line.event.world if isinstance(line.event, ElasticLayout) else None


def _step(line: Line) -> int | None:
    return line.event.step if isinstance(line.event, StepLine) else None


@dataclass
class StampedOutput(Output):
    """`Output` that also notes when each line arrived."""

    times: list[float] = field(default_factory=list)

    def add(self, line: str) -> None:
        with self.arrived:  # a reentrant lock: Output.add takes it again
            self.times.append(time.time())
            super().add(line)

    def stamped(self) -> list[Line]:
        """Every line read, with its arrival time and the record it prints (the job's records, named by its
        `run: <dir>` lines)."""
        with self.arrived:
            lines = [Line(at, text) for at, text in zip(self.times, self.lines, strict=True)]
        return stamp(lines, run_events("".join(line.text for line in lines)))


@dataclass(frozen=True)
class Restart:
    """One restart of the job's workers, from its cause (a node lost or back) to its first iteration;
    nan where a line is missing (a generation that starts after the job's last iteration runs none)."""

    world: int  # processes after it
    detect_s: float  # cause -> the first worker's `detected at unix=`
    restart_s: float  # -> the new generation's `elastic` record (from the cause where no worker said it stopped)
    load_s: float  # -> `checkpoint: loaded` (MoEvement: `restart: re-laid window`, where it re-lays one)
    resume_s: float  # -> its first `step` record (the first iteration not done before it)
    down_s: float  # cause -> its first `step` record
    lost_iters: int  # iterations reached before it and done again after

    def describe(self) -> str:
        return (
            f"world={self.world} detect_s={self.detect_s:.2f} restart_s={self.restart_s:.2f} "
            f"load_s={self.load_s:.2f} resume_s={self.resume_s:.2f} down_s={self.down_s:.2f} "
            f"lost_iters={self.lost_iters}"
        )


def _first(lines: list[Line], regex: re.Pattern) -> tuple[Line, re.Match] | None:
    return next(((line, m) for line in lines if (m := regex.match(line.text))), None)


def _first_of(lines: list[Line], value) -> tuple[Line, object] | None:
    """The first line for which `value(line)` is not None, and that value."""
    return next(((line, v) for line in lines if (v := value(line)) is not None), None)


def _restart(previous: list[Line], generation: list[Line], causes: list[float]) -> Restart:
    """The restart that ended the generation of `previous` lines and began the one of `generation` (its
    `elastic` record first), set off by the latest of `causes` before its detection (or its `elastic` record)."""
    nan, start = math.nan, generation[0]
    detected = _first_of(previous, _detected)
    detected_at = detected[1] if detected else nan
    cause = max((c for c in causes if c <= (detected_at if detected else start.at)), default=nan)
    loaded, stepped = _loaded(generation), _first_of(generation, _step)
    loaded_at, stepped_at = loaded[0].at if loaded else nan, stepped[0].at if stepped else nan
    reached = max((step for line in previous if (step := _step(line)) is not None), default=0)
    return Restart(
        world=_world(start),
        detect_s=detected_at - cause,
        restart_s=start.at - (detected_at if detected else cause),
        load_s=loaded_at - start.at,
        resume_s=stepped_at - loaded_at,
        down_s=stepped_at - cause,
        lost_iters=max(0, reached - (loaded[1] if loaded else 0)),
    )


def _loaded(generation: list[Line]) -> tuple[Line, int] | None:
    """The line saying which state a generation resumes from, and the last iteration that state holds: a
    window re-laid from host memory (MoEvement) where there is one, else the dense checkpoint it loaded."""
    if relaid := _first(generation, RELAID_RE):
        return relaid[0], int(relaid[1][1]) + int(relaid[1][2]) - 2
    if loaded := _first(generation, LOADED_RE):
        return loaded[0], int(loaded[1][1])
    return None


def restarts(lines: list[Line], causes: list[float]) -> list[Restart]:
    """Every restart of the job's workers in `lines`: each generation's `elastic` record after the first,
    set off by one of `causes` (unix times a node was lost or came back)."""
    starts = [i for i, line in enumerate(lines) if _world(line) is not None] + [len(lines)]
    return [_restart(lines[a:b], lines[b:c], causes) for a, b, c in zip(starts, starts[1:], starts[2:])]


def shrunk_s(lines: list[Line], end: float) -> float:
    """Seconds the job ran on fewer processes than at its start: from each smaller generation's `elastic`
    record to the next one's (or `end`)."""
    starts = [(line.at, world) for line in lines if (world := _world(line)) is not None]
    bounds = [at for at, _ in starts[1:]] + [end]
    return sum(bound - at for (at, world), bound in zip(starts, bounds) if world < starts[0][1])


@dataclass(frozen=True)
class Run:
    """One policy's run of one round."""

    policy: str
    tokens: int
    wall_s: float
    restarts: list[Restart]
    shrunk_s: float
    final_step: int
    digest: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def costs(self) -> dict[str, float]:
        """The run's numbers, its restarts' summed where measured."""
        keys = ("lost_iters", "detect_s", "restart_s", "load_s", "resume_s", "down_s")
        summed = {k: math.fsum(v for r in self.restarts if not math.isnan(v := getattr(r, k))) for k in keys}
        return {"tokens_per_s": self.tokens_per_s, "wall_s": self.wall_s, **summed, "shrunk_s": self.shrunk_s}


def analyse(policy: str, tokens: int, lines: list[Line], causes: list[float], began: float, ended: float) -> Run:
    """The run of `policy` from its stamped output and the harness's times (its start and end, the causes)."""
    final = [line.event for line in lines if isinstance(line.event, FinalLine)]
    step, digest = (final[-1].step, final[-1].state_digest) if final else (0, "none")
    wall = ended - began
    return Run(policy, tokens, wall, restarts(lines, causes), shrunk_s(lines, ended), step, digest)


def format_costs(costs: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.0f}" if k == "lost_iters" else f"{k}={v:.2f}" for k, v in costs.items())


@dataclass
class Job:
    """The benchmark's job as two emulated nodes: their agents, one output, the current rendezvous."""

    args: list[str]
    min_nodes: int
    host: Path  # node i keeps its host memory in host/node<i> (a node is a host and its host directory)
    output: StampedOutput = field(default_factory=StampedOutput)
    nodes: dict[int, Node] = field(default_factory=dict)
    port: int = 0
    launches: int = 0

    def launch(self) -> None:
        """Both nodes' agents on a fresh rendezvous (node 1 first: it waits for node 0's store)."""
        self.port, self.launches = free_port(), self.launches + 1
        for index in (1, 0):
            self.start(index)

    def start(self, index: int) -> None:
        job_id = f"elastic-bench-{os.getpid()}-{self.port}-{self.launches}"
        args = [*self.args, "--checkpoint.host_dir", str(self.host / f"node{index}")]
        self.nodes[index] = start_node(
            index, self.port, job_id, WORKERS_PER_NODE, args, ENV, self.output, min_nodes=self.min_nodes
        )

    def lose(self, index: int) -> None:
        """Node `index` is lost for good: its agent and workers are SIGKILLed and its memory goes with it."""
        self.nodes[index].lose()
        shutil.rmtree(self.host / f"node{index}", ignore_errors=True)

    def joined_since(self, since: float) -> bool:
        """Whether a generation of the job's workers started after `since` (unix time)."""
        return any(_world(line) is not None for line in self.output.stamped() if line.at > since)

    def stop(self) -> None:
        """Kill whatever still runs (after a failure)."""
        for node in self.nodes.values():
            if node.proc.poll() is None:
                node.lose()


def train_args(
    steps: int, folder: Path, strategy: str = "none", node_loss_s: float = 10.0, dense_interval: int = 4
) -> list[str]:
    """The job's command line, its run records and checkpoints under `folder`, checkpointed by `strategy` (its
    survivors giving up on a node after `node_loss_s`) and densely every `dense_interval` iterations; each
    node adds its host directory (`Job.start`)."""
    return [
        *("--config", CONFIG, *OVERRIDES, "--training.steps", str(steps), "--job.name", "elastic-bench"),
        *("--job.output_dir", str(folder / "runs"), "--checkpoint.dense_interval", str(dense_interval)),
        *("--checkpoint.strategy", strategy, "--fault.node_loss_s", str(node_loss_s)),
    ]


def drive(policy: str, job: Job, lose_at: int, repair_s: float) -> list[float]:
    """Lose node 1 after iteration `lose_at`, bring it back `repair_s` later as `policy` does, wait for the
    job's end; the causes of its restarts (unix times)."""
    job.output.wait_for_record(lambda e: isinstance(e, StepLine) and e.step >= lose_at)
    lost_at = time.time()
    job.lose(1)
    if policy == "restart":
        job.output.wait_for_record(lambda e: isinstance(e, SurvivorLine) and (e.detected_unix or 0) >= lost_at)
        job.nodes[0].lose()
        time.sleep(max(0.0, lost_at + repair_s - time.time()))
        returned_at = time.time()
        job.launch()
    else:
        with suppress(subprocess.TimeoutExpired):  # an elastic job may end on node 0 alone before
            job.nodes[0].proc.wait(timeout=max(0.0, lost_at + repair_s - time.time()))
        returned_at = time.time()
        if job.nodes[0].proc.poll() is None:
            job.start(1)
    if status := job.nodes[0].wait(RUN_TIMEOUT_S):
        raise AssertionError(f"{policy}: node 0's agent failed (exit status {status})")
    if not job.joined_since(returned_at):  # an elastic job that ended on node 0 alone, node 1 back too late
        job.nodes[1].lose()
        return [lost_at]
    if status := job.nodes[1].wait(JOIN_TIMEOUT_S):
        raise AssertionError(f"{policy}: node 1's agent failed (exit status {status})")
    return [lost_at, returned_at]


def run_policy(policy: str, args: argparse.Namespace, lose_at: int, folder: Path, log: Path | None) -> Run:
    """One run of `policy` with `args`' steps, repair time and strategy in `folder` (its stamped output also
    written to `log`, if given)."""
    steps, repair_s = args.steps, args.repair_s
    folder.mkdir(mode=0o700)
    (folder / "host").mkdir(mode=0o700)  # the nodes' host directories' parent (a strategy's host state)
    job_args = train_args(steps, folder, args.strategy, args.node_loss_s, args.dense_interval)
    job = Job(job_args, min_nodes=1 if policy == "elastic" else 2, host=folder / "host")
    began = time.time()
    try:
        job.launch()
        causes = drive(policy, job, lose_at, repair_s)
        ended = time.time()
    except AssertionError as e:
        raise SystemExit(f"{policy} failed: {str(e).splitlines()[0]}\n{''.join(job.output.lines[-60:])}") from None
    finally:
        job.stop()
        if log is not None:
            log.write_text("".join(f"{line.at:.3f} {line.text}" for line in job.output.stamped()))
    cfg = load_config(CONFIG, [*OVERRIDES, "--training.steps", str(steps)]).training
    return analyse(policy, steps * cfg.batch_size * cfg.seq_len, job.output.stamped(), causes, began, ended)


def summary(policy: str, runs: list[Run]) -> str:
    """`policy`'s line: the median of every number over `runs`, the spread of throughput, every digest."""
    costs = [run.costs() for run in runs]
    medians = {k: statistics.median(c[k] for c in costs) for k in costs[0]}
    rates = [run.tokens_per_s for run in runs]
    spread = f" tokens_per_s_spread={max(rates) - min(rates):.2f}" if len(runs) > 1 else ""
    digests = ",".join(run.digest for run in runs)
    return f"policy={policy} {format_costs(medians)}{spread} state_digest={digests}"


def run_rounds(args: argparse.Namespace, policies: list[str], folder: Path) -> dict[str, list[Run]]:
    """Every round's runs, the policies interleaved (each round starts with the next one), printed as they end."""
    rng, runs = random.Random(args.seed), {p: [] for p in policies}
    for r in range(1, args.rounds + 1):
        lose_at = rng.randint(math.ceil(args.steps / 4), args.steps // 2)
        first = (r - 1) % len(policies)
        for policy in policies[first:] + policies[:first]:
            log = args.logs / f"round{r}-{policy}.log" if args.logs else None
            run = run_policy(policy, args, lose_at, folder / f"{policy}-{r}", log)
            for event in run.restarts:
                print(f"event round={r} policy={policy} {event.describe()}", flush=True)
            print(
                f"round={r} policy={policy} lose_at={lose_at} {format_costs(run.costs())} "
                f"final_step={run.final_step} state_digest={run.digest}",
                flush=True,
            )
            runs[policy].append(run)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repair-s", type=float, default=20.0, help="seconds from node 1's loss to its return")
    parser.add_argument("--seed", type=int, default=0, help="draws the iteration after which node 1 is lost")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--strategy", default="none", help="checkpoint.strategy of the job")
    parser.add_argument("--node-loss-s", type=float, default=10.0, help="fault.node_loss_s (with a strategy)")
    parser.add_argument("--dense-interval", type=int, default=4, help="checkpoint.dense_interval of the job")
    parser.add_argument("--logs", type=Path, help="write each run's output here, with unix arrival times")
    args = parser.parse_args()
    policies = args.policies.split(",")
    if unknown := set(policies) - set(POLICIES):
        parser.error(f"unknown policies {sorted(unknown)}; known: {','.join(POLICIES)}")
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="moevement-elastic-bench-"))
    try:
        runs = run_rounds(args, policies, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for policy in policies:
        print(summary(policy, runs[policy]))
    median = {p: statistics.median(run.tokens_per_s for run in runs[p]) for p in policies}
    if "elastic" in median:
        ratios = [f"elastic/{p}={median['elastic'] / median[p]:.3f}" for p in ("restart", "wait") if p in median]
        print(" ".join(ratios))


if __name__ == "__main__":
    main()
