"""What a rank shell reads of `train.py`'s command line and config file: before torch, and without the
trainer's config classes (the trainer checks every value again, and reports a bad one itself).

A key is read as the trainer reads it: the last `--section.name VALUE` or `--section.name=VALUE` on the
command line, else `[section] name` in the `--config` file, else the trainer's default (`DEFAULTS`, held equal to
`trainer/config.py`'s by a test).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULTS: dict[str, object] = {
    "checkpoint.strategy": "none",
    "fault.max_replacements": 4,
    "fault.timeout_s": 600.0,
    "fault.heartbeat_timeout_s": 30.0,
    "fault.standby_prepare": "when_training",
    "training.omp_wait_policy": "default",
}
ERRORS = (OSError, TypeError, ValueError, AttributeError, tomllib.TOMLDecodeError)  # what a bad value raises


def setting(argv: list[str], key: str, cast: Callable[[object], T]) -> T:
    """`key` ("section.name", one of `DEFAULTS`) as the command line `argv` and its config file name it,
    cast with `cast` (one of `ERRORS` if it cannot be read)."""
    given = None  # the last one counts, as in the trainer's overrides
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{key}="):
            given = arg.split("=", 1)[1]
        elif arg == f"--{key}" and i + 1 < len(argv):
            given = argv[i + 1]
    if given is not None:
        return cast(given)
    path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    if path is None:
        return cast(DEFAULTS[key])
    section, name = key.split(".")
    with open(path, "rb") as f:
        return cast(tomllib.load(f).get(section, {}).get(name, DEFAULTS[key]))
