"""Sparse checkpointing: which operators each iteration snapshots (popularity order, Algorithm 1, the
profile that feeds it) and the checkpointer the training loop drives."""
