"""Whether a prepared corpus's shards hold the bytes their index names (sha256), checked before their tokens
can train twice.

Opening a split checks sizes only (`token_shards._map_shard`); the bytes are checked here. A split of at most
`VERIFY_AT_OPEN_BYTES` is hashed whole when it is opened (under a second on any CPU). A larger one is hashed
shard by shard on a background thread, starting the first time a shard is read: the reads of that batch go
on, and the next batch waits for the hash if it reads the shard again (and reports any hash already done),
so a damaged shard stops the run (one `DataError` naming it) before its tokens reach a second batch, and
the first batch never waits for a hash. A process hashes each shard once; a loader worker process (forked
or spawned) hashes what its parent had not verified.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from trainer.data.corpus import DataError

VERIFY_AT_OPEN_BYTES = 64 << 20
_HASH_CHUNK = 1 << 24


def file_sha256(path: Path) -> str:
    """The sha256 of the file at `path` (hashlib releases the GIL while it hashes each 16 MiB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class ShardCheck:
    """The sha256 check of one split's shards `files` against their index's `digests`. Called by the thread
    that reads tokens (`before_read`); the hashing runs on one background thread of this process."""

    def __init__(self, files: list[Path], digests: list[str], index_name: str, verified: frozenset[int] = frozenset()):
        self.files, self.digests, self.index_name = files, digests, index_name
        self.verified: set[int] = set(verified)
        self.pending: dict[int, tuple[Future, int]] = {}  # shard -> (its hash, the batch that started it)
        self.batch = 0  # batches begun (`next_batch`)
        self.pool: ThreadPoolExecutor | None = None
        self.pool_pid = 0  # the process that started `pool` (a forked worker starts its own)

    def all_now(self) -> None:
        """Hash every shard now (a small split at its opening)."""
        for shard in range(len(self.files)):
            if shard not in self.verified:
                self._verify(shard)
                self.verified.add(shard)

    def next_batch(self) -> None:
        """A batch begins: the hashes earlier batches started and that are done are taken in (DataError
        naming a damaged shard)."""
        self.batch += 1
        if self.pool_pid == os.getpid():
            for shard in [s for s, (future, _) in self.pending.items() if future.done()]:
                self._settle(shard)

    def before_read(self, shard: int) -> None:
        """Shard `shard` is about to be read: start its hash the first time; in a later batch than the one
        that started it, wait for it (DataError naming the shard if its bytes are not the index's)."""
        if shard in self.verified:
            return
        pending = self.pending.get(shard) if self.pool_pid == os.getpid() else None
        if pending is None:
            self.pending[shard] = (self._pool().submit(self._verify, shard), self.batch)
        elif pending[1] != self.batch:
            self._settle(shard)

    def _settle(self, shard: int) -> None:
        future, _ = self.pending.pop(shard)
        future.result()
        self.verified.add(shard)

    def _pool(self) -> ThreadPoolExecutor:
        if self.pool is None or self.pool_pid != os.getpid():  # a fork copies the pool, not its thread
            self.pool, self.pool_pid, self.pending = ThreadPoolExecutor(1, "moevement-shard-check"), os.getpid(), {}
        return self.pool

    def _verify(self, shard: int) -> None:
        path = self.files[shard]
        if file_sha256(path) != self.digests[shard]:
            raise DataError(
                f"data.dataset: shard {str(path)!r} does not match its sha256 in {self.index_name} (damaged or "
                "replaced; python -m trainer.data.prepare --verify checks every shard)"
            )
