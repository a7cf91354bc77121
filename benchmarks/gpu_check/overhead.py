"""Section 2: MoEvement on one GPU: snapshot copies into pinned host memory on the side stream, the stall
per iteration, and the overhead against `checkpoint.strategy none`, runs interleaved.

In process: a snapshot buffer is page-locked (pinned) on CUDA, a snapshot of CUDA tensors copied into it by
the checkpointer's own copy path (`SnapshotBuffers.issue`: side stream, device checksums) reads back bit for bit,
the copy bandwidth the profiler measures, what issuing a snapshot costs the training thread, call by call and
as one CUDA graph (`issue_cost`), and the trainer's graphed copy (`checkpoint.copy_graph`) reading back bit for
bit. Then `train.py` runs on the GPU, `none` and `moevement` alternating
for `ROUNDS` rounds; figures over the steady-state iterations (`benchmarks.overhead`'s definition). The
overhead is each round's moevement median against the same round's `none` median, printed as the median
over the rounds with the lowest and highest round beside it (`overhead_fields`): with five rounds a single
round's drift shows as spread instead of moving the median. Last, one `moevement` run takes snapshots only
in every other block of `AB_BLOCK` iterations (`checkpoint.ab_blocks`): each block's median against the next
block's, without snapshots, in the same process, resolves the snapshot's own cost where separate start-ups
spread by more than it; a second such run replays every snapshot's copy as a CUDA graph.
"""

from __future__ import annotations

import json
import statistics

import torch

from benchmarks.gpu_check.issue_cost import issue_cost
from benchmarks.gpu_check.report import Check, Section, guarded
from benchmarks.gpu_check.runs import ROOT, Workspace, train
from benchmarks.overhead import ab_medians, ab_ratios, common_start, recorded_steps, steady_ms, steady_records
from moevement.checkpoint.profiler import measure_copy_bandwidth
from moevement.storage.private_files import make_private_dirs
from moevement.storage.snapshot import SnapshotHeader, layout_of, read_entries
from moevement.storage.snapshot_buffers import SnapshotBuffers

CONFIG = "train_configs/bench_moe.toml"
BATCH, SEQ_LEN = 16, 512
SHAPE = ["--training.batch_size", str(BATCH), "--training.seq_len", str(SEQ_LEN), "--training.mixed_precision", "bf16"]
STEPS, ROUNDS, PROFILE_ITERS = 18, 5, 2  # 10 runs; steady from iteration 5 at W=1
# One run: 29 pairs of blocks (snapshots, none) from iteration 12, 87 iterations of each kind: iterations on an
# H200 vary by ±15%, and twice the 42 of each that measured +0.041 narrow its medians' spread by about 0.7x.
# The first block with snapshots (6-8) is left out: its first window reserves and pins the host buffers (about
# a second on an H200, once).
AB_BLOCK, AB_STEPS, AB_START, AB_TIMEOUT_S = 3, 186, 12, 120
RUN_TIMEOUT_S = 60


def _snapshot_sources(device: torch.device) -> list[torch.Tensor]:
    """Tensors of a snapshot: on the device (one larger than a staging chunk, one in bf16) and a step counter on
    the host."""
    return [
        torch.randn(1 << 20, device=device),
        torch.randn(333, 77, device=device).to(torch.bfloat16),
        torch.randn(21 << 20, device=device),  # 84 MB: a chunk of its own, larger than CHUNK_BYTES
        torch.tensor(5.0),  # a step counter on the host
    ]


def _issued_reads_back(buffers: SnapshotBuffers, sources: list[torch.Tensor], layout, iteration: int):
    """Issue a snapshot of `sources` (laid out as `layout`: entries, sources in order, bytes; the same objects
    at every call, so the buffer's plan is reused) through `buffers.issue` into buffer (0, 0), order a step
    after it and commit it: (its copy, its committed header, whether it reads back bit for bit with the
    device checksums recomputed on the CPU)."""
    entries, ordered, nbytes = layout
    header = SnapshotHeader(iteration, 1, 0, 1, 0, ["op"], [], entries, nbytes)
    buffer = buffers.buffer(0, 0)
    issued = buffers.issue(buffer, header, ordered)
    issued.order_step()
    commit = issued.result().with_meta({})
    committed = SnapshotHeader.from_json(json.loads(commit.encoded))  # the device's checksums
    back = read_entries(buffer.data, committed, source="pinned copy")  # recomputed on the CPU: equal
    return issued, committed, all(torch.equal(back[("master", f"t{i}")], t.cpu()) for i, t in enumerate(sources))


