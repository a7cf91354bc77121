"""Per-rank host-memory estimate of a config and layout, for `train.py --dry-run` (no process group).

What a rank keeps in its host directory (`checkpoint.host_dir`, by default in /dev/shm, so a container's
`--shm-size` must hold it) and, apart, in its own process memory:

- snapshots: its snapshot buffers, two sets (window parity) of one buffer per slot. A buffer only grows, so
  slot i's buffer is the largest snapshot slot i ever takes: over every window size Algorithm 1 may choose
  (`checkpoint.window`, else 1..`checkpoint.max_window`) and both operator orders (the registry order of
  the first window, popularity order after: routed experts first; experts are all of one size, so which
  expert goes where does not change a size). An interval baseline's snapshot is one slot of every
  operator's FP32 state (dense; MoC's partial ones are smaller).
- replicas: the same buffers of the ranks whose snapshots it holds (`checkpoint.replicas` peers each,
  chosen as `moevement.topology` chooses them, consecutive ranks sharing a node, `RANKS_PER_NODE` each).
- live state: what a survivor of a peer's death keeps for a torchrun restart (MoEvement): its FP32 state
  and its upstream log.
- bandwidth probe: the scratch buffer of the copy-bandwidth measurement (start-up, reprofiling).
- upstream log (process memory, pinned on GPU): the activations and gradients a pipeline stage sends,
  kept from the persisted window's first iteration: up to 2W + 1 iterations.

What a GPU run needs beyond those bytes (`gpu_lines`): page-locked host memory (its own snapshot buffers
of both parities and the probe, `HostBuffer(pin=True)`; the upstream log, PyTorch's pinned allocations,
each rounded up to a power of two by its caching host allocator; replicas and the live state are not
pinned); the device staging ring is accelerator memory (`memory_estimate`). Per node: its ranks'
bytes against the node's memory and its host directory's file system. A replica held on the sender's node
(`checkpoint.replication` auto) is a hard link to the sender's buffer file: its node counts only its
commit records.

Every size comes from the functions the trainer sizes things with: the model built on meta and cut as
`parallelisms` cuts it (data-parallel rank 0's shards, the largest), the registry of operators, the
snapshot layout (entries padded to blocks), the window schedule and the pipeline's boundary shapes. Files
are counted in whole pages, and each buffer's JSON commit record at most `HEADER_ENTRY_BYTES` per entry.
Upper bounds: the test holds them against a real run's host directory.
"""

from __future__ import annotations

import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models import Transformer
from models.moe import MoE
from moevement.checkpoint.profiler import PROBE_BYTES
from moevement.checkpoint.reservation import operator_layout_bytes, slot_bytes
from moevement.operators import build_registry
from moevement.storage.private_files import default_host_dir
from moevement.storage.snapshot import checksum_gbps, layout_of
from moevement.topology import Topology
from parallelisms.expert_parallel import shard_experts
from parallelisms.fsdp import DTYPES, largest_shard_on_meta
from parallelisms.parallelize import ModelView, stage_shapes
from parallelisms.pipeline import local_stage_ids, split_model
from trainer.config import Config
from trainer.model_operators import stacked_operators

HEADER_ENTRY_BYTES = (
    320  # a commit record's JSON per entry: operator, name, dtype, shape, offsets (and chunk checksums)
)
HEADER_BASE_BYTES = 16 << 10  # and its fixed part: the job's identity, the iteration's scalars
# Ranks (GPUs) per node of the launch layout: the config has no key for it (torchrun's --nproc_per_node sets
# it at launch), so the estimate assumes a node of 8, as on DGX/HGX H100 machines, and says so.
RANKS_PER_NODE = 8


