"""The one error type of the evaluation harness: its message is the whole one-line report."""


class EvalError(RuntimeError):
    """A bad checkpoint, tokenizer, task name or task data; ``python -m eval.harness`` prints
    ``error: <message>`` and exits with status 2."""
