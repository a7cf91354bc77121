"""A warm standby's mappings of the rank directory it may take over, kept current while it waits
(docs/design/sparse-checkpointing.md, "Across generations and on a standby").

A replacement's checkpointer maps every buffer file its rank directory holds before its first window
(`host_memory.prefault_rank_dir`): the snapshots and replicas the dead trainer left. Mapping them with their
pages faulted in costs page-table work for every page, seconds for the gigabytes of a `bench_moe` rank, and
after a death that work lies on the recovery's path. A standby knows its rank before the death, so it maps
those files while it waits, on one background thread at idle CPU priority (`PrefaultWatch`); the
checkpointer it builds once activated finds the mappings kept (`mappings.KEPT`) and maps nothing again.

The trainer it stands by for may grow, replace or remove a buffer file at any time: every `every_s` seconds
the watch releases the mappings whose file changed (a stale mapping would keep a removed file's pages alive)
and maps what is new. A file the trainer writes while it is mapped here is the same shared pages, so a
mapping stays valid as long as the file keeps its identity and size.
"""

from __future__ import annotations

import threading
from pathlib import Path

from moevement.storage.background import lower_priority
from moevement.storage.host_memory import HostMemoryError, prefault_rank_dir
from moevement.storage.mappings import KEPT

EVERY_S = 5.0  # a trainer's buffers change size in its first windows only; a look costs a directory listing


class PrefaultWatch:
    """Keeps the mappings of `rank_dir`'s buffer files current on a daemon thread until `stop`.

    Thread contract: the watch's thread alone maps and releases while it runs; `stop` (the standby's main
    thread, at its activation) waits for a mapping in progress, so the checkpointer built after it never
    races the watch for a file. A rank directory that is not this user's owner-only one, or vanishes, maps
    nothing (its checkpointer says so after the activation)."""

    def __init__(self, rank_dir: Path, priority: str = "idle", every_s: float = EVERY_S) -> None:
        self.rank_dir, self.priority, self.every_s = rank_dir, priority, every_s
        self.mapped = 0  # bytes mapped so far, every look together
        self.looks = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="moevement-standby-prefault", daemon=True)
        self._thread.start()

    def refresh(self) -> int:
        """Release the stale mappings under the rank directory and map its new buffer files; the bytes mapped."""
        KEPT.drop_stale_under(self.rank_dir)
        try:
            return prefault_rank_dir(self.rank_dir)
        except (HostMemoryError, OSError):
            return 0

    def stop(self) -> None:
        """Stop looking, once the mapping in progress (if any) is done."""
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        lower_priority(self.priority)
        while not self._stopped.is_set():
            self.mapped += self.refresh()
            self.looks += 1
            self._stopped.wait(self.every_s)
