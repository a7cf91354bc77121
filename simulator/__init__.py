"""ETTR of checkpointing strategies under failures: one calibrated model (`simulator.model`) behind every
command of `python -m simulator` (docs/simulator.md)."""
