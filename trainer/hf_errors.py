"""The one error type of ``python -m trainer.hf``: its message is the whole one-line report."""


class HFError(RuntimeError):
    """A bad Hugging Face directory, checkpoint, tokenizer or target; one line naming the file or option.
    ``python -m trainer.hf`` prints ``error: <message>`` and exits with status 2."""
