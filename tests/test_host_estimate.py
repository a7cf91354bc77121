"""`train.py --dry-run`'s per-rank host-memory estimate against what runs hold (trainer/estimates/host_estimate.py).

Bound tested: a real run's bytes in the host directory (whole pages, as tmpfs counts them) are at most the
estimate, and the estimate at most 1.25 times them. With a forced window the estimate differs from a
fault-free run only in slot 0 under the registry order (the order after a recovery's reset), and in its
allowance for commit records. The same bound holds for a node (every file counted once: a replica of a
same-node sender is a link to its buffer). The GPU lines (pinned host memory, the
hash's CPU time, node limits and their warnings) are checked against arithmetic on the debug config.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from moevement.checkpoint.profiler import PROBE_BYTES
from moevement.recovery.live_state import keep_in_memory, save_kept
from tests.helpers import DEBUG_CONFIG, run_cli, stepped_operators
from trainer.config import load_config
from trainer.estimates import host_estimate

HOST_LINE = re.compile(r"^host_memory rank=(\d+) pp=\d+ snapshots=(\S+) replicas=(\S+) .*$", re.M)
LOOSEST = 1.25


HUGE = host_estimate.Limit(1 << 60, "test: no limit")
TINY = host_estimate.Limit(4096, "test: tiny")


def allocated(directory: Path) -> int:
    """Bytes the files under `directory` occupy (whole pages: what counts against /dev/shm)."""
    return sum(os.lstat(Path(d, f)).st_blocks * 512 for d, _, files in os.walk(directory) for f in files)


def allocated_once(directory: Path) -> int:
    """Like `allocated`, a file with several names (hard links) counted once."""
    inodes = {}
    for d, _, files in os.walk(directory):
        for f in files:
            st = os.lstat(Path(d, f))
            inodes[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(inodes.values())


def printed_buffers(args: list[str]) -> dict[int, float]:
    """rank -> snapshot + replica GB, as `train.py --dry-run` prints them."""
    out = run_cli(*args, "--dry-run").stdout
    return {int(rank): float(snaps) + float(replicas) for rank, snaps, replicas in HOST_LINE.findall(out)}


@pytest.mark.parametrize(
    "layout, nproc",
    [
        (["--parallelism.pp", "2"], 2),
        (["--parallelism.dp", "2", "--parallelism.ep", "2", "--training.mixed_precision", "bf16"], 2),
    ],
    ids=["pp2", "dp2-ep2-bf16"],
)
@pytest.mark.slow
def test_dry_run_bounds_the_host_directory_of_a_real_run(tmp_path, layout, nproc):
    host_dir = tmp_path / "shm"
    moevement = "--checkpoint.strategy moevement --checkpoint.window 3 --model.n_layers 4".split()
    args = ["--config", DEBUG_CONFIG, *layout, *moevement, "--checkpoint.host_dir", str(host_dir)]
    run = ["--checkpoint.keep_host_state", "true", "--training.steps", "12", "--metrics.tensorboard", "false"]
    run_cli(*args, *run, "--training.val_every", "0", nproc=nproc)
    ranks = host_estimate.estimate(load_config(DEBUG_CONFIG, args[2:]))
    printed = printed_buffers(args)
    assert sorted(printed) == [r.rank for r in ranks] == list(range(nproc))
    for r in ranks:
        bound = r.snapshots + r.replicas
        assert abs(printed[r.rank] - bound / 1e9) <= 0.0011  # two GB figures of 3 decimals
        actual = allocated(host_dir / "debug_moe" / f"rank{r.rank:05d}")
        assert 0 < actual <= bound <= LOOSEST * actual, (r.rank, actual, bound)
    node = sum(r.snapshots + r.replicas - r.linked for r in ranks)  # one node: every replica is a link
    assert 0 < (actual := allocated_once(host_dir / "debug_moe")) <= node <= LOOSEST * actual, (actual, node)


def test_live_state_estimate_bounds_a_saved_live_state(tmp_path):
    """A survivor's live state (FP32 state, no upstream log at pp=1), written by the trainer's own function."""
    cfg = load_config(DEBUG_CONFIG, ["--checkpoint.strategy", "moevement", "--checkpoint.window", "3"])
    ops, optimizer = stepped_operators(cfg)
    save_kept(tmp_path, keep_in_memory(ops, optimizer, None, {}, 2, 1, {}, {"rank": 0}))
    actual = allocated(tmp_path)
    bound = host_estimate.stage_footprint(cfg, 0).live_state(0)
    assert actual <= bound <= LOOSEST * actual, (actual, bound)


def test_no_host_state_without_a_strategy_and_dense_baselines_hold_no_live_state():
    cfg = load_config(DEBUG_CONFIG, [])
    assert host_estimate.report(cfg) == ["host memory: none (checkpoint.strategy none keeps no host state)"]
    gemini = host_estimate.estimate(load_config(DEBUG_CONFIG, ["--checkpoint.strategy", "gemini"]))
    checkfreq = host_estimate.estimate(load_config(DEBUG_CONFIG, ["--checkpoint.strategy", "checkfreq"]))
    assert gemini[0].live_state == checkfreq[0].live_state == 0
    assert gemini[0].snapshots == checkfreq[0].snapshots > 0  # one dense slot, two parities


def test_node_lines_sum_the_ranks_of_each_node_of_eight():
    """16 ranks (pp=2, dp=8): two nodes of eight consecutive ranks; replicas prefer other nodes."""
    layout = ["--parallelism.pp", "2", "--parallelism.dp", "8", "--training.batch_size", "16"]
    moevement = ["--checkpoint.strategy", "moevement", "--checkpoint.window", "2", "--checkpoint.replicas", "1"]
    cfg = load_config(DEBUG_CONFIG, [*layout, *moevement])
    ranks = host_estimate.estimate(cfg)
    lines = host_estimate.node_lines(ranks, host_estimate.RANKS_PER_NODE, HUGE, HUGE)
    assert "8 ranks per node assumed" in lines[0] and len(lines) == 3
    for node, line in enumerate(lines[1:]):
        members = ranks[8 * node : 8 * node + 8]
        host_dir = sum(r.host_dir - r.linked for r in members)
        assert line.startswith(f"host_memory node={node} ranks={8 * node}-{8 * node + 7} ")
        assert f"host_dir={host_estimate.gb(host_dir)} " in line and host_dir > 0
    one_node = host_estimate.estimate(cfg, ranks_per_node=16)
    assert sum(r.replicas for r in ranks) == sum(r.replicas for r in one_node)  # the same bytes, placed elsewhere


def pp2_config(*extra: str):
    """debug_moe on two pipeline ranks (one node), W=2, one replica each; a micro-batch of 4x96x64 FP32
    boundary values (98304 bytes, which PyTorch pins as 131072)."""
    moevement = ["--checkpoint.strategy", "moevement", "--checkpoint.window", "2", "--checkpoint.replicas", "1"]
    return load_config(DEBUG_CONFIG, ["--parallelism.pp", "2", "--training.seq_len", "96", *moevement, *extra])


def test_gpu_lines_pin_snapshots_probe_and_power_of_two_log_blocks():
    cfg = pp2_config()
    ranks = host_estimate.estimate(cfg)
    log_iterations, micro_batches = 2 * 2 + 1, cfg.training.micro_batches
    assert host_estimate.boundary_log(cfg, [0])[0] == micro_batches * 4 * 96 * 64 * 4
    lines = host_estimate.gpu_lines(ranks)
    assert "page-locked" in lines[0] and "replicas and live state are not pinned" in lines[0]
    for r, line in zip(ranks, lines[1:3]):
        assert r.upstream_log == log_iterations * micro_batches * 98304
        assert r.pinned_log == log_iterations * micro_batches * 131072
        assert r.pinned == r.snapshots + host_estimate.pages(PROBE_BYTES) + r.pinned_log
        assert line == (
            f"pinned_host pp={r.pp_rank} ranks={r.rank} snapshots={host_estimate.gb(r.snapshots)} "
            f"probe={host_estimate.gb(r.probe)} upstream_log={host_estimate.gb(r.pinned_log)} "
            f"pinned={host_estimate.gb(r.pinned)}"
        )
    assert len(lines) == 3


def test_same_node_replicas_are_links_under_auto_replication_only():
    """Each of the two ranks holds the other's replica: a link on one node, a copy over the network."""
    ranks = host_estimate.estimate(pp2_config())
    stages = [host_estimate.stage_footprint(pp2_config(), pp) for pp in (0, 1)]
    for r, sender in zip(ranks, reversed(stages)):
        assert r.replicas == 2 * sum(sender.slot_bytes) > r.linked == r.replicas - sender.linked_replica() > 0
        assert r.node_share == r.host_dir - r.linked + r.upstream_log
    network = host_estimate.estimate(pp2_config("--checkpoint.replication", "network"))
    apart = host_estimate.estimate(pp2_config(), ranks_per_node=1)
    assert [r.linked for r in network] == [r.linked for r in apart] == [0, 0]


