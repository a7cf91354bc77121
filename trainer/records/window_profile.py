"""`metrics.profile FILE`: what MoEvement's Algorithm 1 last planned a window with on rank 0, written at
the end of the run as the JSON `python -m simulator --window-profile FILE` reads (`simulator/profile.py`):

    {"iteration_s": ..., "fp32_bytes": [...], "compute_bytes": [...], "copy_gbs": ..., "nic_gbps": null,
     "replicas": ..., "window": ...}

`copy_gbs` is the copy bandwidth the trainer measured (GB/s); `nic_gbps` is null (a measured profile of
one node: the copy bandwidth alone bounds a snapshot); `window` is the W the trainer used, to compare
with the simulator's. Written atomically, never through a symlink.
"""

from __future__ import annotations

import json
from pathlib import Path

from moevement.checkpoint.planner import WindowInputs
from trainer.atomic_write import write_atomically


def profile_record(inputs: WindowInputs, replicas: int) -> dict:
    """The JSON object of `inputs` (`replicas`: `checkpoint.replicas`)."""
    return {
        "iteration_s": inputs.iteration_s,
        "fp32_bytes": list(inputs.fp32_bytes),
        "compute_bytes": list(inputs.compute_bytes),
        "copy_gbs": inputs.bandwidth / 1e9,
        "nic_gbps": None,
        "replicas": replicas,
        "window": inputs.window_size,
    }


def write_window_profile(path: str, inputs: WindowInputs | None, replicas: int) -> str:
    """Write the profile to `path`; the line to print (what was written, or why nothing was)."""
    if inputs is None:
        return f"metrics.profile: no window was planned by Algorithm 1 (a fixed checkpoint.window?); {path} not written"
    target = Path(path)
    if target.is_symlink():
        return f"metrics.profile: {path} is a symlink; refused, not written"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(target, json.dumps(profile_record(inputs, replicas), indent=1) + "\n")
    except OSError as e:
        return f"metrics.profile: cannot write {path} ({e.strerror or e})"
    operators = len(inputs.fp32_bytes)
    return (
        f"metrics.profile: wrote {path} (T={inputs.iteration_s:.3f} s, W={inputs.window_size}, {operators} operators)"
    )
