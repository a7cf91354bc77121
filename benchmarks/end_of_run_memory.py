"""Peak host memory per rank at the end of a run: the state digest and the dense save, before and after.

    python -m benchmarks.end_of_run_memory [--config train_configs/bench_moe.toml] [--steps 1] [--rounds 1]
        [--layouts pp2,dp2]

Each round, for each layout, runs two real torchrun jobs of two gloo processes, alternating the variants:

- `before`: the end of run this trainer used to have, kept here only to compare against: every rank
  assembles its whole state (`named_training_state`), `gather_object` pickles it to rank 0, which digests
  the consolidated dict and, holding it, writes it as one model and one optimizer file;
- `after`: the trainer's own `training_state_digest` and `save_dense`: each rank digests and writes the
  tensors it owns, one tensor at a time.

Each job trains `--steps` iterations of the config in its layout (so that AdamW state exists), then
measures each phase by resetting the kernel's peak-RSS mark (`/proc/self/clear_refs` "5") before it and
reading `VmHWM` after it. Per layout, phase and rank it prints

    layout=<l> phase=<digest|save> rank=<r> before_mb=<x> after_mb=<x> ratio=<before/after>

where each figure is the phase's peak RSS above the RSS the rank had when training ended (the save phase
of `before` still holds the gathered state; the largest over rounds), beside the size of the whole
training state and of its largest single tensor (a stacked expert weight assembled whole). A job killed
(by the OOM killer, on a machine short of memory) is reported as failed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from benchmarks.variants import QUIET

LAYOUTS = {"pp2": ["--parallelism.pp", "2"], "dp2": ["--parallelism.dp", "2"]}
VARIANTS = ("before", "after")
LINE = re.compile(r"^memory variant=(\S+) rank=(\d+) phase=(\S+) over_mb=(\S+) peak_mb=(\S+)$", re.M)
SIZES = re.compile(r"^sizes state_mb=(\S+) largest_mb=(\S+)$", re.M)
MB = 1 << 20


# ---------------------------------------------------------------- inside one rank


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)[1])


class PhasePeak:
    """The peak resident set of this process during a `with` block, by the kernel's own mark."""

    def __enter__(self) -> PhasePeak:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return self

    def __exit__(self, *exc) -> None:
        self.peak_kb = _status_kb("VmHWM")


def consolidated_state(model, optimizer) -> dict | None:
    """The old end of run: the whole job's state gathered (pickled) to rank 0; None elsewhere."""
    import torch.distributed as dist

    from parallelisms import collectives
    from trainer.checkpoint.state import named_training_state

    local = named_training_state(model, optimizer)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    collectives.gather_object(local, gathered, dst=0)
    del local
    if gathered is None:
        return None
    merged: dict = {}
    for state in gathered:
        for name, tensor in state.items():
            merged.setdefault(name, tensor)
    return merged


def save_consolidated(directory: Path, state: dict | None) -> None:
    """The old save: rank 0 writes the consolidated state as one model and one optimizer file."""
    from parallelisms import collectives
    from trainer.checkpoint.safetensors_stream import write_safetensors
    from trainer.checkpoint.state import OPTIM_PREFIX

    if state is not None:
        directory.mkdir(mode=0o700)
        for file, optim in (("model.safetensors", False), ("optim.safetensors", True)):
            part = {k: v for k, v in state.items() if k.startswith(OPTIM_PREFIX) == optim}
            write_safetensors(directory / file, {k: (v.dtype, tuple(v.shape)) for k, v in part.items()}, part.get)
    collectives.barrier()


def _sizes(job) -> tuple[float, float]:
    """(MB of the whole job's training state, MB of its largest tensor as the walk assembles it)."""
    from trainer.checkpoint.rank0 import all_records
    from trainer.checkpoint.state import training_plan

    plan = training_plan(job.model.view, job.optimizer)
    sizes = [(u.tensor.numel() * u.tensor.element_size(), u.owner) for u in plan]
    mine = (sum(n for n, owner in sizes if owner), max(n for n, _ in sizes))
    every = all_records(mine)
    return sum(total for total, _ in every) / MB, max(largest for _, largest in every) / MB


