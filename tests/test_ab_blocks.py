"""`checkpoint.ab_blocks`: a benchmark's run takes snapshots in every other block of iterations, and
`benchmarks.overhead.ab_ratios` pairs each block with snapshots with the block after it."""

from __future__ import annotations

import pytest

from benchmarks.overhead import ab_ratios
from tests.test_moevement_engine import train
from trainer.config import ConfigError, load_config


def test_snapshots_are_taken_in_every_other_block_only(tmp_path):
    taken: list[int] = []
    train(tmp_path / "rank0", 13, on_snapshot=lambda header, *_: taken.append(header.iteration), window=1, ab_blocks=2)
    assert taken == [4, 5, 8, 9, 12, 13]  # blocks 0-1, 4-5, 8-9, 12-13 take them, after the profile


def test_ab_blocks_needs_a_window_of_one():
    with pytest.raises(ConfigError, match="checkpoint.ab_blocks.*needs checkpoint.window 1"):
        load_config(None, ["--checkpoint.strategy", "moevement", "--checkpoint.ab_blocks", "3"])
    cfg = load_config(
        None, ["--checkpoint.strategy", "moevement", "--checkpoint.ab_blocks", "3", "--checkpoint.window", "1"]
    )
    assert cfg.checkpoint.ab_blocks == 3


def _records(ms: dict[int, float], block: int) -> dict[int, dict[str, float]]:
    return {t: {"tok_per_s": 1000 / v, "ckpt_mb": 0.0 if (t // block) % 2 else 5.0} for t, v in ms.items()}


def test_block_pairs_compare_medians_of_adjacent_blocks():
    """From the first whole pair at or after `start`: blocks of 3, those with snapshots 10% slower (an
    outlier in one of each kind, which the median ignores); a trailing block without its pair is left out."""
    ms = {t: (110.0 if (t // 3) % 2 == 0 else 100.0) for t in range(4, 22)}
    ms[7], ms[16] = 500.0, 1.0
    assert ab_ratios(_records(ms, 3), block=3, start=4, tokens=1) == pytest.approx([1.1, 1.1])
    bad = _records(ms, 3)
    bad[9]["ckpt_mb"] = 2.0
    with pytest.raises(ValueError, match="iteration 9: ckpt_mb=2.0 does not match blocks of 3"):
        ab_ratios(bad, block=3, start=4, tokens=1)
