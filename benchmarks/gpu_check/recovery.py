"""Section 3: failures and recoveries on CUDA that end with the fault-free run's digest, compared exactly.

One GPU hosts one rank under nccl (nccl refuses two ranks on one device), and an in-place failure
(`fault.at`) or a replacement by a rank shell needs a surviving rank, so the failures here are whole-process
deaths under torchrun with a restart: a crash (`fault.crash`, the process exits at the start of an
iteration) and a real SIGKILL (`fault.kill ...:snapshot`, while that iteration's snapshot is being copied
from the GPU into pinned host memory on the side stream). The restarted process converts the persisted
sparse checkpoint it finds in host memory (docs/design/lifecycle/start.md, "Whole-job restart") and trains on; the
snapshot the SIGKILL cut short must be recognised as incomplete and not used. Deterministic algorithms
(`training.deterministic`, `CUBLAS_WORKSPACE_CONFIG` set by train.py) make each faulty run's `step=` losses
and `final ... state_digest=` line equal to the fault-free run's bit for bit, or the check fails. The
restart's own collectives run on the default group of a one-process torchrun job: the start-up `kept`
all-reduce and the recovery totals.
"""

from __future__ import annotations

from benchmarks.gpu_check.report import Check, Section
from benchmarks.gpu_check.runs import ROOT, Workspace, train
from benchmarks.overhead import recorded_steps
from moevement.recovery.report import RecoveryReport
from trainer.records.event_lines import FinalLine
from trainer.records.event_log import run_events

CONFIG = "train_configs/debug_moe.toml"
STEPS = "14"
DEATHS = (  # (job name, what the checks say, flags)
    ("gpu_check_crash", "crash", ("--fault.crash", "8:0")),
    ("gpu_check_sigkill", "SIGKILL while snapshotting", ("--fault.kill", "8:0:snapshot")),
)
RUN_TIMEOUT_S = 120
RESTART = ("--max-restarts", "1")
LAYOUT = ["--training.mixed_precision", "bf16", "--checkpoint.strategy", "moevement", "--checkpoint.window", "3"]


def losses(stdout: str) -> dict[int, float]:
    return {t: record["loss"] for t, record in recorded_steps(stdout, ROOT).items()}


def run(section: Section) -> None:
    workspace = Workspace()
    try:
        base = ["--config", CONFIG, *LAYOUT, "--training.steps", STEPS]
        reference = train([*base, *workspace.common("gpu_check_fault_free")], RUN_TIMEOUT_S)
        for job, name, flags in DEATHS:
            faulty = train([*base, *workspace.common(job), *flags], RUN_TIMEOUT_S, nproc=1, torchrun=RESTART)
            check_recovered(section, name, reference, faulty)
    finally:
        workspace.close()


def check_recovered(section: Section, name: str, reference: str, faulty: str) -> None:
    """The faulty run restarted, recovered, and matched the reference's losses and final line exactly."""
    events = {run: run_events(out, ROOT) for run, out in (("reference", reference), ("faulty", faulty))}
    recovered = [e.line() for e in events["faulty"] if isinstance(e, RecoveryReport)]
    section.checks.append(Check(f"{name}: restart happened", bool(recovered), (recovered or ["no recovery line"])[0]))
    same_losses = bool(losses(reference)) and losses(faulty) == losses(reference)
    section.checks.append(Check(f"{name}: step losses equal", same_losses, f"{len(losses(reference))} steps"))
    finals = [[e.line() for e in events[run] if isinstance(e, FinalLine)] for run in ("reference", "faulty")]
    same = len(finals[0]) == 1 and finals[0] == finals[1]
    section.checks.append(Check(f"{name}: final state_digest equal", same, (finals[0] or ["no final line"])[0]))
