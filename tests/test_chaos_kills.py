"""Seeded chaos: the test process SIGKILLs torchrun's workers at random moments (docs/design/lifecycle/README.md).

A death may strike anywhere: in the setup of a new generation, during its rejoin, in training, while a
survivor keeps its live state. A victim is a trainer process (its rank shell replaces it in place) or,
one time in four, the rank shell itself (its trainer dies with it and torchrun restarts every worker).
Whatever the moments, the run ends with exit status 0, the fault-free run's `state_digest`, and every
`step=` line equal to the fault-free run's. `CHAOS_SEEDS=1,2,3` runs other seeds."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    BASE,
    CHILD_ENV,
    MOEVEMENT,
    PP2,
    PP4,
    ROOT,
    RUN_OUTPUTS,
    assert_each_step_once,
    baseline,
    final_line,
    recoveries,
)
from trainer.records.event_log import last_step, run_folders

STEPS = ["--training.steps", "100"]
SEEDS = [int(s) for s in os.environ.get("CHAOS_SEEDS", "1").split(",")]


def processes() -> dict[int, tuple[int, dict, list[bytes]]]:
    """{pid: (parent pid, environment, command line)} of the live, non-zombie processes."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if fields[0] != "Z":
            found[int(entry.name)] = (int(fields[1]), dict(i.split(b"=", 1) for i in environ if b"=" in i), cmdline)
    return found


def workers(agent: int, shells: bool = False) -> dict[int, int]:
    """{rank: pid} of the live train.py trainers of the torchrun agent `agent` (each a rank shell's trainer
    child), or of the rank shells themselves (the agent's children)."""
    procs, found = processes(), {}
    for pid, (parent, env, cmdline) in procs.items():
        if b"train.py" not in cmdline:
            continue
        slot = parent == agent and b"MOEVEMENT_ROLE" not in env
        trainer = env.get(b"MOEVEMENT_ROLE") == b"trainer" and procs.get(parent, (0,))[0] == agent
        if slot if shells else trainer:
            found[int(env.get(b"RANK", b"-1"))] = pid
    return found


class Chaos:
    """One seeded run: which moments to kill at, and the log of what was killed."""

    def __init__(self, agent: subprocess.Popen, stdout: Path, nproc: int, seed: int):
        self.agent, self.stdout, self.nproc, self.rng = agent, stdout, nproc, random.Random(seed)
        self.launched, self.killed, self.kills = time.monotonic(), set(), []
        self.deadline = self.launched + 400  # a hang fails the test instead of stalling it

    def steps(self) -> int:
        """The newest iteration the run has recorded (each is logged once, whoever dies)."""
        return max((last_step(folder) for folder in run_folders(self.stdout.read_text(), ROOT)), default=0)

    def until(self, done) -> bool:
        """Poll `done()` while the job runs; False once it has ended (or the deadline passed)."""
        while self.agent.poll() is None and time.monotonic() < self.deadline:
            if done():
                return True
            time.sleep(0.02)
        return False

    def strike(self) -> bool:
        """Wait until every earlier victim has a successor, then SIGKILL a random trainer (or, one time in
        four, a rank shell): a third of the time at most 6 s after (setup, rejoin), otherwise right after the
        job trained 1 to 45 more iterations (or finished)."""
        rank, start_up, pause, steps, shell = (
            self.rng.randrange(self.nproc),
            self.rng.random() < 1 / 3,
            self.rng.uniform(0.0, 6.0),
            self.rng.randint(1, 45),
            self.rng.random() < 1 / 4,
        )

        def fresh() -> bool:
            alive = workers(self.agent.pid)
            return len(alive) == self.nproc and not self.killed & set(alive.values())

        if not self.until(fresh):
            return False
        if start_up:
            time.sleep(pause)
        else:
            seen = self.steps()
            if not self.until(lambda: self.steps() >= seen + steps):
                return False
            time.sleep(pause / 20)
        alive = workers(self.agent.pid, shells=shell)
        if not alive:
            return False
        victim = rank if rank in alive else sorted(alive)[rank % len(alive)]
        self.killed |= set(workers(self.agent.pid).values()) if shell else {alive[victim]}
        try:
            os.kill(alive[victim], signal.SIGKILL)
        except ProcessLookupError:  # it had just exited: its generation ends anyway
            return True
        when = "start-up" if start_up else steps
        self.kills.append((round(time.monotonic() - self.launched, 2), victim, f"{when}{' shell' if shell else ''}"))
        return True


