"""Section 7: who holds the GIL while MoEvement snapshots every iteration on the GPU (py-spy).

A launch-bound training thread takes the GIL back at every kernel launch, so snapshot work on any other
thread makes it wait (docs/design/sparse-checkpointing.md, "A GPU's copy"). One `bench_moe` run as in section 2 is
sampled by `py-spy record --gil --threads` (a sample is taken of the thread holding the GIL). Of the samples taken
while iterations run (stacks through `train.py`'s `iteration`, or any other thread's), those in snapshot
frames (`moevement/checkpoint/`, `moevement/storage/`) are counted per thread. The check: no thread but the
training thread holds the GIL for snapshot work (at most `OTHER_SHARE` of the iterations' samples: a stray
sample of a background thread). The training thread's own snapshot share is printed. SKIP without py-spy
(the lent machines' image has none: carry its wheel, `pip download py-spy`, and put it on PATH).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.gpu_check.overhead import CONFIG, SHAPE, STEPS
from benchmarks.gpu_check.report import Check, Section
from benchmarks.gpu_check.runs import ROOT, Workspace

RATE_HZ = 200
OTHER_SHARE = 0.01
HOTSPOTS = 8
RUN_TIMEOUT_S = 90
SNAPSHOT_FRAMES = ("moevement/checkpoint/", "moevement/storage/")
ITERATION_FRAME = "iteration (train.py"


def gil_shares(raw: str) -> tuple[Counter, Counter]:
    """Samples of py-spy's raw output (`thread (<id>)[: <name>];frame;...;frame <count>` per line; py-spy does
    not always find a thread's name, so threads are told apart by id) by kind: `iterations` (the training
    thread, the one that runs `iteration`, inside it; any other thread), `training_snapshot` and
    `other_snapshot` (of those, in snapshot frames), `other` (other threads' samples). Second, the training
    thread's snapshot samples by their innermost snapshot frame (`function (file:line)`): where its share goes."""
    samples = []
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            frames = stack.split(";")
            samples.append((frames[0].partition(")")[0], frames, int(count)))
    training = {tid for tid, frames, _ in samples if any(f.startswith(ITERATION_FRAME) for f in frames)}
    counts: Counter = Counter()
    hotspots: Counter = Counter()
    for tid, frames, n in samples:
        mine = tid in training
        if mine and not any(f.startswith(ITERATION_FRAME) for f in frames):
            continue  # start-up, digest, exit
        counts["iterations"] += n
        counts["other"] += 0 if mine else n
        snapshot = [f for f in frames if any(s in f for s in SNAPSHOT_FRAMES)]
        if snapshot:
            counts["training_snapshot" if mine else "other_snapshot"] += n
            hotspots[snapshot[-1]] += n if mine else 0
    return counts, +hotspots


def run(section: Section) -> None:
    spy = shutil.which("py-spy")
    if spy is None:
        section.skipped = "py-spy is not installed (carry its wheel: pip download py-spy, and put it on PATH)"
        return
    workspace = Workspace()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            raw = Path(scratch) / "gil.raw"
            args = ["--config", CONFIG, *workspace.common("gpu_check_gil"), *SHAPE, "--training.steps", str(STEPS)]
            cmd = [spy, "record", "--gil", "--threads", "--nonblocking", "--rate", str(RATE_HZ), "--format", "raw"]
            cmd += ["-o", str(raw), "--", sys.executable, "train.py", *args, "--checkpoint.strategy", "moevement"]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
            if proc.returncode != 0 or not raw.exists():
                raise RuntimeError(f"py-spy record exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
            counts, hotspots = gil_shares(raw.read_text())
    finally:
        workspace.close()
    total = max(counts["iterations"], 1)
    section.notes.append(
        f"gil_samples iterations={counts['iterations']} training_snapshot={counts['training_snapshot']} "
        f"({counts['training_snapshot'] / total:.3f}) other_threads={counts['other']} "
        f"other_snapshot={counts['other_snapshot']} at {RATE_HZ} Hz"
    )
    top = ", ".join(f"{frame} {n}" for frame, n in hotspots.most_common(HOTSPOTS))
    section.notes.append(f"training-thread snapshot samples by innermost snapshot frame: {top or 'none'}")
    share = counts["other_snapshot"] / total
    detail = f"{counts['other_snapshot']} of {counts['iterations']} samples ({share:.3f} <= {OTHER_SHARE})"
    section.checks.append(Check("no other thread holds the GIL for snapshot work", share <= OTHER_SHARE, detail))
