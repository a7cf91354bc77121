"""ETTR of checkpointing strategies under failures at cluster scale (`python -m simulator`, docs/simulator.md)."""