def _layout(sources: list[torch.Tensor]):
    """(entries, sources in layout order, bytes) of a snapshot of `sources` (as master entries of one operator)."""
    return layout_of([("op", f"t{i}", "master", t, t.dtype) for i, t in enumerate(sources)])


def pinned_copy(workspace: Workspace, device: torch.device) -> list[Check]:
    """A snapshot of CUDA tensors and a host step counter, issued through `SnapshotBuffers.issue` into a pinned
    buffer, read back with its device checksums recomputed on the CPU."""
    buffers = SnapshotBuffers(make_private_dirs(workspace.host_root, "pinned-copy"), device, "normal")
    try:
        sources = _snapshot_sources(device)
        _, committed, same = _issued_reads_back(buffers, sources, _layout(sources), 1)
        buffer = buffers.buffer(0, 0)
        return [
            Check("snapshot buffer pinned", buffer.data.is_pinned(), f"{buffer.capacity} bytes, cudaHostRegister"),
            Check(
                "side-stream copy reads back",
                same,
                f"{len(sources)} tensors, {len(committed.checksums)} chunks, {committed.checksum_format} "
                "checksums of the device recomputed on the CPU",
            ),
        ]
    finally:
        _release(buffers)


def graphed_copy(workspace: Workspace, device: torch.device) -> list[Check]:
    """The trainer's copy as a CUDA graph (`checkpoint.copy_graph`): three snapshots of the same tensors, each
    changed in place before it (as the optimizer changes them), issued call by call, then captured and
    replayed, then replayed; each reads back bit for bit."""
    buffers = SnapshotBuffers(make_private_dirs(workspace.host_root, "graphed-copy"), device, "normal", graphed=True)
    try:
        sources, same, captured = _snapshot_sources(device), [], []
        layout = _layout(sources)
        for iteration in (1, 2, 3):
            for t in sources:
                t.add_(1)
            issued, _, reads_back = _issued_reads_back(buffers, sources, layout, iteration)
            same.append(reads_back)
            captured.append(issued.plan.graph is not None)
        return [
            Check("copy captured as a CUDA graph at its second issue", captured == [False, True, True], f"{captured}"),
            Check("graphed copies read back, sources changed before each", all(same), f"{same}"),
        ]
    finally:
        _release(buffers)


def _release(buffers: SnapshotBuffers) -> None:
    for buf in buffers.all():
        buf.release()
    buffers.close()


def bandwidth(workspace: Workspace, device: torch.device, section: Section) -> list[Check]:
    gbps = measure_copy_bandwidth(make_private_dirs(workspace.host_root, "probe"), device) * 8 / 1e9
    section.notes.append(f"device-to-host copy bandwidth into snapshot memory: {gbps:.1f} Gbit/s")
    return []


def interleaved_runs(workspace: Workspace) -> dict[str, list[dict[int, dict[str, float]]]]:
    """Every round runs `none` and `moevement` (same config, same GPU), in alternating order (none first in
    even rounds), so a drift of the machine does not favour one of them."""
    runs: dict[str, list] = {"none": [], "moevement": []}
    for round_ in range(ROUNDS):
        for strategy in list(runs)[:: 1 if round_ % 2 == 0 else -1]:
            args = ["--config", CONFIG, *workspace.common(f"gpu_check_{strategy}"), *SHAPE]
            args += ["--training.steps", str(STEPS), "--checkpoint.strategy", strategy]
            runs[strategy].append(recorded_steps(train(args, RUN_TIMEOUT_S), ROOT))
    return runs


