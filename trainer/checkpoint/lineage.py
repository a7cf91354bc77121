"""Which run wrote a checkpoint: its lineage, recorded in `meta.json` as `"lineage"`.

A lineage is the line of runs that trained one state on, named by a random id. A run that starts from the
initial state, from an imported checkpoint or from a checkpoint of another config (`load_other_config`)
begins a new one; a run that resumes from a checkpoint of its own config continues that checkpoint's (a
torchrun restart or in-place generation of a run keeps the lineage its run record names,
`trainer/records/run_record.py`). A periodic save replaces, and `checkpoint.keep_latest` prunes, only step
directories of the saving run's lineage: no run deletes or overwrites what another wrote. A checkpoint
without a lineage (written by an older version, or by `checkpoint.save_final`) belongs to no run's lineage:
it is loadable, never replaced or pruned.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from trainer.checkpoint.dense_read import open_meta
from trainer.checkpoint.publish import LINEAGE, CheckpointError


def new_lineage() -> str:
    """A fresh lineage id (16 hex digits)."""
    return secrets.token_hex(8)


def meta_of(directory: Path) -> dict | None:
    """The checked, sealed `meta.json` of the checkpoint `directory` (`dense_read.open_meta`); None when it
    has none or it does not pass (missing, a symlink, damaged, another format)."""
    try:
        return open_meta(str(directory))
    except CheckpointError:
        return None


def lineage_of(meta: dict | None) -> str | None:
    """The lineage a checked `meta.json` records (`open_meta` checked it is an id); None: it records none."""
    return None if meta is None else meta.get(LINEAGE)


def of_lineage(directory: Path, lineage: str | None) -> bool:
    """Whether the checkpoint `directory` was written by the lineage `lineage` (never for None)."""
    return lineage is not None and lineage_of(meta_of(directory)) == lineage
