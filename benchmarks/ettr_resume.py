"""An ETTR invocation continued by a later one (`benchmarks.ettr --resume`).

At 300 iterations a run of `bench_moe` takes most of an hour on two cores, and an invocation of four
strategies over three seeds longer than a working session. Every run is independent of the others but for
its order: its references are the `none` runs just before and after it, and the first reference sets the
snapshot cap every later run uses. So an invocation writes each run's log whole once the run has finished
(`logged`), and one started again with the same arguments over the same `--out` (`--resume`) reads back the
runs found there, in the same order, and launches only the rest: the table is the one a single invocation
would have printed.

That holds only for the same code and the same arguments: `bind` records both in `<out>/invocation.json` and
refuses to resume another invocation's folder, or one whose runs another commit (or uncommitted changes)
made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from trainer.records.event_log import run_folders

INVOCATION = "invocation.json"


def code_version() -> str:
    """The checkout's commit, `+dirty` where tracked files differ from it ("unknown" outside git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit.strip() + ("+dirty" if dirty else "")


def bind(out: Path, argv: list[str], resume: bool) -> None:
    """Record in `out` what this invocation runs (`argv`, without `--resume`) and on which code; with `resume`
    and a record there, exit unless both are the same and the code is a clean commit."""
    path, mine = out / INVOCATION, {"argv": argv, "code": code_version()}
    if resume and path.exists():
        try:
            theirs = json.loads(path.read_text())
            argv_then, code_then = list(theirs["argv"]), str(theirs["code"])
        except (ValueError, KeyError, TypeError):
            sys.exit(f"--resume: {path}: not an invocation record this benchmark wrote; use another --out")
        if argv_then != argv:
            sys.exit(f"--resume: {out} holds the runs of another invocation: {' '.join(argv_then)}")
        if code_then != mine["code"] or mine["code"].endswith("+dirty") or mine["code"] == "unknown":
            sys.exit(
                f"--resume: {out}'s runs were made by {code_then}, this checkout is {mine['code']}: resume from a "
                f"clean checkout of that commit (git worktree add <dir> {code_then.removesuffix('+dirty')})"
            )
        return
    path.write_text(json.dumps(mine, indent=1) + "\n")


def logged(path: Path, resume: bool, start: Callable[[], str]) -> str:
    """The stdout of the run logged at `path`: with `resume`, the log an earlier invocation wrote there once
    the run had finished (its record folders must still exist); otherwise `start()`'s, written whole."""
    if resume and path.exists():
        stdout = path.read_text()
        folders = run_folders(stdout, Path.cwd())
        if not folders or not all(folder.is_dir() for folder in folders):
            sys.exit(f"--resume: {path}: the run's record folder is gone; remove the log to run it again")
        print(f"reused {path}", flush=True)
        return stdout
    stdout = start()
    partial = path.with_name(path.name + ".partial")
    partial.write_text(stdout)
    partial.replace(path)
    return stdout
