"""A run's wiring, estimates and records: the strategy factory, memory estimates, fault injection, metrics, event
records and accounting (a process's life around a death is `trainer/lifecycle/`)."""
