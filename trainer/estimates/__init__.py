"""What a config and launch layout will cost before anything is allocated (no process group; the meta device
and arithmetic): a rank's accelerator memory (`memory_estimate.py`, from its training state
`training_state_bytes.py`, a micro-batch's activations `activation_estimate.py` and how many are alive at once
`pipeline_peak.py`), its host memory (`host_estimate.py`), the replicas' placement under node losses
(`placement_report.py`), the dry run's memory lines (`memory_report.py`) and the check at a run's start that
the estimated peak fits the device (`memory_check.py`). Imports the run's wiring, never the reverse."""