def pages(nbytes: int) -> int:
    """Bytes a file of `nbytes` occupies in a memory file system (whole pages)."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


@dataclass
class Stage:
    """What one pipeline rank's operators need (its data-parallel rank 0, which holds the largest shards)."""

    slot_bytes: list[int]  # per slot: its largest buffer, in pages, commit record included (one parity)
    fp32: tuple[int, int]  # (bytes, entries) of every operator's FP32 state laid out as one snapshot
    log: tuple[int, int, int]  # one iteration's upstream log: (bytes, bytes laid out as a snapshot, entries)
    log_pinned: int = 0  # one iteration's upstream log as PyTorch pins it (each tensor's size a power of two)
    record: int = 0  # pages of the largest commit record a slot may have (every entry of the stage)

    def dense_slot(self) -> int:
        """A dense snapshot (an interval baseline's slot), in pages, commit record included."""
        return _file(self.fp32[0], self.fp32[1])

    def live_state(self, log_iterations: int) -> int:
        """A survivor's live state: its FP32 state and `log_iterations` iterations of upstream log."""
        return _file(self.fp32[0] + self.log[1] * log_iterations, self.fp32[1] + self.log[2] * log_iterations)

    def linked_replica(self) -> int:
        """A replica of this stage's buffers (both parities) held on the sender's node: hard links to the
        sender's files, so only its commit records take pages of their own."""
        return 2 * len(self.slot_bytes) * self.record


def _record(entries: int) -> int:
    """Pages of a commit record of `entries` entries."""
    return pages(HEADER_BASE_BYTES + HEADER_ENTRY_BYTES * entries)


def _file(nbytes: int, entries: int) -> int:
    """Pages of a buffer of `nbytes` (at least 1) and of its commit record of `entries` entries."""
    return pages(max(nbytes, 1)) + _record(entries)


def pinned_size(nbytes: int) -> int:
    """Bytes PyTorch's caching host allocator pins for `nbytes` (its default: the next power of two)."""
    return 1 << max(nbytes - 1, 0).bit_length()


@dataclass
class RankEstimate:
    """One rank's bytes (upper bounds), by what holds them; see the module docstring."""

    rank: int
    pp_rank: int
    snapshots: int
    replicas: int
    live_state: int
    probe: int
    upstream_log: int  # process memory, not in the host directory
    snapshot_per_iteration: int = 0  # the largest snapshot it copies and hashes in one iteration
    linked: int = 0  # of `replicas`: bytes that are hard links to a same-node sender's buffer files
    pinned_log: int = 0  # `upstream_log` as PyTorch pins it on GPU

    @property
    def host_dir(self) -> int:
        """Bytes this rank may hold in its host directory at once."""
        return self.snapshots + self.replicas + self.live_state + self.probe

    @property
    def node_share(self) -> int:
        """What this rank adds to its node's memory: `host_dir` without the pages it links, its upstream log."""
        return self.host_dir - self.linked + self.upstream_log

    @property
    def pinned(self) -> int:
        """Page-locked host bytes on GPU: its snapshot buffers, the probe, the upstream log's pinned blocks."""
        return self.snapshots + self.probe + self.pinned_log


def rank_model(cfg: Config, pp_rank: int) -> tuple[nn.Module, list[int]]:
    """(this pipeline rank's model on meta, under global names, as data-parallel rank 0 holds it; its stage ids)."""
    p = cfg.parallelism
    with torch.device("meta"):
        whole = Transformer(cfg.model)
    stage_ids, parts = split_model(whole, p, pp_rank)
    for part in parts:
        if p.ep > 1:
            for moe in [m for m in part.modules() if isinstance(m, MoE)]:
                shard_experts(moe, 0, p.ep)
        largest_shard_on_meta(part, p)
    return (parts[0] if len(parts) == 1 else ModelView(parts)), stage_ids


def adamw_state_on_meta(model: nn.Module) -> torch.optim.Optimizer:
    """An AdamW over `model`'s parameters with the state one step gives them (step, both moments), on meta."""
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params)
    for p in params:
        optimizer.state[p] = {
            "step": torch.zeros((), dtype=torch.float32, device="meta"),
            "exp_avg": torch.empty_like(p),
            "exp_avg_sq": torch.empty_like(p),
        }
    return optimizer


