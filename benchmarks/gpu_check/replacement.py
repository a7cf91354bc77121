"""Section 6: two processes sharing the one GPU run `train.py` at pp=2, rank 1 is SIGKILLed mid-run and its
rank shell's warm standby replaces it in place; the run must end with the fault-free run's digest.

The run is the trainer's own (docs/design/lifecycle/replacement.md, tests/test_real_deaths.py on CPU): torchrun with two
workers and `--max-restarts 0` (a torchrun restart fails the run: the replacement must be in place),
`--fault.kill 9:1:backward` (rank 1 SIGKILLs itself in the backward pass of step 9), and the same command
without the kill as the reference. PASS needs the kill, the rank shell's `replaces it in generation 1`
line and a `restart=replaced` recovery, every step loss the faulty run printed equal to the reference's,
and the same `final ... state_digest=` line.

Today the trainer cannot put two ranks on one GPU, so the section SKIPs with the reason (`blocker`)
instead of running: `train.py` joins the default group over `parallelisms.distributed.default_backend("cuda")`,
`cpu:gloo,cuda:nccl`, with no setting to choose another, and pins rank r to `cuda:r` (rank 1 has no device
1); nccl refuses two ranks on one device. Over `cpu:gloo,cuda:gloo` (section 5's backend) the pipeline's
point-to-point sends of CUDA activations would still not be carried (torch.distributed's backend table:
gloo has no send/recv of GPU tensors). When the trainer's CUDA backend no longer names nccl, the section
runs the real thing (and its budget in __main__.py, which covers the SKIP, must grow: the two runs took
45-100 s on two CPU cores). `run_replacement` is exercised on CPU (plain gloo) by tests/test_gpu_check.py.
"""

from __future__ import annotations

from benchmarks.gpu_check.report import Check, Section
from benchmarks.gpu_check.runs import ROOT, Workspace, train
from benchmarks.gpu_check.shared_gpu import BACKEND
from benchmarks.overhead import recorded_steps
from moevement.recovery.report import RecoveryReport
from parallelisms.distributed import default_backend
from trainer.lifecycle.shell_lines import REPLACED, ShellLine
from trainer.records.event_lines import FaultStrike, FinalLine
from trainer.records.event_log import run_events

CONFIG = "train_configs/debug_moe.toml"
LAYOUT = [
    *("--parallelism.pp", "2", "--model.n_layers", "4", "--training.steps", "14"),
    *("--checkpoint.strategy", "moevement", "--checkpoint.window", "3", "--fault.timeout_s", "120"),
]
KILL = ("--fault.kill", "9:1:backward")
IN_PLACE = ("--max-restarts", "0")
RUN_TIMEOUT_S = 240


def blocker(trainer_backend: str) -> str:
    """Why `train.py`, whose default group on CUDA is `trainer_backend`, cannot run two ranks on one GPU
    (one line), or "" when nothing known stops it."""
    if "nccl" not in trainer_backend:
        return ""
    return (
        f"train.py cannot run two ranks on one GPU: its default group is {trainer_backend!r} "
        "(parallelisms.distributed.default_backend; no setting chooses another) with rank r pinned to cuda:r, "
        f"and nccl refuses two ranks on one device; over {BACKEND!r} the pipeline's point-to-point sends of "
        "CUDA activations would not be carried either (torch.distributed's backend table: gloo has no send/recv "
        "of GPU tensors)"
    )


def losses(stdout: str) -> dict[int, float]:
    return {t: record["loss"] for t, record in recorded_steps(stdout, ROOT).items()}


def check_replaced(section: Section, reference: str, faulty: str) -> None:
    """The faulty run's rank 1 was SIGKILLed and replaced in place, and it trained on to the reference's
    losses and final line exactly."""
    events = {run: run_events(out, ROOT) for run, out in (("reference", reference), ("faulty", faulty))}
    killed = [e.line() for e in events["faulty"] if isinstance(e, FaultStrike) and (e.rank, e.how) == (1, "SIGKILL")]
    replaced = [e.line() for e in events["faulty"] if isinstance(e, ShellLine) and (e.rank, e.what) == ("1", REPLACED)]
    section.checks.append(Check("rank 1 SIGKILLed", bool(killed), (killed or ["no fault line"])[0]))
    section.checks.append(Check("standby replaced it", bool(replaced), (replaced or ["no shell line"])[0]))
    rejoined = [e.line() for e in events["faulty"] if isinstance(e, RecoveryReport) and e.restart == "replaced"]
    section.checks.append(Check("recovered in place", bool(rejoined), (rejoined or ["no restart=replaced line"])[0]))
    got, want = losses(faulty), losses(reference)
    same_losses = bool(got) and max(want, default=0) in got and all(want.get(t) == v for t, v in got.items())
    section.checks.append(Check("step losses equal", same_losses, f"{len(got)} steps against {len(want)}"))
    finals = [[e.line() for e in events[run] if isinstance(e, FinalLine)] for run in ("reference", "faulty")]
    same = len(finals[0]) == 1 and finals[1][-1:] == finals[0]
    section.checks.append(Check("final state_digest equal", same, (finals[0] or ["no final line"])[0]))


def run_replacement(section: Section) -> None:
    """The fault-free run and the faulty one, two workers each, on the device train.py picks."""
    workspace = Workspace()
    try:
        base = ["--config", CONFIG, *LAYOUT]
        reference = train([*base, *workspace.common("gpu_check_pp2_fault_free")], RUN_TIMEOUT_S, nproc=2)
        job = workspace.common("gpu_check_pp2_sigkill")
        faulty = train([*base, *job, *KILL], RUN_TIMEOUT_S, nproc=2, torchrun=IN_PLACE)
        check_replaced(section, reference, faulty)
    finally:
        workspace.close()


def run(section: Section) -> None:
    section.skipped = blocker(default_backend("cuda"))
    if not section.skipped:
        run_replacement(section)
