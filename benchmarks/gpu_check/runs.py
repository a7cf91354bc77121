"""`train.py` as subprocesses on the GPU (sections 2 and 3): a synthetic corpus, a private host directory,
and the first line that explains a failed run.

Every run reads a small generated text (no dataset download on a machine that may have no network) and keeps
its host state in a fresh owner-only directory under /dev/shm (a relaunch of the same job would otherwise
restart from what an earlier, failed check left), removed at the end.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.variants import QUIET

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the of a and expert router token gradient snapshot window layer stage pipeline model".split()
ERROR_LINE = re.compile(r"^(error: .*|\w+(Error|Exception)\b.*)$", re.M)


class RunFailed(RuntimeError):
    """A train.py run exited non-zero; the message is the line that says why."""


def write_corpus(path: Path, lines: int = 20000) -> Path:
    """A deterministic plain-text corpus (the byte tokenizer reads any text)."""
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(lines))
    path.write_text(text + "\n")
    return path


class Workspace:
    """A private scratch directory for one check: the corpus, run records, and a host directory in /dev/shm."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="moevement-gpu-check-"))
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.host_root = Path(tempfile.mkdtemp(prefix="moevement-gpu-check-", dir=shm))
        self.corpus = write_corpus(self.root / "corpus.txt")

    def common(self, job: str) -> list[str]:
        """Flags every run of the check takes: its data, where its records and host state go, quiet output."""
        return [
            *QUIET,
            "--data.dataset",
            str(self.corpus),
            "--job.name",
            job,
            "--job.output_dir",
            str(self.root / "runs"),
            "--checkpoint.host_dir",
            str(self.host_root / "host"),
        ]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.host_root, ignore_errors=True)


def why(stdout: str, stderr: str) -> str:
    """The line that explains a failed run: the trainer's `error:` line, else the last exception line."""
    found = ERROR_LINE.findall(stderr) or ERROR_LINE.findall(stdout)
    if found:
        return found[-1][0]
    tail = [line for line in (stderr or stdout).strip().splitlines() if line.strip()]
    return tail[-1] if tail else "no output"


def train(args: list[str], timeout_s: float, nproc: int = 0, torchrun: tuple[str, ...] = ()) -> str:
    """stdout of `train.py args` (under torchrun with `nproc` processes when nproc > 0); RunFailed otherwise."""
    launcher = []
    if nproc:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, *launcher, "train.py", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise RunFailed(f"train.py did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise RunFailed(f"train.py exited {proc.returncode}: {why(proc.stdout, proc.stderr)}")
    return proc.stdout
