"""Localized vs global recovery of the same failure, and the replay compute frozen operators save.

    python -m benchmarks.recovery --config train_configs/bench_moe.toml --pp 4 \
        [--micro-batches 4] [--window 2] [--fail-step 8] [--rounds 1] [--key value ...]

Each round runs `train.py` under torchrun twice (real processes, modes alternating) with the same
injected failure of a middle pipeline stage: `--fault.scope localized` (only that stage's group rolls
back and replays from its neighbours' logs) and `--fault.scope global` (every stage rolls back and
replays the same iterations as a pipeline). It prints, from the `recovery ...` lines,

    mode=localized seconds=<median> replay_s=<median>
    mode=global seconds=<median> replay_s=<median>
    localized_over_global=<replay ratio> theory=<M/(M+S-1)> target=<theory+0.05> met=<bool>

A lone stage replays its M micro-batches without pipeline bubbles, so its replay should take
M/(M+S-1) of the pipeline's. Both modes replay with one thread per rank (`--fault.replay_threads 1`)
so that the ratio isolates the bubbles; `--fault.replay_threads 0` lets the lone stage also take the
idle cores of the paused stages (moevement/recovery/replay_threads.py). Then, in this process, it counts the
forward+backward work of one conversion window (slot i active at iteration t0+i, later slots
frozen) against an all-active replay:

    frozen_saving_flops=<1 - frozen/all-active> frozen_saving_time=<same, measured> (paper: about 0.33)

Extra `--section.key value` arguments go to every run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.variants import QUIET
from models import build_model
from moevement.checkpoint.schedule import generate_schedule, order_operators, slot_size_for
from moevement.operators import build_registry
from moevement.recovery.replay import set_frozen
from parallelisms.pipeline import lm_loss
from trainer.config import load_config

RECOVERY_RE = re.compile(r"^recovery step=\d+ .* seconds=(\S+) \(fetch=(\S+) convert=(\S+) catchup=(\S+)\)", re.M)


def run(args, mode: str, extra: list[str]) -> tuple[float, float]:
    """(recovery seconds, replay seconds) of one run with the failure recovered in `mode`."""
    with tempfile.TemporaryDirectory(prefix="moevement-bench-", dir="/dev/shm") as host_dir:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.pp}",
            "train.py",
            "--config",
            args.config,
            *QUIET,
            "--training.steps",
            str(args.fail_step),
            "--parallelism.pp",
            str(args.pp),
            "--training.micro_batches",
            str(args.micro_batches),
            "--checkpoint.strategy",
            "moevement",
            "--checkpoint.window",
            str(args.window),
            "--checkpoint.host_dir",
            host_dir,
            "--fault.at",
            f"{args.fail_step}:{args.pp // 2}",
            "--fault.scope",
            mode,
            "--fault.replay_threads",
            "1",
            *extra,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    m = RECOVERY_RE.search(proc.stdout)
    if proc.returncode != 0 or m is None:
        sys.exit(f"run failed ({mode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    seconds, _fetch, convert, catchup = map(float, m.groups())
    return seconds, convert + catchup


def conversion_work(
    config: str, window: int, micro_batches: int, extra: list[str], repeats: int = 3
) -> tuple[float, float]:
    """(FLOP saving, time saving) of a conversion window with frozen operators vs all operators active."""
    cfg = load_config(config, extra)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    ops = build_registry(model)
    order = order_operators([op.name for op in ops], [op.kind == "expert" for op in ops], {})
    slots = generate_schedule(order, slot_size_for(len(order), window), window)
    by_name = {op.name: op for op in ops}
    batch = cfg.training.batch_size // micro_batches
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.training.seq_len))

    def fwd_bwd(frozen_slots: list[tuple[str, ...]]) -> tuple[int, float]:
        set_frozen(ops, False)
        set_frozen([by_name[n] for slot in frozen_slots for n in slot], True)
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as counter:
            lm_loss(model(x), x).backward()
        times = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            lm_loss(model(x), x).backward()
            times.append(time.perf_counter() - start)
        return counter.get_total_flops(), statistics.median(times)

    frozen_flops = frozen_time = active_flops = active_time = 0.0
    for i in range(window):  # interleaved: the iteration t0+i of a conversion, then an all-active one
        flops, seconds = fwd_bwd(list(slots[i + 1 :]))
        frozen_flops, frozen_time = frozen_flops + flops, frozen_time + seconds
        flops, seconds = fwd_bwd([])
        active_flops, active_time = active_flops + flops, active_time + seconds
    set_frozen(ops, False)
    return 1 - frozen_flops / active_flops, 1 - frozen_time / active_time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/bench_moe.toml")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--fail-step", type=int, default=8, help="iteration at which the middle stage fails")
    parser.add_argument("--rounds", type=int, default=1)
    args, extra = parser.parse_known_args(argv)

    results: dict[str, list[tuple[float, float]]] = {"localized": [], "global": []}
    for round_index in range(args.rounds):
        for mode in results:
            results[mode].append(run(args, mode, extra))
            seconds, replay = results[mode][-1]
            print(f"round={round_index} mode={mode} seconds={seconds:.3f} replay_s={replay:.3f}", flush=True)
    replay = {}
    for mode, rs in results.items():
        replay[mode] = statistics.median(r for _, r in rs)
        print(f"mode={mode} seconds={statistics.median(s for s, _ in rs):.3f} replay_s={replay[mode]:.3f}")
    m, s = args.micro_batches, args.pp
    theory = m / (m + s - 1)
    ratio = replay["localized"] / replay["global"]
    print(
        f"localized_over_global={ratio:.3f} theory={theory:.3f} target={theory + 0.05:.3f} met={ratio <= theory + 0.05}"
    )
    flops, seconds = conversion_work(args.config, args.window, args.micro_batches, extra)
    print(
        f"frozen_saving_flops={flops:.3f} frozen_saving_time={seconds:.3f} window={args.window} "
        f"(conversion replay vs all operators active; paper: about 0.33)"
    )


if __name__ == "__main__":
    main()
