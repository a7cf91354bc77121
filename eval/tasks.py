"""The evaluation tasks as lm-eval task configs (dicts): PIQA and HellaSwag.

* ``piqa``: lm-eval 0.4.13's ``piqa`` task (``lm_eval/tasks/piqa/piqa.yaml``: prompt
  ``"Question: {{goal}}\\nAnswer:"``, choices ``[sol1, sol2]``, target ``label``, metrics ``acc``
  and ``acc_norm``) over the local validation split ``../shared/data/piqa`` (``valid.jsonl`` +
  the line-aligned ``valid-labels.lst``, merged here into a ``label`` field), read into memory;
  nothing is downloaded.
* ``hellaswag``: lm-eval's own ``hellaswag`` task (``Rowan/hellaswag`` from the Hugging Face hub)
  when no file is given; with a file, the same task over a local JSONL in the original
  HellaSwag format (``ctx_a``, ``ctx_b``, ``activity_label``, ``endings``, ``label``), with
  lm-eval's own preprocessing (``lm_eval.tasks.hellaswag.utils.process_docs``).

Each config is a dict for ``lm_eval.tasks.TaskManager.load``; :func:`load_tasks` builds the
``Task`` objects and turns failures into one-line :class:`~eval.errors.EvalError` messages.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from eval.errors import EvalError
from trainer.tokenizer import REPO_ROOT

TASKS = ("piqa", "hellaswag")
DEFAULT_PIQA_DIR = REPO_ROOT.parent / "shared" / "data" / "piqa"
PIQA_DATA, PIQA_LABELS = "valid.jsonl", "valid-labels.lst"
HELLASWAG_FIELDS = ("ctx_a", "ctx_b", "activity_label", "endings", "label")

# lm-eval 0.4.13, lm_eval/tasks/piqa/piqa.yaml (dataset fields replaced below).
PIQA_TASK: dict[str, Any] = {
    "task": "piqa",
    "output_type": "multiple_choice",
    "doc_to_text": "Question: {{goal}}\nAnswer:",
    "doc_to_target": "label",
    "doc_to_choice": "{{[sol1, sol2]}}",
    "should_decontaminate": True,
    "doc_to_decontamination_query": "goal",
    "metric_list": [
        {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
    ],
    "metadata": {"version": 1.0},
}

# lm-eval 0.4.13, lm_eval/tasks/hellaswag/hellaswag.yaml (process_docs: its utils.process_docs).
HELLASWAG_TASK: dict[str, Any] = {
    "task": "hellaswag",
    "dataset_path": "Rowan/hellaswag",
    "dataset_name": None,
    "output_type": "multiple_choice",
    "training_split": "train",
    "validation_split": "validation",
    "test_split": None,
    "doc_to_text": "{{query}}",
    "doc_to_target": "{{label}}",
    "doc_to_choice": "choices",
    "metric_list": [
        {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
    ],
    "metadata": {"version": 1.0},
}


class _QuietCustomDataset(logging.Filter):
    """lm-eval warns about ``--metadata`` for every task with a ``custom_dataset``: not ours to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


logging.getLogger("lm_eval.api.task").addFilter(_QuietCustomDataset())


def _read_jsonl(path: Path, what: str) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalError(f"{what}: {path}:{n}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise EvalError(f"{what}: {path}:{n}: expected a JSON object")
            rows.append(row)
    return rows


def piqa_docs(data_dir: str | Path = DEFAULT_PIQA_DIR) -> list[dict]:
    """The PIQA validation items (``goal``, ``sol1``, ``sol2``) with their ``label`` (0 or 1)."""
    data_dir = Path(data_dir)
    data, labels_file = data_dir / PIQA_DATA, data_dir / PIQA_LABELS
    for f in (data, labels_file):
        if not f.is_file():
            raise EvalError(
                f"piqa: data file {str(f)!r} not found (need {PIQA_DATA} and {PIQA_LABELS} "
                f"in {str(data_dir)!r}; see ../shared/data/README.md, or pass --piqa-dir)"
            )
    rows = _read_jsonl(data, "piqa")
    labels = [line.strip() for line in labels_file.read_text().splitlines() if line.strip()]
    if len(labels) != len(rows):
        raise EvalError(f"piqa: {data} has {len(rows)} items but {labels_file} has {len(labels)} labels")
    for n, (row, label) in enumerate(zip(rows, labels), 1):
        if label not in ("0", "1"):
            raise EvalError(f"piqa: {labels_file}:{n}: label {label!r} is not 0 or 1")
        missing = [k for k in ("goal", "sol1", "sol2") if not isinstance(row.get(k), str)]
        if missing:
            raise EvalError(f"piqa: {data}:{n}: missing text field(s) {missing}")
        row["label"] = int(label)
    return rows


def hellaswag_docs(file: str | Path) -> list[dict]:
    """The items of a local HellaSwag-format JSONL, checked (``label`` as an int)."""
    path = Path(file)
    if not path.is_file():
        raise EvalError(f"hellaswag: file {str(path)!r} not found")
    rows = _read_jsonl(path, "hellaswag")
    if not rows:
        raise EvalError(f"hellaswag: {path} holds no items")
    for n, row in enumerate(rows, 1):
        missing = [k for k in HELLASWAG_FIELDS if k not in row]
        if missing:
            raise EvalError(
                f"hellaswag: {path}:{n}: missing field(s) {missing} "
                f"(the original HellaSwag format has {', '.join(HELLASWAG_FIELDS)})"
            )
        endings = row["endings"]
        if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
            raise EvalError(f"hellaswag: {path}:{n}: 'endings' must be a list of at least 2 strings")
        try:
            label = int(row["label"])
        except (TypeError, ValueError):
            raise EvalError(f"hellaswag: {path}:{n}: label {row['label']!r} is not an integer") from None
        if not 0 <= label < len(endings):
            raise EvalError(f"hellaswag: {path}:{n}: label {label} out of range for {len(endings)} endings")
        row["label"] = label
    return rows


def _in_memory_split(load, source: str, **_lm_eval_kwargs):
    """``custom_dataset`` hook: lm-eval calls it with the task's metadata as keyword arguments."""
    import datasets

    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(load(source))})


