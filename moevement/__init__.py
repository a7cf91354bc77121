"""MoEvement fault tolerance: sparse checkpointing, sparse-to-dense conversion and localized recovery.

This package knows operators (named groups of tensors) and tensors, never model classes. Its
subpackages import only downward:

    recovery/    localized recovery, replay with frozen/active operators, upstream logs, restart
    checkpoint/  window planning (popularity, Algorithm 1, profile) and the sparse checkpointer
    storage/     snapshot format, host-memory buffers, replication, disk persistence
    operators.py, failures.py   the units snapshotted and frozen; failure plans
"""
