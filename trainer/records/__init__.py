"""What a run leaves behind and prints: its record folder (`run_record.py`), its events as JSON lines
(`event_log.py`, the typed lines `event_lines.py`), the console lines, progress bar and TensorBoard events
(`metrics.py`, `tensorboard.py`), the ETTR bookkeeping and its `accounting` line (`accounting.py`,
`accounting_line.py`) and Algorithm 1's last window profile (`window_profile.py`). Imports the lifecycle's
lines, never the run's wiring."""
