"""Shared test helpers: run the trainer as a real subprocess and parse its lines."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = "train_configs/debug_moe.toml"
# Run records of the suite's runs (`job.output_dir`, unless a test names its own): outside the checkout.
# what every child process of the tests runs with: nothing downloaded, one intra-op thread per process
CHILD_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
RUN_OUTPUTS = Path(tempfile.mkdtemp(prefix="moevement-test-runs-"))
RUN_TIMEOUT_S = 540  # below the suite's per-test budget, so a hung run is reported with its stacks


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow multi-process tests")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(RUN_OUTPUTS, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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


def step_losses(stdout: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step=(\d+) loss=(\S+)", stdout, re.M)}


def final_line(stdout: str) -> tuple[int, float, str]:
    m = re.search(r"^final step=(\d+) loss=(\S+) state_digest=([0-9a-f]{64})$", stdout, re.M)
    assert m, f"no final line in:\n{stdout}"
    return int(m[1]), float(m[2]), m[3]


def stepped_operators(cfg) -> tuple[list, object]:
    """(operators, optimizer) of `cfg`'s model (seed 0) after one optimizer step on random tokens: every
    operator with FP32 weights and optimizer state, built in this process."""
    import torch

    from models import build_model
    from moevement.operators import build_registry
    from trainer.optim import build_optimizer
    from trainer.run.fault_tolerance import stacked_operators

    torch.manual_seed(0)
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.training)
    model(torch.randint(0, 256, (2, 16))).float().mean().backward()
    optimizer.step()
    return build_registry(model, stacked_operators(model)), optimizer
