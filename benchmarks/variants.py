"""Strategy variants on the benchmarks' command lines: `moevement@checkpoint.background_priority=normal`.

A variant is a strategy with settings of its own (`@section.key=value`, repeatable), so that two
settings of one strategy are compared in the same invocation, interleaved, under the same noise.
Also what every benchmark run shares: its quiet flags. (Its recovery lines are read from the run record:
`trainer.records.event_log.run_events`.)
"""

from __future__ import annotations

import sys

# What every benchmark run shares: a line every step, no TensorBoard, progress bar or validation.
QUIET = [
    "--metrics.tensorboard",
    "false",
    "--metrics.log_every",
    "1",
    "--training.val_every",
    "0",
    "--metrics.progress",
    "false",
]


def variant_flags(spec: str) -> tuple[str, list[str]]:
    """(strategy, its own `--section.key value` flags) of `strategy[@section.key=value ...]`."""
    strategy, *settings = spec.split("@")
    flags = []
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or "." not in key:
            sys.exit(f"variant {spec!r}: expected @section.key=value, got @{setting}")
        flags += [f"--{key}", value]
    return strategy, flags
