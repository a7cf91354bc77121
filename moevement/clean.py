"""Remove host state that no restart can use: `python -m moevement.clean [--host-dir DIR] [--job NAME] [--dry-run]`.

A job's host state (`<host_dir>/<job>/`: snapshots, replicas, manifests; see the README's "Where state
lives") is kept after a crash or a preemption so that a relaunch of the same job resumes from it. This
removes the state of every job (or of `--job`) under the host directory whose processes are provably
dead: no rank lock of the job on this node is held and no torchrun agent that ran it on this node still
lives (between a worker's death and the next generation no worker holds a lock, but the agent does restart
them, and they need this state). A live job's state is never touched. Only
directories that pass the owner-only check are removed (never through a symlink).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moevement.storage.host_memory import JobLock, remove_tree
from moevement.storage.private_files import HostMemoryError, check_private, default_host_dir


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def clean(host_dir: Path, job: str | None, dry_run: bool, out=print) -> int:
    """Remove the dead jobs' state under `host_dir`; returns the bytes freed (or that would be)."""
    check_private(host_dir)
    freed = 0
    for job_dir in sorted(p for p in host_dir.iterdir() if job is None or p.name == job):
        try:
            check_private(job_dir)
        except HostMemoryError as e:
            out(f"skipped {job_dir}: {e}")
            continue
        locks = sorted(job_dir.glob("rank*.lock"))
        if any(JobLock.held(lock) for lock in locks):
            out(f"kept {job_dir}: the job is running")
            continue
        agents = sorted({pid for pid in map(JobLock.agent_alive, locks) if pid is not None})
        if agents:
            out(f"kept {job_dir}: its torchrun agent (pid {agents[0]}) lives and may start the next generation")
            continue
        size = tree_bytes(job_dir)
        if not dry_run:
            remove_tree(job_dir, host_dir)
        freed += size
        out(f"{'would remove' if dry_run else 'removed'} {job_dir} ({size / 1e6:.1f} MB)")
    return freed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host-dir", default="", help="checkpoint.host_dir of the jobs (default: per-user /dev/shm)")
    parser.add_argument("--job", default=None, help="only this job.name (default: every job)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed")
    args = parser.parse_args(argv)
    host_dir = Path(args.host_dir or default_host_dir())
    if not host_dir.exists():
        print(f"nothing to clean: {host_dir} does not exist")
        return 0
    try:
        freed = clean(host_dir, args.job, args.dry_run)
    except HostMemoryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'would free' if args.dry_run else 'freed'} {freed / 1e6:.1f} MB under {host_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
