"""Where `python train.py` (or torchrun's worker) decides what this process is, before it trains:

- under torchrun with replacements allowed, a *rank shell* (`trainer/lifecycle/rank_shell.py`): it supervises the
  trainer as its child and keeps a warm standby; it never imports torch (`become_shell_if_wanted`, called
  before train.py's imports);
- a shell's *standby*: torch and the project imported, waiting to be activated as a dead trainer's
  replacement (`await_standby_activation`, called after them);
- otherwise the trainer itself.

Imports no torch.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

from trainer.lifecycle import exit_codes, rank_shell
from trainer.lifecycle.startup import STARTUP


def become_shell_if_wanted(argv: list[str]) -> None:
    """Before torch is imported: run as this slot's rank shell and exit, when `rank_shell.wanted`."""
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr: where a hung rank (or its shell) waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if rank_shell.wanted(argv):
        sys.exit(rank_shell.run_shell(argv))


def await_standby_activation() -> None:
    """Once train.py's imports are done. In a shell's standby: wait for the shell to activate it, then return
    to train as the dead trainer's rank in the generation the shell names; exit with success when the shell
    ends first. In a shell's trainer (the first, or an activated standby): start its heartbeat. In both:
    watch the shell's own beats (`rank_shell.watch_the_shell`)."""
    rank_shell.watch_the_shell()
    if os.environ.get(rank_shell.ROLE) == "standby":
        if rank_shell.await_activation() is None:
            sys.exit(exit_codes.DONE)
        STARTUP.marks.clear()  # its start-up cost was paid before the death
    rank_shell.start_heartbeat()
