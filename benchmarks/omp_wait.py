"""How the OpenMP wait policy changes a replaying stage's iteration on every core (`training.omp_wait_policy`).

    python -m benchmarks.omp_wait [--config train_configs/bench_moe.toml] [--layers 4] [--threads 2] \
        [--rounds 3] [--iterations 3] [--policies passive,default]

A failed stage replays on the cores its paused neighbours leave idle (moevement/recovery/replay_threads.py),
so its OpenMP workers wait between thousands of small parallel regions per iteration. Each round runs, per
policy and in alternating order, a fresh process (the policy is read once, when the OpenMP runtime starts)
with `OMP_WAIT_POLICY` set as `training.omp_wait_policy` would set it ("default": unset) and
`--threads` compute threads; it times `--iterations` forward+backward passes of a `--layers`-block
model of the config's shape (a pipeline stage's share of `bench_moe` at pp=2) on one batch
(batch_size x seq_len tokens), after one warm-up. Prints per policy the median seconds per iteration
and its range, and each policy's ratio to the first one per round, with their median and range.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib

POLICY_ENV = {"passive": "PASSIVE", "active": "ACTIVE", "default": None}


def child(config: str, layers: int, iterations: int) -> None:
    """One measurement in this process: seconds per forward+backward, as one JSON line."""
    import torch

    from models import build_model
    from models.args import ModelArgs

    with open(config, "rb") as f:
        cfg = tomllib.load(f)
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    args = ModelArgs(**{**{k: v for k, v in cfg["model"].items() if k in known}, "n_layers": layers})
    torch.manual_seed(0)
    model = build_model(args)
    tokens = torch.randint(0, args.vocab_size, (cfg["training"]["batch_size"], cfg["training"]["seq_len"]))
    times = []
    for i in range(iterations + 1):
        start = time.perf_counter()
        out = model(tokens)
        logits = out[0] if isinstance(out, tuple) else out
        logits.float().square().mean().backward()
        if i:
            times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": statistics.median(times)}), flush=True)


def measure(policy: str, args: argparse.Namespace) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_NUM_THREADS"] = str(args.threads)
    if POLICY_ENV[policy] is not None:
        env["OMP_WAIT_POLICY"] = POLICY_ENV[policy]
    command = [sys.executable, "-m", "benchmarks.omp_wait", "--child", "--config", args.config]
    command += ["--layers", str(args.layers), "--iterations", str(args.iterations)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/bench_moe.toml")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--policies", default="passive,default")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.config, args.layers, args.iterations)
        return
    policies = args.policies.split(",")
    if unknown := [p for p in policies if p not in POLICY_ENV]:
        sys.exit(f"error: --policies: unknown {unknown} (known: {', '.join(POLICY_ENV)})")
    seconds: dict[str, list[float]] = {p: [] for p in policies}
    for r in range(args.rounds):
        for policy in policies if r % 2 == 0 else reversed(policies):
            seconds[policy].append(measure(policy, args))
            print(f"round={r} policy={policy} seconds={seconds[policy][-1]:.3f}", flush=True)
    first = policies[0]
    for policy in policies:
        s = seconds[policy]
        ratios = [x / y for x, y in zip(s, seconds[first])]
        print(
            f"policy={policy} threads={args.threads} seconds median={statistics.median(s):.3f} "
            f"range={min(s):.3f}-{max(s):.3f} over_{first} median={statistics.median(ratios):.3f} "
            f"range={min(ratios):.3f}-{max(ratios):.3f}"
        )


if __name__ == "__main__":
    main()