def worker(variant: str, config: str, target: Path, overrides: list[str]) -> None:
    """One rank of a job: train, then measure the digest and the save of `variant`."""
    import train
    from trainer.checkpoint.dense import save_dense
    from trainer.checkpoint.state import state_digest, training_state_digest
    from trainer.config import load_config
    from trainer.lifecycle.fault_bounds import fault_bounds
    from trainer.lifecycle.process_state import ProcessState
    from trainer.lifecycle.start_plan import plan_start
    from trainer.lifecycle.startup import STARTUP

    sys.stdout.reconfigure(line_buffering=True)  # the ranks share one stdout: whole lines only
    cfg = load_config(config, overrides)
    process = ProcessState(STARTUP, bounds=fault_bounds(cfg.fault))  # as train.py's main sets it up
    job, step, loss = train.setup(cfg, plan_start(process))
    step, loss = train.train_loop(job, step, loss)
    state_mb, largest_mb = _sizes(job)
    base_kb = _status_kb("VmRSS")
    with PhasePeak() as digest:
        if variant == "before":
            state = consolidated_state(job.model.view, job.optimizer)
            if state is not None:
                state_digest(state)
        else:
            training_state_digest(job.model.view, job.optimizer)
    with PhasePeak() as save:
        if variant == "before":
            save_consolidated(target, state)
        else:
            save_dense(str(target), job.model.view, job.optimizer, step, loss, cfg)
    if job.rank == 0:
        print(f"sizes state_mb={state_mb:.1f} largest_mb={largest_mb:.1f}", flush=True)
    for phase, peak in (("digest", digest), ("save", save)):
        over, top = (peak.peak_kb - base_kb) / 1024, peak.peak_kb / 1024
        print(f"memory variant={variant} rank={job.rank} phase={phase} over_mb={over:.1f} peak_mb={top:.1f}")
    job.periodic.close()
    job.ft.close()
    job.logger.close()


# ---------------------------------------------------------------- the driver


def run_job(variant: str, layout: str, args, scratch: Path) -> str:
    """One torchrun job's stdout; a job that failed (a killed rank: -9 is the OOM killer's) says so."""
    target = Path(tempfile.mkdtemp(dir=scratch)) / "ckpt"
    flags = [*QUIET, *LAYOUTS[layout], "--training.steps", str(args.steps), "--job.output_dir", str(scratch / "runs")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "benchmarks.end_of_run_memory", "--worker", variant, "--target", str(target), "--config", args.config]
    proc = subprocess.run([*cmd, *flags], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    shutil.rmtree(target.parent)
    if proc.returncode != 0:
        codes = sorted(set(re.findall(r"exitcode\s*: (-?\d+)", proc.stderr)))
        print(f"layout={layout} variant={variant} failed: exit codes {', '.join(codes) or proc.returncode}", flush=True)
    return proc.stdout


def _largest(values: list[float]) -> str:
    return f"{max(values):.1f}" if values else "failed"


def report(outputs: dict[str, list[str]]) -> None:
    for layout, texts in outputs.items():
        over: dict[tuple[str, int, str], list[float]] = defaultdict(list)
        for text in texts:
            for variant, rank, phase, over_mb, _ in LINE.findall(text):
                over[variant, int(rank), phase].append(float(over_mb))
        sizes = next((m.groups() for m in map(SIZES.search, texts) if m), ("?", "?"))
        print(f"layout={layout} state_mb={sizes[0]} largest_tensor_mb={sizes[1]}")
        for phase in ("digest", "save"):
            for rank in (0, 1):
                before, after = over["before", rank, phase], over["after", rank, phase]
                ratio = f"{max(before) / max(after):.1f}" if before and after and max(after) > 0 else "-"
                print(
                    f"layout={layout} phase={phase} rank={rank} before_mb={_largest(before)} "
                    f"after_mb={_largest(after)} ratio={ratio}"
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="train_configs/bench_moe.toml")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--layouts", default="pp2,dp2")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--target", type=Path, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.worker:
        worker(args.worker, args.config, args.target, overrides)
        return 0
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        sys.exit(f"--layouts: unknown {sorted(unknown)}; choose from {sorted(LAYOUTS)}")
    scratch = Path(tempfile.mkdtemp(prefix="end-of-run-memory-"))
    outputs: dict[str, list[str]] = defaultdict(list)
    try:
        for _ in range(args.rounds):
            for layout in layouts:
                for variant in VARIANTS:
                    outputs[layout].append(run_job(variant, layout, args, scratch))
    finally:
        shutil.rmtree(scratch)
    report(outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
