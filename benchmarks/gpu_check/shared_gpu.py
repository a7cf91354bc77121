"""Section 5: two processes sharing the one GPU run the trainer's control-tensor collectives.

nccl refuses two ranks on one GPU, and gloo carries CUDA tensors in `all_reduce` and `broadcast` only (not
in point-to-point, all-gather or reduce-scatter), so `train.py` itself cannot run two ranks here: its
pipeline and FSDP move CUDA tensors. The two workers (torchrun, both on GPU 0, process group
`cpu:gloo,cuda:gloo`) instead call the trainer's own functions with the GPU as the model's device:

- tensorboard: `StageGather.add` of CUDA token counts, then `StageGather.gather` (the all-reduce rank 0
  writes TensorBoard's expert-load figures from);
- boundary_logs: `UpstreamLog` hooks copy a stage's CUDA activations into pinned host memory on the side
  stream, `fetch_boundary_logs` sends them to the recovering neighbour stage, which checks them bit for bit;
- scalars: `fetch_scalars`, the survivor's scalar log to the recovering rank (`PersistedCheckpoint`).

(The recovery totals' all-reduce runs in section 3, inside a real restart.)

Every worker prints `shared_gpu rank=<r> check=<name> ok=<0|1> <detail>`; the parent collects the lines.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.gpu_check.shared_gpu [cuda|cpu]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from benchmarks.gpu_check.report import Check, Section, first_line
from benchmarks.gpu_check.runs import ROOT, why
from moevement.checkpoint.persisted import PersistedCheckpoint
from moevement.recovery.fetch import fetch_boundary_logs, fetch_scalars
from moevement.recovery.upstream_log import UpstreamLog
from moevement.storage.replication import ReplicaStore
from moevement.storage.snapshot_buffers import SnapshotBuffers
from moevement.topology import Topology
from trainer.records.tensorboard import StageGather

BACKEND = "cpu:gloo,cuda:gloo"
LINE = re.compile(r"^shared_gpu rank=(\d) check=(\S+) ok=([01]) (.*)$", re.M)
NOT_RUN = (
    "not run on one GPU: train.py with two ranks (its pipeline and FSDP send CUDA tensors point-to-point and "
    "all-gather/reduce-scatter them, which gloo does not carry and nccl refuses for two ranks on one GPU); "
    "nccl with several ranks; several nodes"
)


def tensorboard_gather(rank: int, device: torch.device) -> str:
    """Two stages' CUDA token counts and snapshot figures, gathered; returns the detail, raises if wrong."""
    gather = StageGather(n_layers=3, n_experts=4, n_stages=2, stage=rank)
    gather.add(1, {f"layers.{rank + 1}.moe": torch.arange(4, device=device) * (rank + 1)})
    tokens, moe, figures = gather.gather({rank + 1}, {"ckpt_mb": 10.0 + rank})
    expected = torch.zeros(3, 4, dtype=torch.float64)
    expected[1], expected[2] = torch.arange(4.0), torch.arange(4.0) * 2
    assert torch.equal(tokens.cpu(), expected), f"token counts {tokens.tolist()}"
    assert moe.tolist() == [False, True, True], f"MoE layers {moe.tolist()}"
    assert figures.view(2, -1)[:, 0].tolist() == [10.0, 11.0], f"figures {figures.tolist()}"
    return "CUDA token counts and snapshot figures of both stages gathered"


def stage_inputs(iteration: int, micro: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(1000 * iteration + micro)
    return torch.randn(2, 4, 16, device=device, generator=generator).requires_grad_()  # [batch, seq, dim]


def boundary_logs(rank: int, device: torch.device) -> str:
    """Stage 0 logs its CUDA outputs (pinned host copies), stage 1 fetches them for a replay of iterations 1-2."""
    torch.manual_seed(0)
    stage = torch.nn.Linear(16, 16).to(device)  # the same weights on both ranks
    log = UpstreamLog([stage], [rank], n_stages=2)
    for iteration in (1, 2):
        log.begin(iteration)
        for micro in (0, 1):
            stage(stage_inputs(iteration, micro, device)).sum().backward()
    log.begin(3)  # the previous iteration's host copies are complete
    pinned = all(t.is_pinned() for t in log.entries.values())
    assert pinned or device.type != "cuda", "the upstream log's host copies of CUDA tensors are not pinned"
    layout = Topology(rank, [0, 1], [0, 0], [0, 0], [[0], [1]])
    received = fetch_boundary_logs(log, layout, 2, scope={1}, t0=1, step=3)
    if rank == 1:
        assert len(received) == 4, f"{len(received)} boundary tensors received"
        for (_, iteration, _, micro), tensor in received.items():
            want = stage(stage_inputs(iteration, micro, device)).detach().cpu()
            assert torch.equal(tensor, want), f"activation of iteration {iteration} micro-batch {micro} differs"
    return f"activations logged in {'pinned' if pinned else 'pageable'} host memory and fetched bit for bit"


def scalars(rank: int, device: torch.device) -> str:
    """Rank 1 failed: `fetch_scalars` brings it rank 0's scalar log of iterations 1-2."""
    with tempfile.TemporaryDirectory() as tmp:
        rank_dir = Path(tmp)
        buffers = SnapshotBuffers(rank_dir, device, "normal")
        persisted = PersistedCheckpoint(rank_dir, rank, buffers, ReplicaStore(rank_dir / "replicas"))
        if rank == 0:
            for iteration in (1, 2):
                persisted.log_scalars(iteration, {"loss": 1.0 / iteration})
        got = fetch_scalars(SimpleNamespace(persisted=persisted), failed={1}, t0=1, step=3)
        buffers.close()
    assert got == {1: {"loss": 1.0}, 2: {"loss": 0.5}}, f"scalars {got}"
    return "the survivor's scalar log reached the failed rank"


def worker(device_type: str) -> None:
    """This process's part: every check, each reported on one line. `device_type` cpu (plain gloo) only
    exercises the same code without a GPU."""
    if device_type == "cuda":
        torch.cuda.set_device(0)  # both processes on the one GPU
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(BACKEND if device_type == "cuda" else "gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    for name, check in (("tensorboard", tensorboard_gather), ("boundary_logs", boundary_logs), ("scalars", scalars)):
        try:
            detail, ok = check(rank, device), 1
        except Exception as e:  # one failing collective path does not hide the next
            detail, ok = first_line(e), 0
        # one write per line: the two workers share a pipe, and print's text and newline could be split
        sys.stdout.write(f"shared_gpu rank={rank} check={name} ok={ok} {detail}\n")
        sys.stdout.flush()
    dist.destroy_process_group()


def run(section: Section) -> None:

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, "-m", "benchmarks.gpu_check.shared_gpu"], cwd=ROOT, capture_output=True, text=True, timeout=150
    )
    found = LINE.findall(proc.stdout)
    for rank, name, ok, detail in found:
        section.checks.append(Check(f"rank {rank} {name}", ok == "1", detail))
    if len(found) != 6:
        section.error = f"{len(found)} of 6 worker results (exit {proc.returncode}): {why(proc.stdout, proc.stderr)}"
    section.notes.append(NOT_RUN)


if __name__ == "__main__":
    worker(sys.argv[1] if len(sys.argv) > 1 else "cuda")
