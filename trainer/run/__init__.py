"""A run's life: start plan, rank shell, survival of real deaths, fault injection, metrics and records."""
