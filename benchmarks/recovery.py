"""Localized vs global recovery of the same failure, and the replay compute frozen operators save.

    python -m benchmarks.recovery --config train_configs/bench_moe.toml --pp 4 [--mode wipe|kill] \
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

`--mode kill`: the middle stage dies for real instead (SIGKILL in its backward pass of `--fail-step`):
replaced in place by its rank shell's warm standby while the survivors stay alive (`kill-replaced`), or,
with torchrun restarting every process, recovered locally (`kill-localized`) and by every stage replaying
(`kill-global`), beside the same failure wiped in place (`wipe`). Per variant it prints the median
recovery split into detect (death to the first survivor's detection), keep (survivors keep their live
state), join and rebuild (in place: the next generation's process group; data, model and strategy) or
restart and setup (torchrun: the agent restarts the processes; process start to the rejoin), fetch,
convert and catch-up; the restart itemised stage by stage; and the in-place replacement against the wipe.

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
from models.experts import GROUPED_MM_FLOPS
from moevement.checkpoint.schedule import generate_schedule, order_operators, slot_size_for
from moevement.operators import build_registry
from moevement.recovery.replay import set_frozen
from moevement.recovery.report import RecoveryReport, RecoveryWork
from parallelisms.pipeline import lm_loss
from trainer.config import load_config
from trainer.model_operators import stacked_operators
from trainer.records.event_log import run_events

TIMELINE_RE = re.compile(r"^restart timeline rank=\d+: (.*)$", re.M)
DEATH_RE = re.compile(r"^fault: rank \d+ killed .* at unix=(\S+)", re.M)
DETECTED_RE = re.compile(r"\(detected at unix=(\S+)\)$", re.M)
VARIANTS = {"wipe": ("localized", "global"), "kill": ("kill-replaced", "kill-localized", "kill-global", "wipe")}
# kill-replaced: the rank shell's standby replaces the dead worker in place, the survivors stay alive;
# kill-localized / kill-global: torchrun restarts every worker (no rank shell), then one stage / every stage replays
TORCHRUN_RESTART = ["--fault.max_replacements", "0"]


def command(args, variant: str, host_dir: str, extra: list[str]) -> list[str]:
    """torchrun + train.py for one variant: the middle stage fails at `--fail-step`, killed for real
    (`kill-*`: SIGKILL in its backward pass, replaced in place or by torchrun's restart of the job) or wiped
    in place."""
    mid, kill = args.pp // 2, variant.startswith("kill")
    fault = ["--fault.kill", f"{args.fail_step}:{mid}:backward"] if kill else ["--fault.at", f"{args.fail_step}:{mid}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.pp}",
        f"--max-restarts={int(variant in ('kill-localized', 'kill-global'))}",
        "train.py",
        "--config",
        args.config,
        *QUIET,
        "--training.steps",
        str(args.fail_step + (2 if kill else 0)),
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
        *fault,
        "--fault.scope",
        "global" if variant.endswith("global") else "localized",
        "--fault.replay_threads",
        "1",
        *(TORCHRUN_RESTART if variant in ("kill-localized", "kill-global") else []),
        *extra,
    ]


def run(args, variant: str, extra: list[str]) -> dict[str, float]:
    """One run's recovery in seconds: total, each part of the `recovery` line (and, for a real death,
    detect and each stage of the restart timeline), replay, and the healthy stages' forwards+backwards."""
    with tempfile.TemporaryDirectory(prefix="moevement-bench-", dir="/dev/shm") as host_dir:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        proc = subprocess.run(command(args, variant, host_dir, extra), capture_output=True, text=True, env=env)
    out = proc.stdout
    events = run_events(out) if proc.returncode == 0 else []
    reports = [e for e in events if isinstance(e, RecoveryReport)]
    if not reports:
        sys.exit(f"run failed ({variant}):\n{out[-2000:]}\n{proc.stderr[-4000:]}")
    parts = reports[0].parts()
    result = {"seconds": reports[0].seconds, **parts, "replay": parts["convert"] + parts["catchup"]}
    healthy = [e for e in events if isinstance(e, RecoveryWork) and e.role == "healthy"]
    result["healthy_work"] = sum(w.forwards + w.backwards for w in healthy)
    if variant.startswith("kill"):
        death, detected = float(DEATH_RE.search(out)[1]), min(map(float, DETECTED_RE.findall(out)))
        result["detect"] = detected - death
        result["seconds"] += result["detect"]  # the recovery line counts from the detection
        stages = TIMELINE_RE.search(out)[1].split()
        result.update({f"restart.{k}": float(v) for k, v in (kv.split("=") for kv in stages)})
    return result


