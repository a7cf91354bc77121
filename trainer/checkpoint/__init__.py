"""The trainer's saved state: dense checkpoints, their publication, the run identity and the state digest."""
