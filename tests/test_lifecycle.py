"""The lifecycle where its logic lives (trainer/lifecycle/): every verdict of the table, the facts it is
taken from, the stop guard's phases, and the generation protocol with real gloo groups in two processes.

Guarantee: bit-exact recovery rests on one decision after a death (rejoin in place, exit for torchrun's
restart, stop quietly after a peer's clean error, nothing to recover after the job's end): the verdict
table, tested verdict by verdict here; the end-to-end deaths are in tests/test_real_deaths.py."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.emulated_nodes import free_port
from parallelisms import collectives
from parallelisms.distributed import init_distributed, join_generation, leave_generation, torchrun_store
from trainer.config import Config
from trainer.lifecycle import shell_argv
from trainer.lifecycle.generations import happened
from trainer.lifecycle.peer_failure import WorkerStopped, peer_failure
from trainer.lifecycle.process_state import ProcessState
from trainer.lifecycle.start_plan import StartPlan
from trainer.lifecycle.startup import Startup
from trainer.lifecycle.stop_guard import StopGuard
from trainer.lifecycle.survivor_lines import PREEMPTED, SurvivorLine
from trainer.lifecycle.verdict import (
    STANDBY_GRACE_S,
    Happened,
    OnSigterm,
    ShellVerdict,
    Verdict,
    a_frozen_child,
    a_silent_shell,
    after_child_exit,
    decide,
    hang_bound,
    on_sigterm,
    runs_a_shell,
)

FACTS = ("peer_failure", "sigterm", "job_finished", "peer_said_error", "under_shell", "training", "in_a_group")


def expected(facts: dict) -> Verdict:
    """The verdict table of trainer/lifecycle/verdict.py, written out case by case."""
    if not facts["peer_failure"]:
        return Verdict.RAISE  # this rank's own error
    if facts["job_finished"]:
        return Verdict.DONE
    if facts["peer_said_error"]:
        return Verdict.PEER_STOPPED
    replaced_in_place = facts["under_shell"] and not facts["sigterm"]
    if replaced_in_place and (facts["training"] or facts["in_a_group"]):
        return Verdict.REJOIN
    if replaced_in_place:
        return Verdict.FALLBACK  # the next generation did not form
    return Verdict.EXIT_FOR_TORCHRUN if facts["training"] else Verdict.RAISE


@pytest.mark.parametrize("values", list(itertools.product((False, True), repeat=len(FACTS))))
def test_every_combination_of_facts_gets_the_verdict_of_the_table(values):
    facts = dict(zip(FACTS, values))
    assert decide(Happened(**facts)) is expected(facts)


def test_every_verdict_is_reachable():
    reached = {decide(Happened(*values)) for values in itertools.product((False, True), repeat=len(FACTS))}
    assert reached == set(Verdict)


def test_the_facts_come_from_the_error_and_the_process(monkeypatch):
    monkeypatch.delenv("MOEVEMENT_ROLE", raising=False)
    own = happened(ValueError("a bug here"), training=True)
    assert not own.peer_failure and decide(own) is Verdict.RAISE
    stopped = happened(WorkerStopped("SIGTERM from the torchrun agent"), training=True)
    assert stopped.peer_failure and stopped.sigterm and not stopped.under_shell
    assert decide(stopped) is Verdict.EXIT_FOR_TORCHRUN
    gone = RuntimeError("pipeline stage failed")  # a peer's death wrapped, as pipelining's errors are
    gone.__cause__ = dist.DistNetworkError("Connection reset by peer")
    assert peer_failure(gone)
    monkeypatch.setenv("MOEVEMENT_ROLE", "trainer")  # a rank shell's trainer child
    in_loop = happened(gone, training=True)
    assert in_loop.peer_failure and not in_loop.sigterm and in_loop.under_shell
    assert decide(in_loop) is Verdict.REJOIN
    starting = happened(gone, training=False)  # no process group in this process: the join did not form
    assert not starting.in_a_group and decide(starting) is Verdict.FALLBACK


@pytest.fixture
def guard(monkeypatch):
    """A stop guard in this process; SIGTERM's handler and the process's record of SIGTERM restored after."""
    previous = signal.getsignal(signal.SIGTERM)
    yield StopGuard(0, lambda step, kept: SurvivorLine(PREEMPTED, 0, step, kept=kept), ProcessState(Startup()))
    signal.signal(signal.SIGTERM, previous)


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_while_training_or_recovering_stops_at_once(guard):
    for phase in ("training", "recovering"):
        guard.phase, guard.sigterm_at = phase, None
        with pytest.raises(WorkerStopped):
            _sigterm()
        assert guard.phase == "stopping" and guard.stopped_in == phase


def test_sigterm_while_an_update_is_applied_waits_for_its_end(guard):
    guard.phase = "training"
    guard.optimizer_step_begins()
    assert guard.phase == "applying"
    _sigterm()  # no exception: the update of the step must complete
    assert guard.sigterm_at is not None and guard.phase == "applying"
    with pytest.raises(WorkerStopped):
        guard.done(5)
    assert guard.applied == 5 and guard.stopped_in == "training"


def test_sigterm_once_stopping_only_waits(guard):
    guard.phase = "training"
    guard.stop()
    _sigterm()
    assert guard.phase == "stopping" and guard.stopped_in == "training"


GUARD = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
from trainer.lifecycle.start_plan import plan_start
from trainer.lifecycle.stop_guard import StopGuard
from trainer.lifecycle.survivor_lines import PREEMPTED, SurvivorLine
from trainer.lifecycle.survivor_lines import PREEMPTED, SurvivorLine
process = plan_start().process
process.sigterm_at = {earlier}  # a SIGTERM that reached an earlier generation of this process, if any
guard = StopGuard(3, lambda step, kept: SurvivorLine(PREEMPTED, 3, step, kept=kept, resumes="r"), process, step={step})
os.kill(os.getpid(), signal.SIGTERM)
print("not reached")
"""


