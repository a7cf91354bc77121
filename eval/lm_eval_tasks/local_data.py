"""The local data of the lm-eval task files beside this module (``custom_dataset: !function local_data.*``).

lm-eval imports this file by its path when it builds a task, so it imports nothing of the project. Where
the data is (the first that is set wins):

* ``piqa_local``: task metadata ``piqa_dir`` (``python -m eval.harness --piqa-dir``), the environment
  variable ``MOEVEMENT_PIQA_DIR``, else ``../shared/data/piqa`` beside the checkout. The directory holds
  PIQA's ``valid.jsonl`` (``goal``, ``sol1``, ``sol2``) and the line-aligned ``valid-labels.lst``.
* ``hellaswag_local``: task metadata ``hellaswag_file`` (``--hellaswag-file``), else the environment
  variable ``MOEVEMENT_HELLASWAG_FILE``: a JSONL in the original HellaSwag format. No default.

HellaSwag's validation split in that format is ``hellaswag_val.jsonl`` of the HellaSwag authors' repository
(:data:`HELLASWAG_SOURCE`): download it once, anywhere, and name it.

Missing or malformed data is one line naming the file and the task file (never a traceback): the project's
loaders (``eval.tasks.load_tasks``, behind ``eval.harness`` and ``moevement-lm-eval``) pass the metadata key
:data:`RAISE_KEY` and get a :class:`LocalDataError` to report; lm-eval's own command line (``lm_eval
--include_path eval/lm_eval_tasks``) passes no such key, and the line is printed as ``error: ...`` on stderr
before the process exits with status 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PIQA_DIR_ENV = "MOEVEMENT_PIQA_DIR"
HELLASWAG_FILE_ENV = "MOEVEMENT_HELLASWAG_FILE"
# ../shared/data/piqa beside the checkout (.parent, unlike .parents[n], never fails for a copy near "/")
DEFAULT_PIQA_DIR = Path(__file__).resolve().parent.parent.parent.parent / "shared" / "data" / "piqa"
PIQA_DATA, PIQA_LABELS = "valid.jsonl", "valid-labels.lst"
HELLASWAG_FIELDS = ("ctx_a", "ctx_b", "activity_label", "endings", "label")
HELLASWAG_SOURCE = "https://github.com/rowanz/hellaswag/raw/master/data/hellaswag_val.jsonl"
TASK_DIR = Path(__file__).resolve().parent
RAISE_KEY = "raise_data_errors"  # task metadata of the project's loaders: raise LocalDataError, do not exit


class LocalDataError(ValueError):
    """Missing or malformed task data; the message is the whole one-line report."""


def piqa_dir(piqa_dir: str | Path | None = None) -> Path:
    """Where the PIQA files are: ``piqa_dir``, else ``$MOEVEMENT_PIQA_DIR``, else ``../shared/data/piqa``."""
    return Path(piqa_dir or os.environ.get(PIQA_DIR_ENV) or DEFAULT_PIQA_DIR)


def hellaswag_file(hellaswag_file: str | Path | None = None) -> Path:
    """The HellaSwag JSONL: ``hellaswag_file``, else ``$MOEVEMENT_HELLASWAG_FILE``."""
    file = hellaswag_file or os.environ.get(HELLASWAG_FILE_ENV)
    if not file:
        raise LocalDataError(
            f"no HellaSwag file: set {HELLASWAG_FILE_ENV}=FILE (or eval.harness --hellaswag-file FILE), "
            f"a JSONL in the original HellaSwag format ({', '.join(HELLASWAG_FIELDS)}), e.g. {HELLASWAG_SOURCE}"
        )
    return Path(file)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise LocalDataError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise LocalDataError(f"{path}:{n}: expected a JSON object")
            rows.append(row)
    return rows


def piqa_docs(data_dir: str | Path | None = None) -> list[dict]:
    """The PIQA validation items (``goal``, ``sol1``, ``sol2``) with their ``label`` (0 or 1)."""
    data_dir = piqa_dir(data_dir)
    data, labels_file = data_dir / PIQA_DATA, data_dir / PIQA_LABELS
    for f in (data, labels_file):
        if not f.is_file():
            raise LocalDataError(
                f"data file {str(f)!r} not found (need {PIQA_DATA} and {PIQA_LABELS} in {str(data_dir)!r}; "
                f"set {PIQA_DIR_ENV}=DIR or eval.harness --piqa-dir DIR)"
            )
    rows = _read_jsonl(data)
    labels = [line.strip() for line in labels_file.read_text().splitlines() if line.strip()]
    if len(labels) != len(rows):
        raise LocalDataError(f"{data} has {len(rows)} items but {labels_file} has {len(labels)} labels")
    for n, (row, label) in enumerate(zip(rows, labels), 1):
        if label not in ("0", "1"):
            raise LocalDataError(f"{labels_file}:{n}: label {label!r} is not 0 or 1")
        missing = [k for k in ("goal", "sol1", "sol2") if not isinstance(row.get(k), str)]
        if missing:
            raise LocalDataError(f"{data}:{n}: missing text field(s) {missing}")
        row["label"] = int(label)
    return rows


def hellaswag_docs(file: str | Path | None = None) -> list[dict]:
    """The items of a local HellaSwag-format JSONL, checked (``label`` as an int)."""
    path = hellaswag_file(file)
    if not path.is_file():
        raise LocalDataError(f"HellaSwag file {str(path)!r} not found")
    rows = _read_jsonl(path)
    if not rows:
        raise LocalDataError(f"{path} holds no items")
    for n, row in enumerate(rows, 1):
        missing = [k for k in HELLASWAG_FIELDS if k not in row]
        if missing:
            raise LocalDataError(
                f"{path}:{n}: missing field(s) {missing} (the original HellaSwag format has "
                f"{', '.join(HELLASWAG_FIELDS)})"
            )
        endings = row["endings"]
        if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
            raise LocalDataError(f"{path}:{n}: 'endings' must be a list of at least 2 strings")
        try:
            label = int(row["label"])
        except (TypeError, ValueError):
            raise LocalDataError(f"{path}:{n}: label {row['label']!r} is not an integer") from None
        if not 0 <= label < len(endings):
            raise LocalDataError(f"{path}:{n}: label {label} out of range for {len(endings)} endings")
        row["label"] = label
    return rows


def _validation_split(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)})


def task_line(task: str, message: str) -> str:
    """The one-line report of ``task``'s data, naming the project's task file."""
    return f"{task} ({TASK_DIR / task}.yaml): {message}"


def _dataset(task: str, read_rows, metadata: dict):
    """The ``validation`` split of ``read_rows()``; a :class:`LocalDataError` raised for the project's loaders
    (metadata :data:`RAISE_KEY`), else (lm-eval's own command line) one line on stderr and exit status 2."""
    try:
        return _validation_split(read_rows())
    except LocalDataError as e:
        if metadata.get(RAISE_KEY):
            raise
        print(f"error: {task_line(task, str(e))}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def piqa_dataset(piqa_dir: str | Path | None = None, **metadata):
    """``custom_dataset`` of ``piqa_local``: lm-eval passes the task's metadata as keyword arguments."""
    return _dataset("piqa_local", lambda: piqa_docs(piqa_dir), metadata)


def hellaswag_dataset(hellaswag_file: str | Path | None = None, **metadata):
    """``custom_dataset`` of ``hellaswag_local``: lm-eval passes the task's metadata as keyword arguments."""
    return _dataset("hellaswag_local", lambda: hellaswag_docs(hellaswag_file), metadata)
