"""Seeded chaos: the test process SIGKILLs torchrun's workers at random moments (docs/design.md §4, real deaths).

A death may strike anywhere: in the setup of a restarted generation, during its rejoin, in training,
while a survivor writes its live state. Whatever the moments, the run ends with exit status 0, the
fault-free run's `state_digest`, and every `step=` line equal to the fault-free run's. `CHAOS_SEEDS=1,2,3`
runs other seeds."""

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

from tests.conftest import CHILD_ENV, ROOT, RUN_OUTPUTS, final_line
from tests.test_recovery import BASE, MOEVEMENT, PP4, baseline

PP2 = ["--parallelism.pp", "2"]
STEPS = ["--training.steps", "100"]
STEP_LINE = re.compile(r"^step=(\d+) loss=(\S+) .* wall_s=\S+$", re.M)
SEEDS = [int(s) for s in os.environ.get("CHAOS_SEEDS", "1").split(",")]


def workers(agent: int) -> dict[int, int]:
    """{rank: pid} of the live train.py workers the torchrun agent `agent` started."""
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
        if int(fields[1]) != agent or fields[0] == "Z" or b"train.py" not in cmdline:
            continue
        env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        found[int(env.get(b"RANK", b"-1"))] = int(entry.name)
    return found


class Chaos:
    """One seeded run: which moments to kill at, and the log of what was killed."""

    def __init__(self, agent: subprocess.Popen, stdout: Path, nproc: int, seed: int):
        self.agent, self.stdout, self.nproc, self.rng = agent, stdout, nproc, random.Random(seed)
        self.launched, self.generation, self.kills = time.monotonic(), set(), []
        self.deadline = self.launched + 400  # a hang fails the test instead of stalling it

    def steps(self) -> int:
        return len(STEP_LINE.findall(self.stdout.read_text()))

    def until(self, done) -> bool:
        """Poll `done()` while the job runs; False once it has ended (or the deadline passed)."""
        while self.agent.poll() is None and time.monotonic() < self.deadline:
            if done():
                return True
            time.sleep(0.02)
        return False

    def strike(self) -> bool:
        """Wait for a new generation, then SIGKILL a random worker: a third of the time at most 6 s after its
        workers started (setup, rejoin), otherwise right after it trained 1 to 45 iterations (or finished)."""
        rank, start_up, pause, steps = (
            self.rng.randrange(self.nproc),
            self.rng.random() < 1 / 3,
            self.rng.uniform(0.0, 6.0),
            self.rng.randint(1, 45),
        )

        def fresh() -> bool:
            alive = workers(self.agent.pid)
            return len(alive) == self.nproc and not self.generation & set(alive.values())

        if not self.until(fresh):
            return False
        if start_up:
            time.sleep(pause)
        else:
            seen = self.steps()
            if not self.until(lambda: self.steps() >= seen + steps):
                return False
            time.sleep(pause / 20)
        alive = workers(self.agent.pid)
        if not alive:
            return False
        victim = rank if rank in alive else sorted(alive)[rank % len(alive)]
        self.generation = set(alive.values())
        try:
            os.kill(alive[victim], signal.SIGKILL)
        except ProcessLookupError:  # it had just exited: its generation ends anyway
            return True
        self.kills.append((round(time.monotonic() - self.launched, 2), victim, "start-up" if start_up else steps))
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
                for pid in workers(agent.pid).values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                agent.kill()
                agent.wait()
    return agent.returncode, out.read_text(), err.read_text(), chaos.kills


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("layout", "nproc"), [(PP2, 2), (PP4, 4)], ids=["pp2", "pp4"])
def test_random_sigkills_end_bit_exact(tmp_path, layout, nproc, seed):
    """Three SIGKILLs: every step line and the final digest are the fault-free run's."""
    reference = baseline([*STEPS, *layout], nproc)
    status, out, err, kills = chaos_run(tmp_path, layout, nproc, seed, kills=3)
    context = f"seed={seed} kills (s, rank, when)={kills}\n{out}\n{err[-4000:]}"
    assert status == 0, context
    assert final_line(out) == final_line(reference), context
    expected = {int(s): v for s, v in STEP_LINE.findall(reference)}
    printed = STEP_LINE.findall(out)
    assert printed and all(expected[int(s)] == v for s, v in printed), context
