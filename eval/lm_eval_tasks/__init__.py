"""lm-eval task files (``*.yaml``) over local data, for ``lm_eval --include_path eval/lm_eval_tasks``,
``moevement-lm-eval`` and ``python -m eval.harness`` alike; ``local_data.py`` reads their data."""
