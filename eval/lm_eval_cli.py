"""``moevement-lm-eval``: lm-eval's own command line, with the ``moevement`` model registered.

lm-eval has no plugin discovery, so ``lm_eval --model moevement`` cannot find a model defined outside
lm-eval; this command is ``lm_eval`` after importing :mod:`eval.model`. Every ``lm_eval`` argument
works the same, for example::

    moevement-lm-eval --model moevement --model_args checkpoint=DIR --tasks piqa --batch_size 32
    moevement-lm-eval --model hf --model_args pretrained=EXPORTED_DIR --tasks piqa   # lm-eval's own model

(``python -m eval.lm_eval_cli`` is the same without the installed script.)
"""

import sys


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    import eval.model  # noqa: F401  (registers "moevement")

    sys.argv[0] = "moevement-lm-eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