def chaos_run(tmp_path: Path, layout: list[str], nproc: int, seed: int, kills: int):
    """Launch the job under torchrun and SIGKILL a worker `kills` times (`Chaos.strike`); returns (exit
    status, stdout, stderr, [(seconds since launch, rank, start-up or iterations trained) per kill])."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [f"--max-restarts={kills + 1}", "train.py", *BASE, *STEPS, *layout, *MOEVEMENT]
    cmd += ["--checkpoint.host_dir", str(tmp_path / "shm"), "--job.output_dir", str(RUN_OUTPUTS)]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=CHILD_ENV, stdout=stdout, stderr=stderr)
        chaos = Chaos(agent, out, nproc, seed)
        try:
            for _ in range(kills):
                if not chaos.strike():
                    break
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=max(1.0, chaos.deadline - time.monotonic()))
        finally:
            if agent.poll() is None:
                for pid in workers(agent.pid, shells=True).values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                agent.kill()
                agent.wait()
    return agent.returncode, out.read_text(), err.read_text(), chaos.kills


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("layout", "nproc"), [(PP2, 2), (PP4, 4)], ids=["pp2", "pp4"])
def test_random_sigkills_end_bit_exact(tmp_path, layout, nproc, seed):
    """Three SIGKILLs: every iteration is recorded once with the fault-free run's loss, and the final digest is
    the fault-free run's."""
    reference = baseline([*STEPS, *layout], nproc)
    status, out, err, kills = chaos_run(tmp_path, layout, nproc, seed, kills=3)
    context = f"seed={seed} kills (s, rank, when)={kills}\n{out}\n{err[-4000:]}"
    assert status == 0, context
    assert final_line(out) == final_line(reference), context
    try:
        assert_each_step_once(out, reference)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{context}") from None


def signal_rank1_shell(tmp_path: Path, steps: int, after: int, sig: signal.Signals, *extra: str) -> tuple[str, int]:
    """pp=2 for `steps` iterations under torchrun (one restart allowed): once `after` iterations are logged the
    test sends `sig` to the rank shell of rank 1 (the process itself, not its trainer) and waits for the job's
    end, then kills that shell if it is still there. Returns (stdout, the shell's pid); asserts exit 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    cmd += ["train.py", *BASE, "--training.steps", str(steps), *PP2, *MOEVEMENT, *extra]
    cmd += ["--checkpoint.host_dir", str(tmp_path / "shm"), "--job.output_dir", str(RUN_OUTPUTS)]
    out = tmp_path / "stdout"
    with out.open("w") as stdout:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=CHILD_ENV, stdout=stdout, stderr=subprocess.STDOUT)
        chaos = Chaos(agent, out, 2, seed=0)
        assert chaos.until(lambda: chaos.steps() >= after), out.read_text()
        shell = workers(agent.pid, shells=True)[1]
        os.kill(shell, sig)
        try:
            agent.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(shell, signal.SIGKILL)  # a stopped shell is never left behind
    text = out.read_text()
    assert agent.returncode == 0, text
    assert any(r.ranks == (1,) and r.restart == "local" for r in recoveries(text)), text
    assert final_line(text) == final_line(baseline(["--training.steps", str(steps), *PP2], 2))
    return text, shell


@pytest.mark.slow
def test_a_killed_rank_shell_falls_back_to_torchrun(tmp_path):
    """pp=2: the rank shell of rank 1 is SIGKILLed after 5 iterations: its trainer dies with it, torchrun
    restarts every worker, and the job still ends with the fault-free run's digest."""
    signal_rank1_shell(tmp_path, 20, 5, signal.SIGKILL)


@pytest.mark.slow
def test_a_stopped_rank_shell_is_killed_by_its_trainer_and_torchrun_recovers(tmp_path):
    """pp=2: the rank shell of rank 1 is stopped (a real SIGSTOP of its process) after 3 iterations. It beats to
    its trainer no more: past `fault.heartbeat_timeout_s` (3 s) the trainer kills it (one line) and dies with
    it, torchrun restarts every worker, and the job ends with the fault-free run's digest (torchrun, which
    waits on its workers, the shells, used to wait on the stopped one for ever). 40 iterations outlast the
    bound after the stop."""
    text, shell = signal_rank1_shell(tmp_path, 40, 3, signal.SIGSTOP, "--fault.heartbeat_timeout_s", "3")
    said = re.search(
        rf"^shell: rank 1: rank shell pid {shell} said nothing for (\S+) s \(more than "
        r"fault.heartbeat_timeout_s=3 s\): stopped or stuck; killed by its trainer pid \d+ ",
        text,
        re.M,
    )
    assert said and 3 <= float(said[1]) < 20, text
