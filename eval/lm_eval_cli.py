"""``moevement-lm-eval``: lm-eval's own command line, with the ``moevement`` model registered and the
project's task files (``eval/lm_eval_tasks/``: ``piqa_local``, ``hellaswag_local``) included.

lm-eval has no plugin discovery, so ``lm_eval --model moevement`` cannot find a model defined outside
lm-eval; this command is ``lm_eval`` after importing :mod:`eval.model`, with ``--include_path
eval/lm_eval_tasks`` added when no ``--include_path`` is given. Every ``lm_eval`` argument works the same,
for example::

    moevement-lm-eval --model moevement --model_args checkpoint=DIR --tasks piqa_local --batch_size 32
    moevement-lm-eval --model hf --model_args pretrained=EXPORTED_DIR --tasks piqa_local   # lm-eval's own model

A named local task whose data is missing is one line ``error: <task>: ...`` on stderr; the other tasks
still run and print, and the exit status is then 2. When every named task is local, nothing is looked up
on the Hugging Face hub (``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` unless set).
(``python -m eval.lm_eval_cli`` is the same without the installed script.)
"""

from __future__ import annotations

import os
import sys

TASK_FLAGS = ("--tasks", "-t")


def split_tasks(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(argv without its task list, the task names in order)``; lm-eval takes ``--tasks a,b``,
    ``--tasks a b``, ``-t a`` and ``--tasks=a,b``."""
    rest, names = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in TASK_FLAGS and eq:
            names += [t for t in value.split(",") if t]
        elif arg in TASK_FLAGS:
            while i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                i += 1
                names += [t for t in argv[i].split(",") if t]
        else:
            rest.append(arg)
        i += 1
    return rest, names


def with_tasks(rest: list[str], names: list[str]) -> list[str]:
    return [*rest, "--tasks", ",".join(names)] if names else rest


def main() -> None:
    from eval.tasks import TASK_DIR, TASKS, load_tasks

    rest, names = split_tasks(sys.argv[1:])
    local = [n for n in names if n in TASKS]
    if names and len(local) == len(names):
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _, errors = load_tasks(local) if local else ({}, {})
    for e in errors.values():
        print(f"error: {e}", file=sys.stderr, flush=True)
    if names and len(errors) == len(names):
        sys.exit(2)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in rest):
        rest += ["--include_path", str(TASK_DIR)]

    from lm_eval.__main__ import cli_evaluate

    import eval.model  # noqa: F401  (registers "moevement")

    sys.argv = ["moevement-lm-eval", *with_tasks(rest, [n for n in names if n not in errors])]
    cli_evaluate()
    if errors:
        sys.exit(2)


if __name__ == "__main__":
    main()