@pytest.mark.parametrize(("earlier", "held"), [(None, 0), (1.0, 0), (1.0, 29)])
def test_sigterm_before_training_exits_at_once_with_the_preempted_line(earlier, held):
    """In the set-up phase SIGTERM exits at once; so does a later generation's guard of a process that
    SIGTERM reached before (it exits as soon as it is built). The line names the step the rank's state holds
    (a survivor that kept state_30 in memory: 29)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = GUARD.format(earlier=earlier, step=held)
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    kept = "host state kept (nothing new to keep)"
    assert proc.stdout == f"preempted: rank 3 received SIGTERM at step {held}; {kept}: r\n"


def test_a_survivor_and_a_replacement_agree_on_the_next_generation():
    """The rank shell activates its standby in the generation after the last one its trainer reported
    (tests/test_rank_shell.py); a survivor's plan goes to the generation after its own: the same number."""
    plan = StartPlan(run_id="r", attempt=1, generation=3)
    after = plan.next_generation(None, None)
    assert (after.generation, after.attempt, after.in_place, after.restarted) == (4, 1, True, True)
    assert plan.name() == {"run_id": "r", "attempt": 1}  # files kept across torchrun restarts: by attempt


def _two_generations(rank: int, port: int, results) -> None:
    """Generation 0, then generation 1 of the same attempt in the same process, on torchrun's store."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        OMP_NUM_THREADS="1",
    )
    init_distributed(timeout_s=60, generation=0)
    sums = []
    for generation in (0, 1):
        if generation:
            join_generation(generation, timeout_s=60)
        value = torch.tensor([float(rank + 1) * 10**generation])
        collectives.all_reduce(value)
        sums.append(float(value))
        leave_generation()
        assert not dist.is_initialized()
    store = torchrun_store()
    store.set(f"left/{rank}", "1")
    store.wait(["left/0", "left/1"])  # rank 0 hosts the store: it stays until rank 1 is done with it
    results.put((rank, sums))


def test_a_later_generation_forms_in_the_same_processes_on_its_own_keys():
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_two_generations, args=(free_port(), results), nprocs=2)
    got = sorted(results.get() for _ in range(2))
    assert [sums for _, sums in got] == [[3.0, 30.0], [3.0, 30.0]]


def _joins_alone(rank: int, port: int, results) -> None:
    """Rank 1 never joins generation 1: rank 0's join fails after twice the bound, as a peer's failure."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"
    )
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
    init_distributed(timeout_s=1, generation=0)
    leave_generation()
    store = torchrun_store()
    if rank == 1:
        store.set("rank1/left", "1")
        return
    store.wait(["rank1/left"])
    try:
        join_generation(1, timeout_s=1)
        results.put("joined")
    except Exception as error:
        facts = happened(error, training=False)
        results.put((facts.peer_failure, facts.in_a_group))


def test_a_generation_a_peer_never_joins_fails_as_a_peer_failure():
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_joins_alone, args=(free_port(), results), nprocs=2)
    assert results.get() == (True, False)  # under a shell: Verdict.FALLBACK, torchrun's restart


@pytest.mark.parametrize(
    ("phase", "action"),
    [
        ("setup", OnSigterm.EXIT),
        ("training", OnSigterm.STOP),
        ("recovering", OnSigterm.STOP),
        ("applying", OnSigterm.WAIT),
        ("stopping", OnSigterm.WAIT),
    ],
)
def test_what_sigterm_does_in_each_phase(phase, action):
    assert on_sigterm(phase) is action