def piqa_config(data_dir: str | Path = DEFAULT_PIQA_DIR) -> dict[str, Any]:
    """lm-eval's ``piqa`` task over the local validation split (zero-shot: no training split)."""
    data_dir = Path(data_dir).resolve()
    piqa_docs(data_dir)  # fail early, with one line, on missing or malformed data
    return {
        **PIQA_TASK,
        "custom_dataset": functools.partial(_in_memory_split, piqa_docs, str(data_dir)),
        "training_split": None,
        "validation_split": "validation",
        "test_split": None,
        "metadata": {**PIQA_TASK["metadata"], "data": str(data_dir)},
    }


def hellaswag_config(file: str | Path | None = None) -> dict[str, Any]:
    """lm-eval's ``hellaswag`` task: from the hub (``file=None``) or over a local JSONL."""
    from lm_eval.tasks.hellaswag.utils import process_docs

    if file is None:
        return {**HELLASWAG_TASK, "process_docs": process_docs}
    path = Path(file).resolve()
    hellaswag_docs(path)
    return {
        **HELLASWAG_TASK,
        "process_docs": process_docs,
        "dataset_path": None,
        "custom_dataset": functools.partial(_in_memory_split, hellaswag_docs, str(path)),
        "training_split": None,
        "metadata": {**HELLASWAG_TASK["metadata"], "data": str(path)},
    }


def parse_task_names(spec: str) -> list[str]:
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise EvalError(f"--tasks: no task named (allowed: {', '.join(TASKS)})")
    for name in names:
        if name not in TASKS:
            raise EvalError(f"--tasks: unknown task {name!r} (allowed: {', '.join(TASKS)})")
    if len(set(names)) != len(names):
        raise EvalError(f"--tasks: a task is named twice in {spec!r}")
    return names


def task_config(
    name: str, *, piqa_dir: str | Path = DEFAULT_PIQA_DIR, hellaswag_file: str | Path | None = None
) -> dict[str, Any]:
    if name == "piqa":
        return piqa_config(piqa_dir)
    if name == "hellaswag":
        return hellaswag_config(hellaswag_file)
    raise EvalError(f"unknown task {name!r} (allowed: {', '.join(TASKS)})")


def load_tasks(
    names: list[str], *, piqa_dir: str | Path = DEFAULT_PIQA_DIR, hellaswag_file: str | Path | None = None
) -> dict[str, Any]:
    """``{name: lm_eval Task}``, data loaded; one-line :class:`EvalError` on failure."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_defaults=False)  # indexing lm-eval's ~10k bundled YAMLs takes ~20 s
    tasks = {}
    for name in names:
        cfg = task_config(name, piqa_dir=piqa_dir, hellaswag_file=hellaswag_file)
        try:
            loaded = manager.load([cfg])["tasks"]
        except EvalError:
            raise
        except Exception as e:  # datasets / hub errors: name the task and the way out
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            hint = ""
            if name == "hellaswag" and hellaswag_file is None:
                hint = (
                    f"; without access to {HELLASWAG_TASK['dataset_path']} on the Hugging Face hub, pass "
                    f"--hellaswag-file FILE (a local JSONL in the original HellaSwag format)"
                )
            raise EvalError(f"{name}: cannot load the task ({type(e).__name__}: {msg}){hint}") from e
        tasks[name] = loaded[name]
    return tasks
