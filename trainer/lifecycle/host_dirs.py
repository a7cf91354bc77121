"""Where a rank's host state lives on its node: `<host_dir>/<job.name>/` (node-local shared memory, per user
by default), which outlives the process for torchrun's restart of every worker (snapshot buffers, live state
a survivor kept, accounting). The lock that makes a rank's place this process's own, and the persisted
windows' folder, are `trainer/run/host_paths.py`'s."""

from __future__ import annotations

from pathlib import Path

from moevement.storage.private_files import default_host_dir
from trainer.config import Config


def host_job_dir(cfg: Config) -> Path:
    """`<host_dir>/<job.name>`: this job's host state on this node (host_dir: per user by default)."""
    return Path(cfg.checkpoint.host_dir or default_host_dir()) / cfg.job.name


def host_rank_dir(cfg: Config, rank: int) -> Path:
    return host_job_dir(cfg) / f"rank{rank:05d}"