def _fields(result: dict[str, float], keys: list[str]) -> str:
    return " ".join(f"{k}={result[k]:.3f}" for k in keys if k in result)


def report_kill(results: dict[str, list[dict]]) -> None:
    """Medians of each variant, the restart itemised, and each real death's recovery against the wipe's."""
    keys = ["seconds", "detect", "keep", "join", "rebuild", "restart", "setup", "fetch", "convert", "catchup"]
    keys += ["replay", "healthy_work"]
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in results.items()}
    for variant, m in med.items():
        print(f"variant={variant} {_fields(m, keys)}")
    for variant in ("kill-replaced", "kill-localized"):
        stages = [k for k in med[variant] if k.startswith("restart.")]
        print(f"restart itemised ({variant}, rank 0, median s): " + _fields(med[variant], stages))
    replaced, local, wipe = med["kill-replaced"], med["kill-localized"], med["wipe"]["seconds"]
    print(
        f"replaced_s={replaced['seconds']:.3f} torchrun_restart_s={local['seconds']:.3f} wipe_s={wipe:.3f} "
        f"replaced_over_torchrun_restart={replaced['seconds'] / local['seconds']:.3f} "
        f"localized_over_global={local['seconds'] / med['kill-global']['seconds']:.3f} "
        f"met={replaced['seconds'] <= wipe + 1.0 and replaced['healthy_work'] == 0} "
        f"(target: an in-place replacement costs at most the in-place wipe + 1 s; healthy stages run nothing)"
    )


def conversion_work(
    config: str, window: int, micro_batches: int, extra: list[str], repeats: int = 3
) -> tuple[float, float]:
    """(FLOP saving, time saving) of a conversion window with frozen operators vs all operators active."""
    cfg = load_config(config, extra)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    ops = build_registry(model, stacked_operators(model))
    order = order_operators([op.name for op in ops], [op.kind == "expert" for op in ops], {})
    slots = generate_schedule(order, slot_size_for(len(order), window), window)
    by_name = {op.name: op for op in ops}
    batch = cfg.training.batch_size // micro_batches
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.training.seq_len))

    def fwd_bwd(frozen_slots: list[tuple[str, ...]]) -> tuple[int, float]:
        set_frozen(ops, False)
        set_frozen([by_name[n] for slot in frozen_slots for n in slot], True)
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False, custom_mapping=GROUPED_MM_FLOPS) as counter:
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
    parser.add_argument("--mode", choices=tuple(VARIANTS), default="wipe", help="in-place wipes, or real deaths")
    args, extra = parser.parse_known_args(argv)

    results: dict[str, list[dict]] = {v: [] for v in VARIANTS[args.mode]}
    for round_index in range(args.rounds):
        for variant in results:
            results[variant].append(run(args, variant, extra))
            print(f"round={round_index} variant={variant} {_fields(results[variant][-1], ['seconds', 'replay'])}")
    if args.mode == "kill":
        report_kill(results)
        return
    replay = {}
    for variant, rs in results.items():
        replay[variant] = statistics.median(r["replay"] for r in rs)
        print(
            f"mode={variant} seconds={statistics.median(r['seconds'] for r in rs):.3f} replay_s={replay[variant]:.3f}"
        )
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
