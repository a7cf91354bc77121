"""What the tests share: the repository's paths, running train.py (and a rank shell) as real processes, the
command lines of the end-to-end cases and their fault-free runs, and reading what a run recorded: its step,
validation, survivor, recovery, fault and final lines from the run record's events (`run_events`), never
from its stdout.

No test module imports another: what two of them need lives here (or in tests/tiny_moe.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from moevement.recovery.report import RecoveryReport, RecoveryWork
from trainer.lifecycle.survivor_lines import SurvivorLine
from trainer.records.accounting_line import AccountingLine
from trainer.records.event_lines import FaultStrike, FinalLine, StepLine, ValidationLine
from trainer.records.event_log import RunEvent, last_step, read_events, run_folders
from trainer.records.event_log import run_events as _run_events

ROOT = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = "train_configs/debug_moe.toml"
# what every child process of the tests runs with: nothing downloaded, one intra-op thread per process
CHILD_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# Run records of the suite's runs (`job.output_dir`, unless a test names its own): outside the checkout
# (removed at the session's end: tests/conftest.py).
RUN_OUTPUTS = Path(tempfile.mkdtemp(prefix="moevement-test-runs-"))
RUN_TIMEOUT_S = 540  # below the suite's per-test budget, so a hung run is reported with its stacks

# ---- command lines of the end-to-end cases ----------------------------------------------------------------


def base_args(steps: int = 12) -> list[str]:
    """`debug_moe` at 4 layers for `steps` iterations, a `step=` line every iteration, no validation, no
    TensorBoard: the command line the end-to-end cases build on."""
    return [
        *("--config", DEBUG_CONFIG, "--metrics.tensorboard", "false", "--metrics.log_every", "1"),
        *("--training.val_every", "0", "--training.steps", str(steps), "--model.n_layers", "4"),
    ]


BASE = base_args()
MOEVEMENT = ["--checkpoint.strategy", "moevement", "--checkpoint.window", "3"]
PP2 = ["--parallelism.pp", "2"]
PP2_BF16_CLIPPED = [*PP2, "--training.mixed_precision", "bf16", "--training.max_grad_norm", "0.5"]
PP2_DP2_EP2_BF16 = [
    "--parallelism.pp",
    "2",
    "--parallelism.dp",
    "2",
    "--parallelism.ep",
    "2",
    "--training.mixed_precision",
    "bf16",
    "--training.max_grad_norm",
    "0.5",
]
PP4 = ["--parallelism.pp", "4", "--training.micro_batches", "4"]
INTERLEAVED = [
    "--parallelism.pp",
    "2",
    "--parallelism.schedule",
    "Interleaved1F1B",
    "--parallelism.stages_per_rank",
    "2",
]

_baselines: dict[tuple[str, ...], str] = {}


def baseline(layout: list[str], nproc: int) -> str:
    """stdout of the fault-free run of `BASE` with `layout` (run once per session)."""
    key = tuple(layout)
    if key not in _baselines:
        _baselines[key] = run_cli(*BASE, *layout, nproc=nproc).stdout
    return _baselines[key]


# ---- running train.py ---------------------------------------------------------------------------------


def run_cli(
    *args: str,
    cwd: Path = ROOT,
    check: bool = True,
    nproc: int = 1,
    torchrun: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `train.py` (under torchrun, with `torchrun` options, when nproc > 1) and return the finished process.

    `env` adds to (or overrides) the inherited environment. Run records go to RUN_OUTPUTS unless `args`
    name a `job.output_dir`."""
    if not any(a.startswith("--job.output_dir") for a in args):
        args = (*args, "--job.output_dir", str(RUN_OUTPUTS))
    env = {**CHILD_ENV, **(env or {})}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun]
    else:
        cmd = [sys.executable]
    proc = run_bounded([*cmd, "train.py", *args], cwd=cwd, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_bounded(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session (`communicate_bounded`) and return the finished process."""
    proc = start_session(cmd, cwd, env)
    out, err = communicate_bounded(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_session(cmd: list[str], cwd: Path, env: dict[str, str], stderr=subprocess.PIPE) -> subprocess.Popen:
    """`cmd` started in a session of its own, its output piped (stderr: `stderr`)."""
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
    )


def communicate_bounded(proc: subprocess.Popen, timeout_s: float = RUN_TIMEOUT_S) -> tuple[str, str | None]:
    """The output of `proc` (started by `start_session`) once it ends. Still going after `timeout_s` is a hang:
    every `train.py` process of its session (trainers, rank shells, standbys) prints each thread's Python
    stack (the trainer's SIGUSR1 handler), then the whole session is killed and the test fails with the
    output, stacks included."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in session_trainers(proc.pid):
            os.kill(pid, signal.SIGUSR1)
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"hung for {timeout_s} s, stacks at the end:\n{out}\n{err}") from None


def session_trainers(session: int) -> list[int]:
    """The pids of session `session`'s `train.py` processes."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            sid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (ValueError, OSError, IndexError):
            continue
        if sid == session and b"train.py" in argv and b"torch.distributed.run" not in argv:
            pids.append(int(entry.name))
    return pids


# ---- what a run printed and recorded ----------------------------------------------------------------------


def one_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    """The process failed with status 2 and exactly one `error:` line (no traceback) holding `words`; that line."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


Run = str | Path | list[RunEvent]  # a run's stdout (its `run: <dir>` lines), its run folder, or its events


def run_events(run: Run, cwd: Path = ROOT) -> list[RunEvent]:
    """The one reader of a run's recorded events, in order: `run` is its stdout (the folders its `run: <dir>`
    lines name, relative ones against `cwd`), its run folder, or events already read (returned as they are)."""
    if isinstance(run, list):
        return run
    return read_events(run) if isinstance(run, Path) else _run_events(run, cwd)


def steps(run: Run) -> list[StepLine]:
    """The `step` records of a run (every iteration, each once), in order."""
    return [e for e in run_events(run) if isinstance(e, StepLine)]


def step_losses(run: Run) -> dict[int, float]:
    """{iteration: loss} of a run's `step` records (the loss as its line prints it)."""
    return {line.step: line.value("loss") for line in steps(run)}


# the console lines of a run's recorded kinds (trainer/records/event_log.py KINDS), by how they start
RECORDED = (
    "step=",
    "validation step=",
    "elastic: ",
    "fault: ",
    "survivor: ",
    "failure detected: ",
    "preempted: ",
    "shell: ",
    "recovery step=",
    "recovery work ",
    "checkpoint: ",
    "saved checkpoint ",
    "accounting ",
    "final step=",
)
# what the README's demo (`make train`: a death replaced in place) records, at least
DEMO_KINDS = {"step", "fault", "survivor", "shell", "recovery", "recovery_work", "accounting", "final"}


def assert_recorded_as_printed(out: str) -> list[RunEvent]:
    """The run's events, once checked against its stdout `out`: every line printed of a recorded kind (by
    any process) is one record, and each record reads back into its printed line byte for byte (lines of
    different processes may reach stdout in another order than their records reach the file)."""
    events = run_events(out)
    printed = sorted(line for line in out.splitlines() if line.startswith(RECORDED))
    assert sorted(e.line() for e in events if e.line().startswith(RECORDED)) == printed, out
    return events


def reached(printed: str, step: int, cwd: Path = ROOT) -> bool:
    """Whether the run whose stdout so far is `printed` has recorded iteration `step` (or a later one)."""
    return any(last_step(folder) >= step for folder in run_folders(printed, cwd))


def assert_each_step_once(run: Run, reference: Run) -> None:
    """Every iteration of `run` is recorded once, in order, with the loss of the same iteration of the
    fault-free `reference`, and `run` trained as far as `reference`."""
    logged = [line.step for line in steps(run)]
    expected = step_losses(reference)
    assert logged == list(range(1, max(expected) + 1)), logged
    assert step_losses(run) == expected


def faults(run: Run) -> list[FaultStrike]:
    """The `fault:` lines of a run, as recorded (by whichever rank printed them, on rank 0's host)."""
    return [e for e in run_events(run) if isinstance(e, FaultStrike)]


def validations(run: Run) -> list[ValidationLine]:
    """The `validation step=...` lines of a run, as recorded."""
    return [e for e in run_events(run) if isinstance(e, ValidationLine)]


def survivors(run: Run) -> list[SurvivorLine]:
    """The `survivor:`, `failure detected:` and `preempted:` lines of a run, as recorded."""
    return [e for e in run_events(run) if isinstance(e, SurvivorLine)]


def recoveries(run: Run) -> list[RecoveryReport]:
    """The `recovery step=...` lines of a run, as recorded."""
    return [e for e in run_events(run) if isinstance(e, RecoveryReport)]


def recovery_work(run: Run) -> list[RecoveryWork]:
    """The `recovery work ...` lines of a run, as recorded."""
    return [e for e in run_events(run) if isinstance(e, RecoveryWork)]


def accounting(run: Run) -> AccountingLine:
    """The `accounting` line of a run, as recorded (the last one: a run prints one)."""
    found = [e for e in run_events(run) if isinstance(e, AccountingLine)]
    assert found, f"no accounting line recorded for:\n{run}"
    return found[-1]


def final_line(run: Run) -> tuple[int, float, str]:
    """(step, loss, state_digest) of the first `final` line among a run's events."""
    events = run_events(run)
    finals = [e for e in events if isinstance(e, FinalLine)]
    assert finals, f"no final line recorded for:\n{run}"
    return finals[0].step, finals[0].loss, finals[0].state_digest


def after(run: Run, event: RunEvent) -> list[RunEvent]:
    """A run's events after the last record of `event`."""
    events = run_events(run)
    assert event in events, f"{event.line()!r} not recorded in {events}"
    return events[len(events) - events[::-1].index(event) :]


def stepped_operators(cfg) -> tuple[list, object]:
    """(operators, optimizer) of `cfg`'s model (seed 0) after one optimizer step on random tokens: every
    operator with FP32 weights and optimizer state, built in this process."""
    import torch

    from models import build_model
    from moevement.operators import build_registry
    from trainer.model_operators import stacked_operators
    from trainer.optim import build_optimizer

    torch.manual_seed(0)
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.training)
    model(torch.randint(0, 256, (2, 16))).float().mean().backward()
    optimizer.step()
    return build_registry(model, stacked_operators(model)), optimizer


# ---- the repository's Python files -------------------------------------------------------------------------


def python_files(root: Path = ROOT) -> list[Path]:
    """Every .py file under `root`, outside hidden folders (.venv, .git) and caches."""
    return sorted(
        p
        for p in root.rglob("*.py")
        if not any(part.startswith(".") or part in ("__pycache__", "outputs") for part in p.relative_to(root).parts)
    )


def module_name(path: Path, root: Path = ROOT) -> str:
    """Dotted module name of a file relative to `root` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# ---- a rank shell over a scripted child (trainer/lifecycle/rank_shell.py) ------------------------------------------

SHELL_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    sys.path.insert(0, {root!r})
    from trainer.lifecycle import rank_shell
    log = open({log!r}, "a")
    role = os.environ[rank_shell.ROLE]
    rank_shell.watch_the_shell()
    def records():
        return [json.loads(line) for line in open({log!r})]
    if role == "standby":
        log.write(json.dumps({{"standby": os.getpid()}}) + "\\n")
        log.flush()
        rank_shell.await_word_to_prepare()
        log.write(json.dumps({{"prepared": os.getpid()}}) + "\\n")
        log.flush()
        activation = rank_shell.await_activation()
        if activation is None:
            sys.exit(0)
        log.write(json.dumps({{"activated": activation, "role": os.environ[rank_shell.ROLE]}}) + "\\n")
        log.flush()
    generation = int(os.environ.get(rank_shell.GENERATION, "0"))
    if {endings!r}[min(generation, len({endings!r}) - 1)] == "silent-die":  # dies before its first word
        os.kill(os.getpid(), signal.SIGKILL)
    rank_shell.start_heartbeat()
    rank_shell.report(f"generation {{generation}}")
    rank_shell.report(f"step {{5 + generation}}")  # it begins training iteration 5 + generation
    log.write(json.dumps({{"trainer": os.getpid(), "generation": generation}}) + "\\n")
    log.flush()
    ending = {endings!r}[min(generation, len({endings!r}) - 1)]
    if ending == "finished-die":
        rank_shell.report("finished 7")
    if ending == "training-die":  # say it trains, wait for a standby prepared since, die
        before = sum("prepared" in r for r in records())
        rank_shell.report("training 1")
        while sum("prepared" in r for r in records()) == before:
            time.sleep(0.05)
    if ending == "standby-killed-die":  # kill the standby, wait for the shell's new one, die
        def standbys():
            return [r["standby"] for r in records() if "standby" in r]
        while not standbys():
            time.sleep(0.05)
        os.kill(standbys()[0], signal.SIGKILL)
        while len(standbys()) < 2:
            time.sleep(0.05)
    if ending == "freeze":  # a hang: the whole process stops, its heartbeat with it
        os.kill(os.getpid(), signal.SIGSTOP)
    if ending == "busy-0":  # busy for 4 s, its heartbeat going on (as in a long collective)
        time.sleep(4)
        ending = "0"
    if ending.startswith("stop-shell"):  # stop the shell (SIGSTOP), then live on ("-busy") or exit 0
        os.kill(os.getppid(), signal.SIGSTOP)
        time.sleep(60 if ending == "stop-shell-busy" else 0)
        ending = "0"
    if ending.endswith("die"):
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(ending))
    """
)


