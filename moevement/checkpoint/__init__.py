"""Sparse checkpointing: which operators each iteration snapshots (popularity order, Algorithm 1, the
profile that feeds it) and the checkpointer the training loop drives.

"Window" names one thing, the W consecutive iterations whose snapshots make one sparse checkpoint; its parts
are named apart throughout moevement/:

    window_size     W, an int (`WindowPlan.window_size`, `RestartPoint.window_size`, ...)
    cfg.window      the configured W (`checkpoint.window`; 0: Algorithm 1 chooses it each window)
    WindowSpan      a window's iterations `[start, start + size)` (`PersistedCheckpoint.span`)
    CurrentWindow   the window being taken: its plan, layouts and buffers (`SparseCheckpointer.current_window`)
    window_index    a window's number (its parity picks its buffers)

A snapshot header's `window` field is W too: the key every header on disk carries (`SnapshotHeader`).
"""
