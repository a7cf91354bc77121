"""A run's record: `<output_dir>/<job.name>/<timestamp>/` with its resolved config, how it was launched, where
it started and its TensorBoard events. Rank 0 writes it; a torchrun restart of the same launch continues its
folder.

`config.toml` holds the config as the start resolved it (`checkpoint.load_step N` or `checkpoint.load DIR`,
never -1: `trainer.checkpoint.resume`), so that it reruns the same thing; `run.json` names the checkpoint the
run resumed from (`resumed_from`: directory, step and the seal of its meta.json; null for the initial state)
and the run's lineage (`trainer.checkpoint.lineage`), which a later generation of the run keeps."""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed

from parallelisms.distributed import store_round
from trainer.atomic_write import write_atomically
from trainer.checkpoint.lineage import new_lineage
from trainer.checkpoint.resume import Source
from trainer.config import Config, ConfigError
from trainer.config_help import to_toml
from trainer.lifecycle import rank_shell
from trainer.lifecycle.rank_shell import torchrun_agent_pid

RECORD = "run.json"
CONFIG = "config.toml"
REPO = Path(__file__).resolve().parents[2]


def launch_identity() -> dict:
    """What a torchrun restart of this launch shares with its first attempt: the agent (this worker's
    parent process on this host) and torchrun's run id."""
    return {
        "host": socket.gethostname(),
        "agent_pid": torchrun_agent_pid(),
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""),
    }


def launch_command(argv: list[str]) -> str:
    """The command line as typed: torchrun's (this worker's parent) under torchrun, else this process's."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            parent = Path(f"/proc/{torchrun_agent_pid()}/cmdline").read_bytes().split(b"\0")
            return shlex.join(arg.decode(errors="replace") for arg in parent if arg)
        except OSError:
            pass
    return shlex.join([sys.executable, *argv])


def git_commit() -> str | None:
    """HEAD of the checkout this trainer runs from, with `+dirty` if it has local changes; None outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _record_of(folder: Path) -> dict | None:
    path = folder / RECORD
    if folder.is_symlink() or path.is_symlink() or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _continued_folder(job_dir: Path, identity: dict) -> Path | None:
    """The newest run folder of this torchrun launch (a restarted generation continues it), if any."""
    if not job_dir.is_dir():
        return None
    for folder in sorted(job_dir.iterdir(), reverse=True):
        record = _record_of(folder)
        if record is not None and record.get("launch") == identity:
            return folder
    return None


def _new_folder(job_dir: Path) -> Path:
    """`job_dir/<UTC timestamp>`, suffixed `-1`, `-2`, ... when another run took that second."""
    job_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())
    for n in range(1000):
        folder = job_dir / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"{job_dir}: no free run folder for {stamp}")


@dataclass(frozen=True)
class RunFolder:
    """Rank 0's run record: its folder, whether it continues an earlier generation's, and the run's lineage."""

    path: Path
    continued: bool
    lineage: str


def open_run_record(cfg: Config, world: int, argv: list[str], restarted: bool, source: Source | None) -> RunFolder:
    """This run's folder, which continues the folder of an earlier generation of this torchrun run when
    `restarted` (after a torchrun restart or an in-place replacement) and there is one. A new folder gets
    `config.toml` (`cfg`, as the start resolved it: loads back into the same Config with `--config`) and
    `run.json` (command line, commit, versions, layout, `source`: the checkpoint loaded, the lineage); a
    continued one keeps them. The lineage: `source`'s, else the continued folder's, else a new one. Rank 0
    only; ConfigError if the folder cannot be written."""
    try:
        return _open(cfg, world, argv, restarted, source)
    except OSError as e:
        msg = f"config key 'job.output_dir' ({cfg.job.output_dir!r}): cannot write the run record: {e}"
        raise ConfigError(msg) from None


def _open(cfg: Config, world: int, argv: list[str], restarted: bool, source: Source | None) -> RunFolder:
    job_dir = Path(cfg.job.output_dir) / cfg.job.name
    identity = launch_identity()
    folder = _continued_folder(job_dir, identity) if restarted else None
    inherited = source.lineage if source is not None else None
    if folder is not None:
        kept = (_record_of(folder) or {}).get("lineage")
        return RunFolder(folder, True, inherited or (kept if isinstance(kept, str) else None) or new_lineage())
    lineage = inherited or new_lineage()
    folder = _new_folder(job_dir)
    write_atomically(folder / CONFIG, to_toml(cfg))
    record = {
        "command": launch_command(argv),
        "cwd": os.getcwd(),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "world_size": world,
        "layout": {"pp": cfg.parallelism.pp, "dp": cfg.parallelism.dp, "ep": cfg.parallelism.ep},
        "launch": identity,
        "resumed_from": source.record() if source is not None else None,
        "lineage": lineage,
    }
    write_atomically(folder / RECORD, json.dumps(record, indent=2) + "\n")
    return RunFolder(folder, False, lineage)


def _folder_key() -> str:
    return f"{store_round()}/run-folder"


def publish_run_folder(store: torch.distributed.Store | None, run_dir: Path) -> None:
    """Rank 0, its run folder open: name it on torchrun's store (under torchrun) for the other ranks and their
    shells (before the strategy's first collective, so every rank finds it after that one), on torchrun's
    `store` (`ProcessState.store`)."""
    if store is not None:
        store.set(_folder_key(), str(run_dir.resolve()))


def published_run_folder(store: torch.distributed.Store | None) -> Path | None:
    """Every rank under torchrun, past a collective after rank 0's `publish_run_folder`: the run folder, where
    it is on this host (rank 0's: its `run.json` names this host), so that appends to its events.jsonl are
    atomic; None elsewhere, or where rank 0 named none (it could not open one)."""
    if store is None:
        return None
    try:
        if not store.check([_folder_key()]):
            return None
        folder = Path(store.get(_folder_key()).decode())
    except (RuntimeError, torch.distributed.DistError):
        return None
    record = _record_of(folder)
    launch = record.get("launch") if record is not None else None
    return folder if isinstance(launch, dict) and launch.get("host") == socket.gethostname() else None


def tell_the_shell_the_run_folder(folder: Path | None) -> None:
    """Under a rank shell: tell it the run folder (`published_run_folder`), where the shell records its
    `shell:` lines beside the trainers' events (None: its lines stay printed only)."""
    if folder is not None and os.environ.get(rank_shell.ROLE) == "trainer":
        rank_shell.report(f"run {folder}")