def test_node_lines_warn_where_memory_or_host_dir_is_short():
    ranks = host_estimate.estimate(pp2_config())
    host_dir = sum(r.host_dir - r.linked for r in ranks)
    total, pinned = host_dir + sum(r.upstream_log for r in ranks), sum(r.pinned for r in ranks)
    gb = host_estimate.gb
    fine = host_estimate.node_lines(ranks, 8, HUGE, HUGE)
    assert fine[1:] == [
        f"host_memory node=0 ranks=0-1 host_dir={gb(host_dir)} upstream_log={gb(total - host_dir)} "
        f"total={gb(total)} pinned={gb(pinned)}"
    ]
    assert f"node memory {gb(HUGE.nbytes)} (test: no limit); host dir file system {gb(HUGE.nbytes)}" in fine[0]
    short = host_estimate.node_lines(ranks, 8, TINY, TINY)
    assert short[2:] == [
        f"WARNING: node 0 needs {gb(total)} GB of host memory ({gb(pinned)} GB of it page-locked on GPU), "
        "more than its 0.000 GB (test: tiny)",
        f"WARNING: node 0 keeps {gb(host_dir)} GB in its host directory, more than the 0.000 GB of test: tiny "
        "(container: raise --shm-size)",
    ]
    no_fs = host_estimate.node_lines(ranks, 8, host_estimate.Limit(total - 1, "test"), None)
    assert [line.startswith("WARNING: node 0 needs") for line in no_fs[1:]] == [False, True]


