"""The folder of periodic dense checkpoints (`checkpoint.folder`): one `step-<N>` directory per saved
iteration, which ones are there, what a save may replace, and keeping the newest `checkpoint.keep_latest` of
the saving run's lineage (`trainer.checkpoint.lineage`).

The folder is made owner-only by this program when it does not exist; a symlink is refused. A step
directory is replaced or pruned only by a run of the lineage that wrote it, and then only this program's
file names in it (`publish.replaceable_files`): a step directory holding anything else stays, with one line
saying so. Pruning first renames a checkpoint aside (`.step-<N>.pruned-XXXX`, no longer a published
checkpoint whatever stops it), then deletes its files, `meta.json` last, then the directory. `tidy` (rank 0,
before each save) finishes what a death left behind: marked temporaries of saves whose writer is gone
(`publish.remove_stale_temporaries`), and directories set aside by pruning or by a save that replaced a
step (`.step-<N>.old-XXXX`) whose `meta.json` names this lineage, or that hold nothing any more.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from trainer.checkpoint.events import CheckpointNotPruned, CheckpointPruned
from trainer.checkpoint.lineage import lineage_of, meta_of, of_lineage
from trainer.checkpoint.publish import META, CheckpointError, remove_stale_temporaries, replaceable_files

KEY = "checkpoint.dense_interval"
STEP_DIR = re.compile(r"step-(\d+)")
ASIDE = re.compile(r"\.step-\d+\.(?:old|pruned)-\w+")  # a step set aside by a replacing save or by pruning


def checkpoint_folder(cfg) -> Path:
    """`checkpoint.folder`, else `<job.output_dir>/<job.name>/checkpoints`."""
    return Path(cfg.checkpoint.folder or Path(cfg.job.output_dir) / cfg.job.name / "checkpoints")


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def make_folder(folder: Path, lineage: str | None) -> None:
    """Rank 0, before the first save: the folder, made owner-only if new, tidied (`tidy`). CheckpointError
    for a symlink or a folder it cannot make."""
    if folder.is_symlink():
        raise CheckpointError(f"checkpoint.folder: {folder} is a symlink; refused, never followed")
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tidy(folder, lineage)
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


def tidy(folder: Path, lineage: str | None) -> None:
    """Rank 0: remove what interrupted saves and prunes of `folder` left: marked temporaries whose writer is
    gone, and steps set aside that `lineage` wrote (or that hold nothing any more). Anything else stays."""
    remove_stale_temporaries(folder, STEP_DIR)
    for entry in os.scandir(folder):
        if not (ASIDE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
            continue
        path = Path(entry.path)
        if entry.stat(follow_symlinks=False).st_uid != os.getuid():
            continue
        if os.path.lexists(path / META):
            if of_lineage(path, lineage):
                with suppress(OSError, CheckpointError):
                    _delete_files(path)
        else:  # meta.json goes last: nothing of ours is left in it
            with suppress(OSError):
                path.rmdir()


def refusal(target: Path, lineage: str | None) -> str | None:
    """Why a save of `lineage` may not replace the step directory `target` (None: it may, or there is none)."""
    try:
        if not os.listdir(target):
            return None
    except OSError:
        return None  # none there (or unreadable: the save's own checks say so)
    meta = meta_of(target)
    owner = lineage_of(meta)
    if meta is not None and owner is not None and owner == lineage:
        return None
    what = "a checkpoint of another run" if meta is not None else "something that is not a checkpoint of this run"
    if meta is not None:
        what += f" (lineage {owner})" if owner else " (written with no lineage)"
    return f"it holds {what}, which a save never replaces"


def prune(folder: Path, keep: int, lineage: str | None, upto: int, strike: Callable[[], None]) -> list:
    """Delete the published checkpoints of `lineage` in `folder` up to step `upto` (the one just saved) but
    the newest `keep` (0: keep all); an event per checkpoint (`CheckpointPruned`, or `CheckpointNotPruned`
    for one left in place). `strike`: the `dense_prune` fault injection, called once a pruned checkpoint's
    first file is deleted. Steps of other lineages, and this lineage's past `upto` (a run resumed from an
    older one of its checkpoints replaces them as it saves), are left alone."""
    if not keep:
        return []
    ours = [s for s in published_steps(folder) if s <= upto and of_lineage(step_dir(folder, s), lineage)]
    events = []
    for step in ours[:-keep]:
        path = step_dir(folder, step)
        try:
            files = replaceable_files(path, KEY)
            aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.pruned-", dir=folder))
            os.rename(path, aside)  # onto the empty `aside`: from here on it is no published checkpoint
            _delete_files(aside, files, strike)
            events.append(CheckpointPruned(step, str(path), keep))
        except (OSError, CheckpointError) as e:
            events.append(CheckpointNotPruned(str(path), keep, str(e)))
    return events


def _delete_files(path: Path, files: list[str] | None = None, after_first: Callable[[], None] = lambda: None) -> None:
    """Delete this program's files of the checkpoint at `path` (`files`, else `replaceable_files`), meta.json
    last, then the directory; `after_first` once the first is gone."""
    names = replaceable_files(path, KEY) if files is None else files
    for i, name in enumerate(sorted(names, key=lambda n: n == META)):
        (path / name).unlink()
        if i == 0:
            after_first()
    path.rmdir()
