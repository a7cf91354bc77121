"""A run's wiring: the checkpoint strategy built for this rank (`strategy_factory.py`, from the facts
`start_facts.py` gathers of where its state comes from), the rank's host directories and their lock
(`host_paths.py`), what a warm standby builds before its activation (`prebuilt.py`) and `fault.kill`'s
injected deaths (`fault_injection.py`). A run's estimates are `trainer/estimates/`, its records
`trainer/records/`, a process's life around a death `trainer/lifecycle/`."""