def run_shell(
    tmp_path, endings: list[str], max_replacements: int, heartbeat_timeout_s: float = 600.0, at_once: bool = False
) -> tuple[int, list[dict], str]:
    """A shell (`fault.heartbeat_timeout_s` = `heartbeat_timeout_s`) over the child script whose trainer of
    generation g ends as `endings[g]` ("die": SIGKILL, "silent-die": SIGKILL before its first word to the
    shell, "finished-die": SIGKILL after reporting the job finished at step 7,
    "standby-killed-die": SIGKILL once it killed the standby and the shell started another, "training-die":
    SIGKILL once it said it trains and a standby prepared after that, "freeze":
    SIGSTOP, "busy-0": exit 0 after 4 s, "stop-shell-busy": SIGSTOP its shell and live on, "stop-shell":
    SIGSTOP its shell and exit 0, or an exit status); each trainer says it begins iteration 5 + g; returns (the
    shell's status, the children's records, the output of the shell and its children). A standby records when
    it starts and when it prepares (it is told to once the trainer says it trains, or with `at_once`
    (`fault.standby_prepare`) at once)."""
    from trainer.lifecycle import rank_shell

    log = tmp_path / "log.jsonl"
    script = tmp_path / "child.py"
    script.write_text(SHELL_CHILD.format(root=str(ROOT), log=str(log), endings=endings))
    driver = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); from trainer.lifecycle.rank_shell import RankShell; "
        f"sys.exit(RankShell([sys.executable, {str(script)!r}], {max_replacements}, {heartbeat_timeout_s}, "
        f"prepare_at_once={at_once}).run())"
    )
    env = {k: v for k, v in os.environ.items() if k != rank_shell.ROLE}
    env.update(RANK="1", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=120)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, records, proc.stdout + proc.stderr


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str):
    """A real file system of `size` (tmpfs, owner-only) at `mount` for the duration: the test is skipped where
    mounting is not allowed (it needs root, as here and in CI)."""
    import pytest

    mount.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0700"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@contextlib.contextmanager
def one_rank_group():
    """A real one-rank gloo process group for the duration (the conversion asks the group for its rank);
    the test is skipped when this process already has a group."""
    import pytest
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("needs its own one-rank process group")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