def test_report_holds_nodes_against_this_machines_memory(monkeypatch):
    """Without a config key for it, a node's memory is this machine's MemTotal, and the report says so."""
    memory = host_estimate.node_memory()
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        kib = next(int(line.split()[1]) for line in meminfo.read_text().splitlines() if line.startswith("MemTotal:"))
        assert memory.nbytes == kib * 1024 and "MemTotal" in memory.source
    lines = host_estimate.report(pp2_config())
    assert not any(line.startswith("WARNING: node 0 needs") for line in lines)  # a few MB fit any machine
    monkeypatch.setattr(host_estimate, "node_memory", lambda: TINY)
    assert any(line.startswith("WARNING: node 0 needs") for line in host_estimate.report(pp2_config()))


def test_hashing_lines_time_the_largest_snapshot_of_a_rank_and_of_a_node(monkeypatch):
    monkeypatch.setattr(host_estimate, "checksum_gbps", lambda: 2.0)
    ranks = host_estimate.estimate(pp2_config())
    per_rank = [max(host_estimate.stage_footprint(pp2_config(), pp).slot_bytes) for pp in (0, 1)]
    assert [r.snapshot_per_iteration for r in ranks] == per_rank
    (line,) = host_estimate.hashing_lines(ranks, 8)
    assert line.startswith(
        f"snapshot_hash per_rank_max_gb_per_iteration={host_estimate.gb(max(per_rank))} "
        f"core_s_per_iteration={max(per_rank) / 2e9:.3f} node_max_core_s_per_iteration={sum(per_rank) / 2e9:.3f} "
        "(XXH3-64 at 2.0 GB/s"
    )