@pytest.mark.parametrize("stopping", [False, True])
@pytest.mark.parametrize("finished", [False, True])
@pytest.mark.parametrize("returncode", [0, 1, 2, 13, 75, 143, -9, -11])
def test_what_a_rank_shell_does_when_its_trainer_ends(returncode, finished, stopping):
    """A clean end (0, 2, 75, 143) or torchrun's SIGTERM hands the slot back; any other end is a death:
    nothing to recover after the job's end, else the standby replaces it."""
    verdict = after_child_exit(returncode, finished, stopping)
    if stopping or returncode in (0, 2, 75, 143):
        assert verdict is ShellVerdict.HAND_BACK
    else:
        assert verdict is (ShellVerdict.DONE if finished else ShellVerdict.REPLACE)


@pytest.mark.parametrize(
    ("facts", "shell"),
    [
        ((True, 2, False, False, "moevement", 4), True),
        ((False, 2, False, False, "moevement", 4), False),  # not under torchrun
        ((True, 1, False, False, "moevement", 4), False),  # one worker: nobody survives a death
        ((True, 2, True, False, "moevement", 4), False),  # a shell's own child
        ((True, 2, False, True, "moevement", 4), False),  # --dry-run, --print-config, --help
        ((True, 2, False, False, "none", 4), False),  # no strategy to rejoin with
        ((True, 2, False, False, "gemini", 0), False),  # replacements not allowed
    ],
)
def test_when_train_py_starts_as_a_rank_shell(facts, shell):
    assert runs_a_shell(*facts) is shell


@pytest.mark.parametrize(
    ("silent_s", "stopping", "frozen"),
    [(0.5, False, False), (10.0, False, False), (10.5, False, True), (60.0, True, False)],
)
def test_when_a_rank_shell_kills_a_silent_trainer(silent_s, stopping, frozen):
    """Silent longer than `fault.heartbeat_timeout_s` (here 10 s) is frozen, unless torchrun is stopping the
    job."""
    assert a_frozen_child(silent_s, 10.0, stopping) is frozen


@pytest.mark.parametrize(
    ("heartbeat_timeout_s", "timeout_s", "bound"),
    [
        (30.0, 600.0, ("fault.heartbeat_timeout_s", 30.0)),  # the defaults: a hang costs 30 s, not 10 minutes
        (30.0, 30.0, ("fault.heartbeat_timeout_s", 30.0)),
        (30.0, 10.0, ("fault.timeout_s", 10.0)),  # the peers give up on a hung trainer first
    ],
)
def test_the_hang_bound_is_the_heartbeat_timeout_or_a_shorter_collective_timeout(heartbeat_timeout_s, timeout_s, bound):
    assert hang_bound(heartbeat_timeout_s, timeout_s) == bound


@pytest.mark.parametrize(
    ("silent_s", "standby", "kill"),
    [
        (0.5, False, False),
        (10.0, False, False),
        (10.5, False, True),  # the trainer: past the bound
        (10.5, True, False),  # its standby waits a little longer, so the trainer's line is the one printed
        (10.0 + STANDBY_GRACE_S, True, False),
        (10.5 + STANDBY_GRACE_S, True, True),  # ... and still ends a shell whose trainer has exited
    ],
)
def test_when_a_shells_child_kills_a_silent_shell(silent_s, standby, kill):
    """A shell silent longer than `fault.heartbeat_timeout_s` (here 10 s) is stopped or stuck: its trainer
    kills it, its standby `STANDBY_GRACE_S` later."""
    assert a_silent_shell(silent_s, 10.0, standby) is kill


def test_the_shell_reads_the_trainers_settings_and_defaults(tmp_path):
    """The shell reads `fault.*` and `checkpoint.strategy` as the trainer does (command line over config
    file over the default), and its defaults are the trainer's."""
    defaults = Config()
    for key, value in shell_argv.DEFAULTS.items():
        section, name = key.split(".")
        assert getattr(getattr(defaults, section), name) == value, key
    config = tmp_path / "job.toml"
    config.write_text('[fault]\ntimeout_s = 42\n[checkpoint]\nstrategy = "gemini"\n')
    argv = ["--config", str(config), "--fault.max_replacements=2"]
    assert shell_argv.setting(argv, "fault.timeout_s", float) == 42.0
    assert shell_argv.setting([*argv, "--fault.timeout_s", "7", "--fault.timeout_s=5"], "fault.timeout_s", float) == 5
    assert shell_argv.setting(argv, "fault.max_replacements", int) == 2
    assert shell_argv.setting(argv, "checkpoint.strategy", str) == "gemini"
    assert shell_argv.setting([], "fault.timeout_s", float) == 600.0