def boundary_log(cfg: Config, stage_ids: list[int]) -> tuple[int, int, int, int]:
    """One iteration of the upstream log on a rank running `stage_ids` (none without pipelining): every
    micro-batch's activations sent downstream and gradients sent upstream, as `UpstreamLog` keeps them.
    (bytes, bytes laid out as a live state lays them out, entries, bytes pinned on GPU: `pinned_size` each)."""
    p, t = cfg.parallelism, cfg.training
    n_stages = p.pp * p.stages_per_rank
    if n_stages == 1:
        return 0, 0, 0, 0
    micro_batch = (t.batch_size // (t.micro_batches * p.dp), t.seq_len)
    shapes = stage_shapes(cfg.model, micro_batch, DTYPES[t.mixed_precision], n_stages, t.loss_chunk_tokens > 0)
    sent = []
    for stage in stage_ids:
        inputs, outputs = shapes(stage)
        sent += ([outputs] if stage != n_stages - 1 else []) + ([inputs] if stage != 0 else [])
    tensors = sent * t.micro_batches
    laid_out = layout_of([("", str(i), "log", x, x.dtype) for i, x in enumerate(tensors)])[2]
    sizes = [x.numel() * x.element_size() for x in tensors]
    return sum(sizes), laid_out, len(tensors), sum(pinned_size(n) for n in sizes)


def stage_footprint(cfg: Config, pp_rank: int) -> Stage:
    """What pipeline rank `pp_rank`'s operators and boundaries need under `cfg` (see `Stage`)."""
    model, stage_ids = rank_model(cfg, pp_rank)
    optimizer = adamw_state_on_meta(model)
    ops = build_registry(model, stacked_operators(model))
    sizes = operator_layout_bytes(ops, optimizer, DTYPES[cfg.training.mixed_precision])
    *log, log_pinned = boundary_log(cfg, stage_ids)
    entries = sum(sizes.fp32_entries) + sum(sizes.compute_entries)
    stage = Stage([], (sum(sizes.fp32), sum(sizes.fp32_entries)), tuple(log), log_pinned, _record(entries))
    ck = cfg.checkpoint
    if ck.strategy == "moevement":  # every window size Algorithm 1 may choose, a slot's buffer its largest snapshot
        window_sizes = [ck.window] if ck.window else range(1, ck.max_window + 1)
        stage.slot_bytes = slot_bytes(ops, sizes, window_sizes, ck.slots, cost=_file)
    else:
        stage.slot_bytes = [stage.dense_slot()]
    return stage


def replicas_in_memory(cfg: Config) -> int:
    """Peers holding a copy of each rank's snapshots in memory (CheckFreq and MoC keep none)."""
    ck = cfg.checkpoint
    return 0 if ck.strategy in ("none", "checkfreq", "moc") else ck.replicas


def dry_run_topology(cfg: Config, ranks_per_node: int = RANKS_PER_NODE) -> Topology:
    """Rank 0's topology of `cfg`'s layout: ranks laid out as `parallelisms.mesh` lays them out, node n running
    ranks n * ranks_per_node .. (no config key names a node's size)."""
    p = cfg.parallelism
    world = p.pp * p.dp
    return Topology(
        0,
        [r // p.dp for r in range(world)],
        [r % p.dp for r in range(world)],
        [r // ranks_per_node for r in range(world)],
        [local_stage_ids(p, q) for q in range(p.pp)],
    )


def estimate(cfg: Config, ranks_per_node: int = RANKS_PER_NODE) -> list[RankEstimate]:
    """Every rank's host memory under `cfg` (ranks laid out as `parallelisms.mesh` lays them out, node n
    running ranks n * ranks_per_node ..; replicas whose sender shares the node are links under
    `checkpoint.replication` auto)."""
    p, ck = cfg.parallelism, cfg.checkpoint
    stages = [stage_footprint(cfg, pp) for pp in range(p.pp)]
    topo = dry_run_topology(cfg, ranks_per_node)
    world, pp_of, nodes = topo.world, topo.pp_of, topo.node_of
    holds_for: list[list[int]] = [[] for _ in range(world)]  # the ranks whose replicas each rank holds
    for src, held_by in enumerate(topo.replica_peers(replicas_in_memory(cfg))):
        for rank in held_by:
            holds_for[rank].append(src)
    own = [2 * sum(stage.slot_bytes) for stage in stages]  # both window parities
    moevement = ck.strategy == "moevement"
    log_iters = 2 * (ck.window or ck.max_window) + 1
    out = []
    for rank in range(world):
        stage = stages[pp_of[rank]]
        sources = holds_for[rank]
        held = sum(own[pp_of[src]] for src in sources)
        local = [src for src in sources if nodes[src] == nodes[rank] and ck.replication == "auto"]
        linked = sum(own[pp_of[src]] - stages[pp_of[src]].linked_replica() for src in local)
        log, live = (stage.log[0] * log_iters, stage.live_state(log_iters)) if moevement else (0, 0)
        pinned_log = stage.log_pinned * log_iters if moevement else 0
        own_bytes, per_iteration = own[pp_of[rank]], max(stage.slot_bytes, default=0)
        out.append(
            RankEstimate(
                rank, pp_of[rank], own_bytes, held, live, pages(PROBE_BYTES), log, per_iteration, linked, pinned_log
            )
        )
    return out


def gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f}"


def report(cfg: Config) -> list[str]:
    """The dry run's host-memory lines."""
    p, ck = cfg.parallelism, cfg.checkpoint
    if ck.strategy == "none":
        return ["host memory: none (checkpoint.strategy none keeps no host state)"]
    ranks = estimate(cfg)
    window = (
        f"W={ck.window}"
        if ck.window
        else (
            f"W<={ck.max_window}: Algorithm 1 may choose any, a slot's buffer keeps its largest size; "
            "checkpoint.window fixes W and lowers this"
        )
    )
    host_dir = ck.host_dir or default_host_dir()
    lines = [
        f"host memory per rank, GB (upper bounds; strategy={ck.strategy} pp={p.pp} dp={p.dp} ep={p.ep} "
        f"{window if ck.strategy == 'moevement' else 'dense W=1'} replicas={ck.replicas}; host_dir {host_dir}):"
    ]
    for r in ranks:
        lines.append(
            f"host_memory rank={r.rank} pp={r.pp_rank} snapshots={gb(r.snapshots)} replicas={gb(r.replicas)} "
            f"live_state={gb(r.live_state)} probe={gb(r.probe)} host_dir={gb(r.host_dir)} "
            f"upstream_log={gb(r.upstream_log)}"
        )
    most, total = max(r.host_dir for r in ranks), sum(r.host_dir for r in ranks)
    node_most = max(sum(r.host_dir - r.linked for r in members) for members in nodes_of(ranks, RANKS_PER_NODE))
    lines.append(
        f"host_memory per_rank_max={gb(most)} all_{len(ranks)}_ranks={gb(total)}: a node's {host_dir} must hold "
        "the sum over the ranks it runs less the replicas that link a same-node sender's files, its host_dir "
        f"below (container: --shm-size of at least the largest, e.g. {-(-node_most // 2**30) + 1}g); "
        "upstream_log is process memory (pinned on GPU), not in it"
    )
    limits = node_memory(), host_dir_limit(host_dir)
    return lines + gpu_lines(ranks) + node_lines(ranks, RANKS_PER_NODE, *limits) + hashing_lines(ranks, RANKS_PER_NODE)


def gpu_lines(ranks: list[RankEstimate]) -> list[str]:
    """What a GPU run's snapshots pin in host memory, per pipeline rank (its data-parallel ranks, consecutive,
    share the figures)."""
    lines = [
        "pinned host memory per rank on GPU, GB (page-locked, part of host_memory above: its snapshot buffers "
        "of both window parities and the bandwidth probe, HostBuffer(pin=True) in the host directory, and the "
        "upstream log, PyTorch's pinned blocks of a power of two each; replicas and live state are not pinned):"
    ]
    for pp in sorted({r.pp_rank for r in ranks}):
        members = [r for r in ranks if r.pp_rank == pp]
        first, last, r = members[0].rank, members[-1].rank, members[0]
        lines.append(
            f"pinned_host pp={pp} ranks={first}{f'-{last}' if last > first else ''} snapshots={gb(r.snapshots)} "
            f"probe={gb(r.probe)} upstream_log={gb(r.pinned_log)} pinned={gb(r.pinned)}"
        )
    return lines


@dataclass
class Limit:
    """What a node's bytes are held against: a size in bytes and where that figure comes from."""

    nbytes: int
    source: str


def node_memory() -> Limit:
    """A node's memory: this machine's MemTotal (/proc/meminfo; elsewhere its physical pages), since no
    config key or flag names the memory of the nodes a job is launched on."""
    why = "no config key names a node's memory"
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return Limit(int(line.split()[1]) * 1024, f"this machine's MemTotal in /proc/meminfo: {why}")
    return Limit(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), f"this machine's memory: {why}")


def host_dir_limit(host_dir: str) -> Limit | None:
    """The size of the file system `host_dir` lives on, on this machine (the first directory of `host_dir`,
    its parent and /dev/shm that exists; None if none does)."""
    shm = next((d for d in (Path(host_dir), Path(host_dir).parent, Path("/dev/shm")) if d.is_dir()), None)
    return None if shm is None else Limit(shutil.disk_usage(shm).total, f"the file system of {shm} on this machine")


def nodes_of(ranks: list[RankEstimate], per_node: int) -> list[list[RankEstimate]]:
    """`ranks` cut into nodes of `per_node` consecutive ranks (the last may have fewer)."""
    return [ranks[i : i + per_node] for i in range(0, len(ranks), per_node)]


def node_lines(ranks: list[RankEstimate], per_node: int, memory: Limit, host_fs: Limit | None) -> list[str]:
    """Per node of the launch layout (`per_node` consecutive ranks): its ranks' host bytes (host directory
    without same-node replica links, upstream log, their total, the pinned part), and a WARNING where the
    total exceeds `memory` or the host-directory bytes exceed `host_fs`."""
    fs = f"; host dir file system {gb(host_fs.nbytes)} ({host_fs.source})" if host_fs else ""
    lines = [
        f"host memory per node, GB ({per_node} ranks per node assumed: no config key names it, torchrun's "
        "--nproc_per_node does; replicas placed for that layout, those from the same node are links to the "
        f"sender's files; pinned: page-locked on GPU, part of total; node memory {gb(memory.nbytes)} "
        f"({memory.source}){fs}):"
    ]
    for node, members in enumerate(nodes_of(ranks, per_node)):
        total, log = sum(r.node_share for r in members), sum(r.upstream_log for r in members)
        host_dir, pinned = total - log, sum(r.pinned for r in members)
        lines.append(
            f"host_memory node={node} ranks={members[0].rank}-{members[-1].rank} host_dir={gb(host_dir)} "
            f"upstream_log={gb(log)} total={gb(total)} pinned={gb(pinned)}"
        )
        if total > memory.nbytes:
            lines.append(
                f"WARNING: node {node} needs {gb(total)} GB of host memory ({gb(pinned)} GB of it "
                f"page-locked on GPU), more than its {gb(memory.nbytes)} GB ({memory.source})"
            )
        if host_fs is not None and host_dir > host_fs.nbytes:
            lines.append(
                f"WARNING: node {node} keeps {gb(host_dir)} GB in its host directory, more than the "
                f"{gb(host_fs.nbytes)} GB of {host_fs.source} (container: raise --shm-size)"
            )
    return lines


def hashing_lines(ranks: list[RankEstimate], per_node: int) -> list[str]:
    """What checksumming the snapshots costs per iteration on a CPU run (XXH3-64 measured on one core of this
    machine's CPU): a rank's copy thread at most, and a node's `per_node` consecutive ranks' at most. A GPU
    run checksums on the device, beside the copy (`moevement.storage.word_checksum`): no CPU."""
    gbps = checksum_gbps()
    most = max(r.snapshot_per_iteration for r in ranks)
    node = max(sum(r.snapshot_per_iteration for r in members) for members in nodes_of(ranks, per_node))
    return [
        f"snapshot_hash per_rank_max_gb_per_iteration={gb(most)} core_s_per_iteration={most / 1e9 / gbps:.3f} "
        f"node_max_core_s_per_iteration={node / 1e9 / gbps:.3f} (XXH3-64 at {gbps:.1f} GB/s on one core of this "
        "CPU, on each rank's copy thread beside training; on a GPU the checksums are computed on the device: no "
        "CPU)"
    ]
