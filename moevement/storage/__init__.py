"""Where snapshots live: their byte format and checksums, owner-only host-memory buffers, replication to
peer ranks, and optional disk persistence. Nothing here knows about windows' planning or recovery."""
