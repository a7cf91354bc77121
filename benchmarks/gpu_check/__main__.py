"""`python -m benchmarks.gpu_check`: run the sections (see the package docstring) and print the report."""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.gpu_check import gil_profile, numerics, overhead, recovery, replacement, shared_gpu, throughput
from benchmarks.gpu_check.report import Section, run_section, summary

# (number, title, budget in seconds, body): the budgets sum to under 9 minutes, within the 10 one command may run
# on a lent GPU machine. Section 2 runs twelve train.py processes (five rounds of two, two in-process A/B runs):
# 184 s on an H200 with one 96-step A/B run; now two of 186 steps, the CUDA-graph measure and the graphed copy's
# check: about 80 s more. 3 took 52-65 s there, 1 and 5 together 15 s, an 18-step run under py-spy (7) 16-25 s;
# section 6 SKIPs today (its runs: 45-100 s on 2 CPU cores).
SECTIONS = (
    (1, "CUDA against CPU: debug model fp32/bf16, grouped GEMM", 30, numerics.run),
    (2, "MoEvement on one GPU: pinned snapshots, stall, overhead against none", 300, overhead.run),
    (3, "crash and SIGKILL, restart on CUDA: fault-free digest", 75, recovery.run),
    (4, "DeepSeek-MoE-16B-shaped stage, bf16 forward+backward", 60, throughput.run),
    (5, "two processes on one GPU (cpu:gloo,cuda:gloo): control-tensor collectives", 30, shared_gpu.run),
    (6, "two processes on one GPU: train.py pp=2, SIGKILL, replaced in place: fault-free digest", 5, replacement.run),
    (7, "who holds the GIL while MoEvement snapshots (py-spy --gil)", 35, gil_profile.run),
)


def device_line() -> str:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return (
        f"gpu-check: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
        f"compute capability {props.major}.{props.minor}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{torch.cuda.device_count()} device(s) visible"
    )


def main(argv: list[str] | None = None) -> int:
    """0 when every section passed (or there is no GPU), 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated section numbers (default: all)")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of a failing section")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False): nothing to check here, exiting 0")
        return 0
    chosen = {int(n) for n in args.only.split(",") if n} or {number for number, *_ in SECTIONS}
    print(device_line(), flush=True)
    started, done = time.perf_counter(), []
    for number, title, budget, body in SECTIONS:
        if number in chosen:
            section = run_section(Section(number, title, budget), body, args.verbose)
            print("\n".join(section.lines()), flush=True)
            done.append(section)
    print(summary(done, time.perf_counter() - started), flush=True)
    return 1 if any(section.status == "FAIL" for section in done) else 0


if __name__ == "__main__":
    raise SystemExit(main())
