"""ETTR of checkpointing strategies under failures: the paper's evaluation (`--paper-tables`) and an exploratory
per-GPU model (`python -m simulator`, docs/simulator.md)."""
