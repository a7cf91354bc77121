"""Where `python train.py` (or torchrun's worker) decides what this process is, before it trains:

- under torchrun with replacements allowed, a *rank shell* (`trainer/lifecycle/rank_shell.py`): it supervises the
  trainer as its child and keeps a warm standby; it never imports torch (`become_shell_if_wanted`, called
  before train.py's imports);
- a shell's *standby*: once its shell says so (`await_word_to_prepare`, before the imports), torch and the
  project imported and what it can build of its rank built, waiting to be activated as a dead trainer's
  replacement (`await_standby_activation`, called after the imports);
- otherwise the trainer itself.

Imports no torch.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

from trainer.lifecycle import exit_codes, rank_shell
from trainer.lifecycle.shell_argv import ERRORS, setting
from trainer.lifecycle.startup import STARTUP

T = TypeVar("T")


def become_shell_if_wanted(argv: list[str]) -> None:
    """Before torch is imported: run as this slot's rank shell and exit, when `rank_shell.wanted`."""
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr: where a hung rank (or its shell) waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if rank_shell.wanted(argv):
        sys.exit(rank_shell.run_shell(argv))


def set_openmp_wait_policy(argv: list[str]) -> None:
    """Before torch is imported (its OpenMP runtime reads it once): `OMP_WAIT_POLICY` as config key
    `training.omp_wait_policy` says, unless the environment names one (a bad value: left to the trainer's
    own report)."""
    try:
        policy = setting(argv, "training.omp_wait_policy", str)
    except ERRORS:
        return
    if policy in ("passive", "active"):
        os.environ.setdefault("OMP_WAIT_POLICY", policy.upper())


def await_word_to_prepare() -> None:
    """Before torch is imported. In a shell's standby: wait for the shell's word to prepare (it comes once the
    slot's trainer trains, so that a standby's start-up never competes with a recovery for the cores:
    `fault.standby_prepare`); exit with success when the shell ends first. Elsewhere nothing."""
    if os.environ.get(rank_shell.ROLE) == "standby":
        rank_shell.await_word_to_prepare()


def await_standby_activation(prepare: Callable[[], T] | None = None) -> T | None:
    """Once train.py's imports are done. In a shell's standby: build what it can before its activation
    (`prepare()`, `trainer/run/prebuilt.py`), wait for the shell to activate it, then return what `prepare`
    built, to train as the dead trainer's rank in the generation the shell names; exit with success when the
    shell ends first. In a shell's trainer (the first, or an activated standby): start its heartbeat. In both:
    watch the shell's own beats (`rank_shell.watch_the_shell`). Returns None outside a standby."""
    rank_shell.watch_the_shell()
    prepared = None
    if os.environ.get(rank_shell.ROLE) == "standby":
        prepared = prepare() if prepare is not None else None
        if rank_shell.await_activation() is None:
            sys.exit(exit_codes.DONE)
        STARTUP.marks.clear()  # its start-up cost was paid before the death
    rank_shell.start_heartbeat()
    return prepared
