"""The folder of periodic dense checkpoints (`checkpoint.folder`): one `step-<N>` directory per saved
iteration, which ones are there, which one `checkpoint.load_step` names, and keeping the newest
`checkpoint.keep_latest`.

The folder is made owner-only by this program when it does not exist; a symlink is refused. Pruning
deletes only what a save may replace (`publish.replaceable_files`: this program's own file names in a
checkpoint of this project), so a step directory holding anything else stays, with one line saying so.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainer.checkpoint.publish import META, CheckpointError, remove_stale_temporaries, replaceable_files

KEY = "checkpoint.dense_interval"
STEP_DIR = re.compile(r"step-(\d+)")


def checkpoint_folder(cfg) -> Path:
    """`checkpoint.folder`, else `<job.output_dir>/<job.name>/checkpoints`."""
    return Path(cfg.checkpoint.folder or Path(cfg.job.output_dir) / cfg.job.name / "checkpoints")


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def make_folder(folder: Path) -> None:
    """Rank 0, before the first save: the folder, made owner-only if new; stale temporaries of this
    program's saves there removed. CheckpointError for a symlink or a folder it cannot make."""
    if folder.is_symlink():
        raise CheckpointError(f"checkpoint.folder: {folder} is a symlink; refused, never followed")
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        remove_stale_temporaries(folder, STEP_DIR)
    except OSError as e:
        raise CheckpointError(f"checkpoint.folder: cannot make {folder} ({e.strerror or e})") from None


def published_steps(folder: Path) -> list[int]:
    """The steps of the published checkpoints in `folder` (directories `step-<N>` holding a `meta.json`,
    not symlinks), ascending."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    steps = []
    for entry in entries:
        match = STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(entry.path, META)):
            steps.append(int(match[1]))
    return sorted(steps)


def load_directory(cfg) -> str:
    """The dense checkpoint a run resumes from: `checkpoint.load`, or `<folder>/step-<load_step>` (-1: the
    newest published there); "" for none. CheckpointError naming the folder when it has no such step.
    An elastic job (`parallelism.elastic`) resumes from the newest published in its folder, at every start
    and whatever its layout, and from `checkpoint.load` (or nothing) before it saved one."""
    c, folder = cfg.checkpoint, checkpoint_folder(cfg)
    if cfg.parallelism.elastic:
        steps = published_steps(folder)
        return str(step_dir(folder, steps[-1])) if steps else c.load
    if not c.load_step:
        return c.load
    steps = published_steps(folder)
    step = (steps[-1] if steps else None) if c.load_step == -1 else c.load_step
    if step is None or step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise CheckpointError(f"checkpoint.load_step: no checkpoint of step {c.load_step} in {folder} (steps: {have})")
    return str(step_dir(folder, step))


def prune(folder: Path, keep: int) -> list[str]:
    """Delete the published checkpoints of `folder` but the newest `keep` (0: keep all); lines for those
    left in place."""
    lines = []
    for step in published_steps(folder)[:-keep] if keep else []:
        path = step_dir(folder, step)
        try:
            for name in replaceable_files(path, KEY):
                (path / name).unlink()
            path.rmdir()
        except (OSError, CheckpointError) as e:
            lines.append(f"checkpoint: {path} not deleted (checkpoint.keep_latest={keep}): {e}")
    return lines
