"""The evaluation tasks: the lm-eval task files of ``eval/lm_eval_tasks/`` (``piqa_local``,
``hellaswag_local``), the one definition that ``lm_eval --include_path``, ``moevement-lm-eval`` and
``python -m eval.harness`` all load. Their data is local (``eval/lm_eval_tasks/local_data.py``).

:func:`load_tasks` builds the ``Task`` objects one by one, so that a task whose data is missing is one
line of :class:`~eval.errors.EvalError` while the others load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eval.errors import EvalError
from eval.lm_eval_tasks.local_data import RAISE_KEY, TASK_DIR, task_line

TASKS = tuple(sorted(p.stem for p in TASK_DIR.glob("*.yaml")))


class _QuietCustomDataset(logging.Filter):
    """lm-eval warns about ``--metadata`` for every task with a ``custom_dataset``: not ours to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


logging.getLogger("lm_eval.api.task").addFilter(_QuietCustomDataset())


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


def load_tasks(
    names: list[str], *, piqa_dir: str | Path | None = None, hellaswag_file: str | Path | None = None
) -> tuple[dict[str, Any], dict[str, EvalError]]:
    """``({name: lm_eval Task}, {name: EvalError})``: the tasks whose data loaded, and one-line errors for the
    others. ``piqa_dir`` / ``hellaswag_file`` override the environment and defaults of ``local_data``."""
    from lm_eval.tasks import TaskManager

    metadata = {k: str(v) for k, v in (("piqa_dir", piqa_dir), ("hellaswag_file", hellaswag_file)) if v}
    metadata[RAISE_KEY] = True  # a task's missing data is an error to report here, not the process's exit
    # include_defaults=False: indexing lm-eval's ~10k bundled YAMLs takes ~20 s
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False, metadata=metadata)
    tasks, errors = {}, {}
    for name in names:
        try:
            tasks[name] = manager.load([name])["tasks"][name]
        except Exception as e:  # LocalDataError (one line by contract) or a datasets error: name the task
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            errors[name] = EvalError(task_line(name, msg))
    return tasks, errors
