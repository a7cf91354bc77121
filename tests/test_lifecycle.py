"""The lifecycle where its logic lives (trainer/lifecycle/): every verdict of the table, the facts it is
taken from, the stop guard's phases, and the generation protocol with real gloo groups in two processes.

Guarantee: bit-exact recovery rests on one decision after a death (rejoin in place, exit for torchrun's
restart, stop quietly after a peer's clean error, nothing to recover after the job's end): the verdict
table, tested verdict by verdict here; the end-to-end deaths are in tests/test_real_deaths.py."""

from __future__ import annotations

import dataclasses
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
from parallelisms.distributed import connect_torchrun_store, init_distributed, join_generation, leave_generation
from trainer.config import Config, ConfigError
from trainer.data.batches import DataError
from trainer.lifecycle import generations, job_end, node_presence, process, shell_argv, verdict
from trainer.lifecycle.exit_codes import exit_status
from trainer.lifecycle.fault_bounds import FaultBounds, fault_bounds
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
    StandbyEnd,
    StandbyVerdict,
    Verdict,
    a_frozen_child,
    a_silent_shell,
    after_child_exit,
    after_standby_exit,
    child_end,
    decide,
    hang_bound,
    kept_iteration,
    on_sigterm,
    runs_a_shell,
)

BOUNDS = FaultBounds.of(60.0, 60.0)

TABLES = {
    "DECIDE": (verdict.DECIDE, Happened),
    "SHELL": (verdict.SHELL, verdict.ChildEnd),
    "STANDBY": (verdict.STANDBY, verdict.StandbyEnd),
    "CANNOT_FORM": (verdict.CANNOT_FORM, verdict.Waiting),
}


def every_case(facts_type) -> list:
    """Every combination of the boolean facts of `facts_type`."""
    names = [f.name for f in dataclasses.fields(facts_type)]
    return [facts_type(**dict(zip(names, values))) for values in itertools.product((False, True), repeat=len(names))]


def first_row(table, facts) -> int:
    return next(i for i, row in enumerate(table) if row.matches(facts))


@pytest.mark.parametrize("name", TABLES)
def test_every_row_of_a_table_is_some_case_and_every_case_has_a_row(name):
    """A table's rows name only its facts, each row is the first match of some case (none is hidden behind
    the rows above it), and its last row matches whatever is left."""
    table, facts_type = TABLES[name]
    names = {f.name for f in dataclasses.fields(facts_type)}
    assert all(set(row.when) <= names for row in table), name
    assert table[-1].when == {}
    assert {first_row(table, case) for case in every_case(facts_type)} == set(range(len(table)))


def test_the_docstring_table_is_the_decide_table():
    rows = [line for line in verdict.__doc__.splitlines() if line.startswith("| ") and "verdict" not in line]
    assert [[cell.strip() for cell in line.strip("|").split("|")] for line in rows] == [
        [row.what, row.then.name] for row in verdict.DECIDE
    ]


SHELL_KILLED = dict(peer_failure=True, sigterm=False, job_finished=False, peer_said_error=False)

