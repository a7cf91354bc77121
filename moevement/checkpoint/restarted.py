"""A restarted rank's host state (docs/design/lifecycle/start.md): the window it restarted from, and what earlier
processes of the rank left.

A restarted job keeps the window it converted as its persisted checkpoint (`adopt_window`), so that
another death before the job persists a window of its own recovers from there. Once it trains on, what
earlier processes left and this one does not hold goes (`drop_leftovers`).

Training thread only, before the first snapshot of the restarted job (`adopt_window`) and at its
first `begin` (`drop_leftovers`).
"""

from __future__ import annotations

import os
from pathlib import Path

from moevement.checkpoint.handoff import SnapshotHandoff
from moevement.checkpoint.persisted import MANIFEST
from moevement.storage.host_memory import HostBuffer
from moevement.storage.snapshot import FORMAT, SnapshotHeader
from moevement.storage.snapshot_buffers import SnapshotBuffers
from moevement.storage.snapshot_copy import Throttle, copy_entries


def adopt_window(
    buffers: SnapshotBuffers, handoff: SnapshotHandoff, window_index: int, snapshots: list[tuple[SnapshotHeader, dict]]
) -> None:
    """Write a rank's `snapshots` (header, {(role, name): tensor}, in slot order) into its buffers as window
    `window_index` and commit them like a window just taken (collective: every rank adopts together). On
    return the window is persisted everywhere; it is not written to disk again."""
    handoff.adopted = window_index
    for header, tensors in snapshots:
        buffer = buffers.buffer(window_index % 2, header.slot)
        buffer.invalidate()
        data = buffer.ensure(max(header.nbytes, 1))
        sources = [tensors[(e.role, e.name)] for e in header.entries]
        header.checksums = copy_entries(data, header.entries, sources, Throttle(), chunk_bytes=buffers.chunk_bytes)
        header.checksum_format = FORMAT  # copy_entries' XXH3, whatever the snapshot it came from carried
        handoff.commit(window_index, header.commit_record(), buffer, header.slot == len(snapshots) - 1)
    handoff.drain()


def drop_leftovers(rank_dir: Path, held: list[HostBuffer], keep_manifest: bool) -> None:
    """Remove from `rank_dir` what earlier processes of this rank left and this process does not hold (its
    `held` buffers, and its manifest if `keep_manifest`): commit records (a live state, snapshots,
    replicas) and temporary files.

    Their buffers' bytes (`.bin`) stay as spare pages: a buffer of the same name reuses them
    (`HostBuffer.ensure`), which spares a restarted process faulting in gigabytes of fresh memory;
    without a commit record nothing reads them, and closing the checkpointer removes them with the directory."""
    keep = {buf.header_path for buf in held}
    if keep_manifest:
        keep.add(rank_dir / MANIFEST)
    for directory, _, files in os.walk(rank_dir):
        for name in files:
            path = Path(directory, name)
            if path not in keep and path.suffix != ".bin":
                path.unlink(missing_ok=True)
