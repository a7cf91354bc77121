"""`train.py --dry-run`'s per-rank host-memory estimate against what real runs hold (trainer/run/host_estimate.py).

Bound tested: a real run's bytes in the host directory (whole pages, as tmpfs counts them) are at most the
estimate, and the estimate at most 1.25 times them. With a forced window the estimate differs from a
fault-free run only in slot 0 under the registry order (the order after a recovery's reset), and in its
allowance for commit records.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from moevement.recovery.live_state import keep_in_memory, save_kept
from tests.helpers import DEBUG_CONFIG, run_cli, stepped_operators
from trainer.config import load_config
from trainer.run import host_estimate

HOST_LINE = re.compile(r"^host_memory rank=(\d+) pp=\d+ snapshots=(\S+) replicas=(\S+) .*$", re.M)
LOOSEST = 1.25


def allocated(directory: Path) -> int:
    """Bytes the files under `directory` occupy (whole pages: what counts against /dev/shm)."""
    return sum(os.lstat(Path(d, f)).st_blocks * 512 for d, _, files in os.walk(directory) for f in files)


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
    lines = host_estimate.node_lines(ranks, host_estimate.RANKS_PER_NODE)
    assert "8 ranks per node assumed" in lines[0] and len(lines) == 3
    for node, line in enumerate(lines[1:]):
        members = ranks[8 * node : 8 * node + 8]
        host_dir = sum(r.host_dir for r in members)
        assert line.startswith(f"host_memory node={node} ranks={8 * node}-{8 * node + 7} ")
        assert f"host_dir={host_estimate.gb(host_dir)} " in line and host_dir > 0
    one_node = host_estimate.estimate(cfg, ranks_per_node=16)
    assert sum(r.replicas for r in ranks) == sum(r.replicas for r in one_node)  # the same bytes, placed elsewhere
