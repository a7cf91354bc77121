"""The workers' store of a torchrun round, kept by rank 0's shell where every round's workers have a store of
their own (docs/design/lifecycle/elastic.md).

With `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (which an elastic job needs to grow back: docs/guide.md)
torchrun's workers do not use their agent's store; rank 0 hosts one for the round (`dist.rendezvous`
"env://"). Hosted by rank 0's trainer, it would die with it, and the survivors' next generation, which
meets on it, could not form: rank 0's death would go to torchrun's restart. So rank 0's rank shell starts
this process beside its children (`start_if_needed`): it hosts the store at MASTER_ADDR:MASTER_PORT until
the shell ends (it dies with it), and the shell's children connect to it as every other rank does
(`TORCHELASTIC_USE_AGENT_STORE` true in their environment, `KEPT` set so that `store_round` still names the
round as a store of its own does).

`start_if_needed` runs in the rank shell and imports no torch; `main` runs in the keeper.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

# set in the children of a shell whose keeper hosts the round's store (parallelisms.distributed.KEPT_STORE,
# in a module that imports torch)
KEPT = "MOEVEMENT_KEPT_STORE"
CHECKOUT = Path(__file__).resolve().parents[2]


def wanted(env: dict[str, str]) -> bool:
    """Whether a rank shell with this environment keeps the round's store: rank 0's, under torchrun, where the
    workers would host a store of their own (`TORCHELASTIC_USE_AGENT_STORE` false)."""
    return env.get("RANK") == "0" and env.get("TORCHELASTIC_USE_AGENT_STORE") == str(False) and "MASTER_PORT" in env


def start_if_needed(env: dict[str, str], preexec_fn) -> subprocess.Popen | None:
    """In a rank shell: start the keeper when `wanted`, and make `env` (the children's) connect to it; the
    keeper, or None. `preexec_fn` makes it die with the shell."""
    if not wanted(env):
        return None
    # run from the checkout: nothing of the project is installed, and torchrun may be launched elsewhere
    command = [sys.executable, "-m", "trainer.lifecycle.store_keeper"]
    keeper = subprocess.Popen(command, env=env, cwd=CHECKOUT, preexec_fn=preexec_fn)
    env.update({"TORCHELASTIC_USE_AGENT_STORE": str(True), KEPT: "1"})
    return keeper


def main() -> None:
    """Host the round's store until the shell ends (SIGTERM, or the shell's death)."""
    import datetime

    import torch.distributed as dist

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    while store is not None:  # it serves while referenced
        signal.pause()


if __name__ == "__main__":
    main()
