"""The exit statuses a trainer process ends with, and what its rank shell and torchrun make of each.

Imports nothing (the rank shell, which never imports torch, reads them too)."""

from __future__ import annotations

import signal

DONE = 0  # the job finished (or had nothing left for this process to do)
UNEXPECTED = 1  # a traceback: a bug, or a failure nothing here classifies (torchrun restarts every worker)
CLEAN_ERROR = 2  # one `error:` line (bad config, data, checkpoint, ...), or a peer's: torchrun restarts nobody's work
INJECTED_CRASH = 13  # `fault.crash`: the process exits at once, as a crash would
FALLBACK = 75  # leave the recovery to torchrun's restart of every worker (state kept in host memory)
STOPPED = 128 + signal.SIGTERM  # torchrun's agent (or a scheduler) stopped the process with SIGTERM

# Ends a rank shell hands straight back to torchrun: no death to replace in place.
HANDED_TO_TORCHRUN = (DONE, CLEAN_ERROR, FALLBACK, STOPPED)


def exit_status(returncode: int) -> int:
    """The exit status a rank shell hands to torchrun for a child that ended with `returncode`
    (`Popen.returncode`): its own, or 128 + the signal that killed it, as a shell reports a signal death."""
    return returncode if returncode >= 0 else 128 - returncode


def describe(returncode: int) -> str:
    """How a child with this `Popen.returncode` ended, for a `shell:` line."""
    return f"signal {signal.Signals(-returncode).name}" if returncode < 0 else f"exit status {returncode}"