def overhead_fields(ratios: list[float], what: str = "interleaved rounds", name: str = "overhead") -> str:
    """`overhead=<median> (median of N interleaved rounds, min <x>, max <x>)` of the per-round ratios
    moevement/none (each minus 1: +0.05 is 5% slower than `none`)."""
    over = [r - 1 for r in ratios]
    return (
        f"{name}={statistics.median(over):+.4f} (median of {len(over)} {what}, "
        f"min {min(over):+.4f}, max {max(over):+.4f})"
    )


def in_process_checks(workspace: Workspace, section: Section, graphed: bool = False) -> list[Check]:
    """One moevement run at W=1 with snapshots in every other block of `AB_BLOCK` iterations (`graphed`: each
    snapshot's copy replayed as a CUDA graph, `checkpoint.copy_graph`)."""
    job, name = ("gpu_check_ab_graph", "ab_overhead_graph") if graphed else ("gpu_check_ab", "ab_overhead")
    args = ["--config", CONFIG, *workspace.common(job), *SHAPE, "--training.steps", str(AB_STEPS)]
    args += ["--checkpoint.strategy", "moevement", "--checkpoint.window", "1", "--checkpoint.ab_blocks", str(AB_BLOCK)]
    args += ["--checkpoint.copy_graph", str(graphed).lower()]
    records = recorded_steps(train(args, AB_TIMEOUT_S), ROOT)
    ratios = ab_ratios(records, AB_BLOCK, AB_START, BATCH * SEQ_LEN)
    with_ms, without_ms = ab_medians(records, AB_START, BATCH * SEQ_LEN)
    section.notes.append(
        f"{overhead_fields(ratios, 'block pairs in one process', name)} "
        f"iter_ms with={with_ms:.1f} without={without_ms:.1f} "
        f"pairs: {' '.join(f'{r - 1:+.3f}' for r in ratios)}"
    )
    return [Check("in-process block pairs", len(ratios) >= 5, f"{len(ratios)} pairs of {AB_BLOCK} iterations")]


def overhead_checks(workspace: Workspace, section: Section) -> list[Check]:
    runs = interleaved_runs(workspace)
    tokens = BATCH * SEQ_LEN
    start = common_start((r for rs in runs.values() for r in rs), PROFILE_ITERS)  # the same iterations for both
    per_round = {
        s: [statistics.median(steady_ms(r, PROFILE_ITERS, tokens, start)) for r in rs] for s, rs in runs.items()
    }
    ratios = [m / n for m, n in zip(per_round["moevement"], per_round["none"])]
    steady = [rec for r in runs["moevement"] for rec in steady_records(r, PROFILE_ITERS, start)]
    stalls = [rec["stall_ms"] for rec in steady]
    snapshot_mb = statistics.mean(rec["ckpt_mb"] for rec in steady)
    none_ms, moevement_ms = statistics.median(per_round["none"]), statistics.median(per_round["moevement"])
    windows = ",".join(sorted({str(int(rec["window"])) for rec in steady}))
    section.notes.append(
        f"iter_ms none={none_ms:.1f} moevement={moevement_ms:.1f} {overhead_fields(ratios)} "
        f"rounds: {' '.join(f'{r - 1:+.3f}' for r in ratios)} "
        f"stall_ms median={statistics.median(stalls):.2f} "
        f"max={max(stalls):.2f} snapshot_mb_per_iter={snapshot_mb:.1f} window={windows}"
    )
    every = all(rec["ckpt_mb"] > 0 for rec in steady)
    return [Check("moevement snapshots every steady iteration", every, f"{len(steady)} iterations")]


def run(section: Section) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    workspace = Workspace()
    try:
        guarded(section, "pinned snapshot copy", lambda: pinned_copy(workspace, device))
        guarded(section, "copy bandwidth", lambda: bandwidth(workspace, device, section))
        guarded(section, "snapshot issue as a CUDA graph", lambda: issue_cost(workspace, device, section))
        guarded(section, "interleaved none/moevement runs", lambda: overhead_checks(workspace, section))
        guarded(section, "snapshots on and off in one process", lambda: in_process_checks(workspace, section))
        guarded(section, "the copy as a CUDA graph", lambda: graphed_copy(workspace, device))
        guarded(
            section,
            "graphed snapshots on and off in one process",
            lambda: in_process_checks(workspace, section, graphed=True),
        )
    finally:
        workspace.close()
