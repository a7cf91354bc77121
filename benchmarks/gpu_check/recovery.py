"""Section 3: a failure and recovery on CUDA that ends with the fault-free run's digest, compared exactly.

One GPU hosts one rank under nccl (nccl refuses two ranks on one device), and an in-place failure
(`fault.at`) needs a surviving rank, so the failure here is a process crash (`fault.crash`) under torchrun
with a restart: the restarted process converts the persisted sparse checkpoint it finds in host memory
(whole-job restart, docs/design.md §4) and trains on. Deterministic algorithms (`training.deterministic`,
`CUBLAS_WORKSPACE_CONFIG` set by train.py) make the two runs' `step=` losses and `final ... state_digest=`
lines equal bit for bit, or the check fails. The restart's own collectives run on the default group of a
one-process torchrun job: the start-up `kept` all-reduce and the recovery totals.
"""

from __future__ import annotations

import re

from benchmarks.gpu_check.report import Check, Section
from benchmarks.gpu_check.runs import Workspace, train
from benchmarks.overhead import parse_steps

CONFIG = "train_configs/debug_moe.toml"
STEPS, CRASH_AT = "14", "8:0"
RUN_TIMEOUT_S = 120
FINAL = re.compile(r"^final step=.* state_digest=[0-9a-f]+.*$", re.M)  # the whole line is compared
LAYOUT = ["--training.mixed_precision", "bf16", "--checkpoint.strategy", "moevement", "--checkpoint.window", "3"]


def losses(stdout: str) -> dict[int, float]:
    return {t: record["loss"] for t, record in parse_steps(stdout).items()}


def run(section: Section) -> None:
    workspace = Workspace()
    try:
        base = ["--config", CONFIG, *LAYOUT, "--training.steps", STEPS]
        reference = train([*base, *workspace.common("gpu_check_fault_free")], RUN_TIMEOUT_S)
        faulty = train(
            [*base, *workspace.common("gpu_check_crash"), "--fault.crash", CRASH_AT],
            RUN_TIMEOUT_S,
            nproc=1,
            torchrun=("--max-restarts", "1"),
        )
    finally:
        workspace.close()
    recovered = [line for line in faulty.splitlines() if line.startswith("recovery step=")]
    section.checks.append(Check("crash and restart happened", bool(recovered), (recovered or ["no recovery line"])[0]))
    same_losses = bool(losses(reference)) and losses(faulty) == losses(reference)
    section.checks.append(Check("step losses equal", same_losses, f"{len(losses(reference))} steps"))
    finals = [FINAL.findall(out) for out in (reference, faulty)]
    same = len(finals[0]) == 1 and finals[0] == finals[1]
    section.checks.append(Check("final state_digest equal", same, (finals[0] or ["no final line"])[0]))
