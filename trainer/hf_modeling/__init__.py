"""The ``transformers`` modeling code ``python -m trainer.hf export`` ships beside the weights of a family
that ``transformers`` does not define (``auto_map`` in ``config.json``, loaded with ``trust_remote_code=True``).

The files are self-contained (only ``torch`` and ``transformers``): they are copied as they are into the
export directory and never imported by the trainer.
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).parent
# family -> the files of this directory an export of that family holds
REMOTE_CODE = {"deepseek": ("configuration_deepseek.py", "modeling_deepseek.py")}


def remote_code_files(family: str) -> list[Path]:
    """The modeling files an export of ``family`` ships (none for a family ``transformers`` defines)."""
    return [DIRECTORY / name for name in REMOTE_CODE.get(family, ())]
