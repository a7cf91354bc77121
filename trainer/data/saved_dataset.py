"""Directories written by `datasets`' ``save_to_disk``, read back with ``datasets.load_from_disk``.

A saved ``Dataset`` holds ``state.json`` and ``dataset_info.json`` beside its Arrow files; a saved
``DatasetDict`` holds ``dataset_dict.json`` (its split names) and one such ``Dataset`` directory per split.
Recognising them needs no `datasets` import (about a second at every restart); opening them does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# datasets.config's DATASET_STATE_JSON_FILENAME, DATASET_INFO_FILENAME and DATASETDICT_JSON_FILENAME
STATE = "state.json"
INFO = "dataset_info.json"
DICT = "dataset_dict.json"


class SavedDatasetError(ValueError):
    """A saved dataset that cannot be used; the message names the file (the caller names the config key)."""


def is_saved_dataset(path: Path) -> bool:
    """``path`` is a directory written by ``Dataset.save_to_disk``."""
    return (path / STATE).is_file() and (path / INFO).is_file()


def is_saved_dataset_dict(path: Path) -> bool:
    """``path`` is a directory written by ``DatasetDict.save_to_disk`` (and not a saved ``Dataset``, which
    ``load_from_disk`` would read first)."""
    return (path / DICT).is_file() and not is_saved_dataset(path)


def saved_splits(path: Path) -> list[str]:
    """The split names ``path/dataset_dict.json`` lists."""
    try:
        splits = json.loads((path / DICT).read_text()).get("splits")
    except (OSError, ValueError, AttributeError) as e:
        raise SavedDatasetError(f"{str(path / DICT)!r} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise SavedDatasetError(f"{str(path / DICT)!r} has no list of split names ('splits')")
    return splits


def fingerprint(directory: Path) -> tuple:
    """(name, mtime_ns, size) of every file of a saved dataset's ``directory``, sorted: what its rows depend on."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
        return tuple((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in entries if e.is_file())
    except OSError as e:
        raise SavedDatasetError(f"cannot list {str(directory)!r}: {e.strerror}") from None


def open_saved(directory: str, split: str):
    """The memory-mapped ``datasets.Dataset`` saved at ``directory`` (``split`` of a ``DatasetDict``, or ``""``
    for a ``Dataset``), read with ``datasets.load_from_disk``; SavedDatasetError when it cannot be read."""
    import datasets

    try:
        loaded = datasets.load_from_disk(directory)
        dataset = loaded[split] if split else loaded
    except Exception as e:  # datasets raises anything from KeyError to pyarrow's ArrowInvalid on a damaged save
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise SavedDatasetError(
            f"could not read the dataset saved at {directory!r} with datasets.load_from_disk "
            f"({type(e).__name__}{': ' + reason if reason else ''})"
        ) from e
    if not isinstance(dataset, datasets.Dataset):
        raise SavedDatasetError(f"{directory!r} holds a {type(dataset).__name__}, not a Dataset")
    return dataset
