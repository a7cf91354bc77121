"""`--checkpoint.strategy moevement` end to end under torchrun: training is unchanged, every
snapshot is replicated byte-for-byte to peers on other pipeline stages, and only one persisted
plus one in-flight checkpoint is kept (locally and on peers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moevement.storage.host_memory import map_bytes, read_header
from tests.helpers import DEBUG_CONFIG, ROOT, final_line, run_cli
from trainer.config import ConfigError, load_config

QUIET = ["--metrics.tensorboard", "false", "--metrics.log_every", "1", "--training.val_every", "0"]
LAYOUT = ["--parallelism.pp", "2", "--parallelism.dp", "2", "--parallelism.ep", "2"]


def committed(directory: Path) -> dict[tuple[int, int], tuple[dict, Path]]:
    """{(window_start, slot): (header, buffer path)} of the committed snapshots in a buffer directory."""
    out = {}
    for data in directory.glob("*.bin"):
        header = read_header(data.with_suffix(""))
        if header is not None:
            out[(header["window_start"], header["slot"])] = (header, data.with_suffix(""))
    return out


@pytest.mark.slow
def test_sparse_checkpointing_under_pp_dp_ep(tmp_path):
    """Replicas copied from a same-node peer's shared memory (auto) and sent over gloo (network)."""
    steps = ["--training.steps", "10"]
    baseline = run_cli("--config", DEBUG_CONFIG, *QUIET, *LAYOUT, *steps, nproc=4).stdout
    for replication in ("auto", "network"):
        host = tmp_path / replication
        out = run_cli(
            "--config",
            DEBUG_CONFIG,
            *QUIET,
            *LAYOUT,
            *steps,
            "--checkpoint.strategy",
            "moevement",
            "--checkpoint.window",
            "3",
            "--checkpoint.host_dir",
            str(host),
            "--checkpoint.keep_host_state",
            "true",
            "--checkpoint.replication",
            replication,
            nproc=4,
        ).stdout
        assert final_line(out) == final_line(baseline)  # snapshots never perturb training
        third = steps(out)[2]
        assert third.step == 3 and third.value("window") == 3, out
        assert 0 < third.value("ckpt_mb") <= third.value("host_mb"), out
        check_replicas({r: host / "debug_moe" / f"rank{r:05d}" for r in range(4)})


def check_replicas(ranks: dict[int, Path]) -> None:
    """Every rank's committed snapshots are held byte for byte by two peers on the other stage."""
    stage = {r: committed(d / "local")[(6, 0)][0]["meta"]["pp_rank"] for r, d in ranks.items()}
    for rank, rank_dir in ranks.items():
        # windows start at 3, 6, 9 (iterations 1-2 profile): 6-8 persisted, 9-10 in flight; older ones collected
        manifest = read_header(rank_dir / "persisted")
        assert (manifest["window_start"], manifest["window"]) == (6, 3)
        local = committed(rank_dir / "local")
        assert sorted(local) == [(6, 0), (6, 1), (6, 2), (9, 0), (9, 1)]
        holders = [r for r, d in ranks.items() if (d / "replicas" / f"from{rank}").is_dir()]
        assert len(holders) == 2 and all(stage[h] != stage[rank] for h in holders)  # other stages first
        for holder in holders:
            replicas = committed(ranks[holder] / "replicas" / f"from{rank}")
            assert sorted(replicas) == sorted(local)
            for key, (header, path) in local.items():
                replica_header, replica_path = replicas[key]
                n = header["nbytes"]
                assert replica_header == header
                assert map_bytes(replica_path)[:n].numpy().tobytes() == map_bytes(path)[:n].numpy().tobytes()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("checkpoint.strategy", "sparse", "'checkpoint.strategy' must be one of none, moevement"),
        ("checkpoint.ordering", "random", "'checkpoint.ordering' must be one of count, soft, ema, capacity"),
        ("checkpoint.replicas", "-1", "'checkpoint.replicas' must be >= 0"),
        ("checkpoint.replication", "rdma", "'checkpoint.replication' must be one of auto, network"),
        ("checkpoint.background_priority", "high", "'checkpoint.background_priority' must be one of idle, normal"),
        ("checkpoint.persist_every", "0", "'checkpoint.persist_every' must be >= 1"),
        ("checkpoint.chunk_mb", "0", "'checkpoint.chunk_mb' must be >= 1"),
        ("checkpoint.bandwidth_gbps", "-2", "'checkpoint.bandwidth_gbps' must be >= 0"),
    ],
)
def test_bad_checkpoint_keys_are_refused_naming_the_key(key, value, message):
    """Each bad checkpoint value is one message naming its key (train.py prints such a message as its one
    `error:` line with exit status 2: tests/test_input_errors.py::test_cli_zero_steps_is_refused)."""
    with pytest.raises(ConfigError) as refused:
        load_config(str(ROOT / DEBUG_CONFIG), [f"--{key}", value])
    assert message in str(refused.value) and "\n" not in str(refused.value)