# Named cases of the lifecycle, each with the verdict the end-to-end tests see (tests/test_real_deaths.py).
SCENARIOS = {
    "a bug in this rank": (Happened(False, False, False, False, True, True, True), Verdict.RAISE),
    "a peer SIGKILLed in backward, under rank shells": (
        Happened(**SHELL_KILLED, under_shell=True, training=True, in_a_group=True),
        Verdict.REJOIN,
    ),
    "a peer died while the next generation replays": (
        Happened(**SHELL_KILLED, under_shell=True, training=False, in_a_group=True),
        Verdict.REJOIN,
    ),
    "the next generation did not form in time": (
        Happened(**SHELL_KILLED, under_shell=True, training=False, in_a_group=False),
        Verdict.FALLBACK,
    ),
    "a peer SIGKILLed, torchrun restarts every worker": (
        Happened(**SHELL_KILLED, under_shell=False, training=True, in_a_group=True),
        Verdict.EXIT_FOR_TORCHRUN,
    ),
    "torchrun's SIGTERM under a rank shell": (
        Happened(True, True, False, False, under_shell=True, training=True, in_a_group=True),
        Verdict.EXIT_FOR_TORCHRUN,
    ),
    "a peer died during the set-up, no shell": (
        Happened(**SHELL_KILLED, under_shell=False, training=False, in_a_group=True),
        Verdict.RAISE,
    ),
    "a peer died during the final digest's gather, after the end": (
        Happened(True, False, True, False, True, False, True),
        Verdict.DONE,
    ),
    "a peer stopped on a bad data shard": (Happened(True, False, False, True, True, True, True), Verdict.PEER_STOPPED),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_named_case_gets_its_verdict(name):
    facts, expected = SCENARIOS[name]
    assert decide(facts) is expected


def test_every_verdict_is_reachable():
    assert {decide(case) for case in every_case(Happened)} == set(Verdict)


def witness(table, row: int, facts_type):
    """A case whose first matching row in `table` is `row`."""
    return next(case for case in every_case(facts_type) if first_row(table, case) == row)


@pytest.mark.parametrize("row", range(len(verdict.DECIDE)))
def test_each_verdict_ends_the_process_as_its_caller_says(row, monkeypatch):
    """Each row's consequence in the real callers: what `generations` raises or returns for it, and how
    `process.run_process` ends the process then (exit status 0 after the job's end, 2 after a peer's error;
    a generation that did not form: 75, through torchrun's restart)."""
    facts = witness(verdict.DECIDE, row, Happened)
    monkeypatch.setattr(generations, "happened", lambda error, training, store: facts)
    monkeypatch.setattr(generations.job_end, "finished_step", lambda store: 7)
    outcome = verdict.DECIDE[row].then
    ends = {Verdict.DONE: verdict.REACHED_THE_END, Verdict.PEER_STOPPED: verdict.PEERS_ERROR}
    if outcome in ends:
        with pytest.raises(Exception) as raised:
            generations._verdict(RuntimeError("a peer's death"), facts.training, None)
        assert process.ending_of(raised.value) == ends[outcome]
    else:
        assert generations._verdict(RuntimeError("a peer's death"), facts.training, None) is outcome
    if outcome is Verdict.FALLBACK:
        assert process.ending_of(generations.GenerationNotJoined(3, BOUNDS)) == verdict.REACHED_FALLBACK


def test_the_facts_come_from_the_error_and_the_process(monkeypatch):
    monkeypatch.delenv("MOEVEMENT_ROLE", raising=False)
    own = happened(ValueError("a bug here"), True, None)
    assert not own.peer_failure and decide(own) is Verdict.RAISE
    stopped = happened(WorkerStopped("SIGTERM from the torchrun agent"), True, None)
    assert stopped.peer_failure and stopped.sigterm and not stopped.under_shell
    assert decide(stopped) is Verdict.EXIT_FOR_TORCHRUN
    gone = RuntimeError("pipeline stage failed")  # a peer's death wrapped, as pipelining's errors are
    gone.__cause__ = dist.DistNetworkError("Connection reset by peer")
    assert peer_failure(gone)
    monkeypatch.setenv("MOEVEMENT_ROLE", "trainer")  # a rank shell's trainer child
    in_loop = happened(gone, True, None)
    assert in_loop.peer_failure and not in_loop.sigterm and in_loop.under_shell
    assert decide(in_loop) is Verdict.REJOIN
    starting = happened(gone, False, None)  # no process group in this process: the join did not form
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
from trainer.lifecycle.process_state import ProcessState
from trainer.lifecycle.start_plan import plan_start
from trainer.lifecycle.startup import STARTUP
from trainer.lifecycle.stop_guard import StopGuard
from trainer.lifecycle.survivor_lines import PREEMPTED, SurvivorLine
process = plan_start(ProcessState(STARTUP)).process
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
    store = connect_torchrun_store()  # the process's own handle, kept for its later generations
    init_distributed(timeout_s=60, generation=0, store=store)
    sums = []
    for generation in (0, 1):
        if generation:
            join_generation(generation, timeout_s=60, later_join_s=120, store=store)
        value = torch.tensor([float(rank + 1) * 10**generation])
        collectives.all_reduce(value)
        sums.append(float(value))
        leave_generation()
        assert not dist.is_initialized()
    store.set(f"left/{rank}", "1")
    store.wait(["left/0", "left/1"])  # rank 0 hosts the store: it stays until rank 1 is done with it
    results.put((rank, sums))


# In the default suite, a later generation forms in the same processes under a real death
# (tests/test_real_deaths.py::test_sigkill_in_backward_is_replaced_in_place: rank 0 rejoins generation 1).
@pytest.mark.slow
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
    store = connect_torchrun_store()
    init_distributed(timeout_s=1, generation=0, store=store)
    leave_generation()
    if rank == 1:
        store.set("rank1/left", "1")
        return
    store.wait(["rank1/left"])
    try:
        join_generation(1, timeout_s=1, later_join_s=2, store=store)
        results.put("joined")
    except Exception as error:
        facts = happened(error, False, store)
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


SIGKILL, SIGSEGV = -signal.SIGKILL, -signal.SIGSEGV
ALIVE = dict(stopping=False, job_finished=False, standby_ready=True, spent=False)

# What a rank shell does when its trainer ends, case by case (`Popen.returncode`, facts) -> verdict.
CHILD_ENDS = {
    "finished (0)": (0, ALIVE, ShellVerdict.HAND_BACK),
    "a clean error (2)": (2, ALIVE, ShellVerdict.HAND_BACK),
    "asks for torchrun's restart (75)": (75, ALIVE, ShellVerdict.HAND_BACK),
    "stopped by SIGTERM (143)": (143, ALIVE, ShellVerdict.HAND_BACK),
    "a clean exit with every replacement spent": (0, {**ALIVE, "spent": True}, ShellVerdict.HAND_BACK),
    "SIGKILL": (SIGKILL, ALIVE, ShellVerdict.REPLACE),
    "a segfault": (SIGSEGV, ALIVE, ShellVerdict.REPLACE),
    "a traceback (1)": (1, ALIVE, ShellVerdict.REPLACE),
    "fault.crash (13)": (13, ALIVE, ShellVerdict.REPLACE),
    "SIGKILL after the job finished": (SIGKILL, {**ALIVE, "job_finished": True}, ShellVerdict.DONE),
    "SIGKILL while torchrun stops the job": (SIGKILL, {**ALIVE, "stopping": True}, ShellVerdict.HAND_BACK),
    "SIGKILL, the standby dead": (SIGKILL, {**ALIVE, "standby_ready": False}, ShellVerdict.NO_STANDBY),
    "SIGKILL, every replacement spent": (SIGKILL, {**ALIVE, "spent": True}, ShellVerdict.SPENT),
}


@pytest.mark.parametrize("name", CHILD_ENDS)
def test_what_a_rank_shell_does_when_its_trainer_ends(name):
    """A clean end (0, 2, 75, 143) or torchrun's SIGTERM hands the slot back; any other end is a death:
    nothing to recover after the job's end, else the standby replaces it, unless none is alive or every
    replacement is spent (then the `shell:` line says which, `test_rank_shell.py`)."""
    returncode, facts, expected = CHILD_ENDS[name]
    assert after_child_exit(child_end(returncode, **facts)) is expected


@pytest.mark.parametrize(
    ("stopping", "lost", "expected"),
    [
        (False, 0, StandbyVerdict.RESPAWN),
        (False, 1, StandbyVerdict.RESPAWN),
        (False, 2, StandbyVerdict.GIVE_UP),  # as many died as `fault.max_replacements` (2) allows
        (True, 0, StandbyVerdict.LEAVE),  # torchrun stops the job: nothing to start
    ],
)
def test_what_a_rank_shell_does_when_its_standby_dies(stopping, lost, expected):
    assert after_standby_exit(StandbyEnd(stopping, spent=lost >= 2)) is expected


@pytest.mark.parametrize(("returncode", "status"), [(0, 0), (2, 2), (75, 75), (SIGKILL, 137), (SIGSEGV, 139)])
def test_the_shell_hands_a_signal_death_back_as_128_plus_the_signal(returncode, status):
    assert exit_status(returncode) == status


@pytest.mark.parametrize(
    ("stopped_in", "kept"),
    [("setup", 5), ("training", 5), ("applying", 7), ("recovering", None)],
)
def test_which_state_a_stopped_rank_keeps(stopped_in, kept):
    """A rank that began iteration 6 and applied 4 (its update of 6 not begun: 5 is next) keeps the state
    before iteration 5; one stopped while the update of 6 was applied keeps the state before 7; one that was
    recovering keeps nothing."""
    assert kept_iteration(stopped_in, 6, 4) == kept
    assert set(verdict.KEEPS) == {"setup", "training", "applying", "recovering"}  # every phase that can stop


@pytest.mark.parametrize(
    ("waiting", "why"),
    [
        ((False, False, False), None),
        ((True, True, True), verdict.CannotForm.JOB_FINISHED),  # the end outranks everything
        ((False, True, True), verdict.CannotForm.PEERS_LEFT),
        ((False, False, True), verdict.CannotForm.NODE_LOST),
    ],
)
def test_when_a_generation_cannot_form(waiting, why):
    assert verdict.cannot_form(verdict.Waiting(*waiting)) is why


def test_a_node_is_lost_after_node_loss_s_of_silence():
    assert not verdict.a_lost_node(9.9, 10.0) and verdict.a_lost_node(10.0, 10.0)


@pytest.mark.parametrize(
    ("error", "status", "said"),
    [
        (generations.GenerationNotJoined(2, BOUNDS), 75, verdict.Said.BY_THIS_RANK),
        (job_end.PeersLeft(2), 75, verdict.Said.BY_THIS_RANK),
        (node_presence.NodeLost(2, 1, 12.0, 10.0), 75, verdict.Said.BY_THIS_RANK),
        (job_end.JobFinished(2, 9), 0, verdict.Said.BY_THIS_RANK),
        (job_end.FinishedEarlier(0, 9), 0, verdict.Said.BY_THIS_RANK),
        (generations.NothingToRecover(9), 0, verdict.Said.BY_THIS_RANK),
        (generations.PeerStopped(), 2, verdict.Said.BY_A_PEER),
        (ConfigError("training.steps: must be > 0"), 2, verdict.Said.ONCE_FOR_THE_JOB),
        (DataError("data.dataset: not found"), 2, verdict.Said.ONCE_FOR_THE_JOB),
    ],
)
def test_how_each_way_of_ending_is_said_and_its_exit_status(error, status, said):
    assert process.ending_of(error) == verdict.Ending(status, said)


def test_an_error_of_no_kind_is_a_traceback():
    assert process.ending_of(ValueError("a bug")) is None
    assert process.ending_of(KeyboardInterrupt()) is None
    with pytest.raises(ValueError, match="a bug"):
        process.run_process(lambda: (_ for _ in ()).throw(ValueError("a bug")), ProcessState(Startup()))


@pytest.mark.parametrize("error", [job_end.JobFinished(2, 9), generations.GenerationNotJoined(2, BOUNDS)])
def test_a_state_the_job_reached_is_said_by_the_rank_that_met_it(error, capsys):
    def work():
        raise error

    assert process.run_process(work, ProcessState(Startup())) == process.ending_of(error).status
    assert capsys.readouterr().out == f"{error}\n"


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


def test_the_fault_bounds_are_derived_once_from_the_config():
    """The defaults' bounds, and the `restart:` line of a later generation not joined, which names them."""
    bounds = fault_bounds(Config().fault)
    assert bounds == FaultBounds(timeout_s=600.0, later_join_s=1200.0, node_loss_s=60.0)
    assert str(generations.GenerationNotJoined(3, bounds)) == (
        "restart: generation 3 was not joined by every rank within 1200 s (2 x fault.timeout_s): "
        "torchrun restarts every worker"
    )


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
