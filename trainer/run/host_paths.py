"""Where this rank's host state lives on its node, and the lock that makes it this process's own.

`<host_dir>/<job.name>/rank<r>/` (`trainer/lifecycle/host_dirs.py`): snapshot buffers, live state kept for
torchrun's restart, accounting (host_dir: node-local shared memory, per user by default);
`<persist_dir>/<job.name>/`: persisted windows.
"""

from __future__ import annotations

import os
from pathlib import Path

from moevement.storage.host_memory import JobLock
from moevement.storage.private_files import make_private_dirs
from trainer.config import Config
from trainer.lifecycle.host_dirs import host_job_dir
from trainer.lifecycle.rank_shell import torchrun_agent_pid


def persist_root(cfg: Config, default: str = "") -> Path | None:
    """`<persist_dir>/<job.name>`, created owner-only (None: no disk persistence)."""
    directory = cfg.checkpoint.persist_dir or default
    if not directory:
        return None
    Path(directory).parent.mkdir(parents=True, exist_ok=True)
    return make_private_dirs(Path(directory), cfg.job.name)


def claim_host_state(cfg: Config, rank: int, locks: dict[Path, JobLock]) -> JobLock:
    """Lock this rank's place in the job's host directory for the process's lifetime (refused while another
    live process holds it); `locks`: those this process holds, kept by its later generations."""
    job_dir = host_job_dir(cfg)
    path = make_private_dirs(job_dir.parent, job_dir.name) / f"rank{rank:05d}.lock"
    if path not in locks:
        agent = torchrun_agent_pid() if "TORCHELASTIC_RUN_ID" in os.environ else None  # starts the next attempt
        locks[path] = JobLock(path, agent)
    return locks[path]
