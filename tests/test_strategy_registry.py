"""The strategy registry (`trainer/strategy_registry.py`): every entry builds, the config accepts exactly its
names, and nothing above it asks which class a strategy is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG
from trainer.config import ConfigError, load_config
from trainer.strategy_registry import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
STRATEGY_CLASSES = ("MoEvement", "IntervalBaseline", "NoCheckpointing", "CheckpointStrategy")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_entry_names_a_builder_that_exists_and_the_config_takes_its_name(name):
    entry = STRATEGIES[name]
    assert entry.name == name
    assert entry.build is None or callable(entry.builder())
    interval = ["--checkpoint.interval", "3"]  # every_n's check asks for N; the others take it too
    assert load_config(DEBUG_CONFIG, ["--checkpoint.strategy", name, *interval]).checkpoint.strategy == name


def test_a_name_not_registered_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match="'checkpoint.strategy' must be one of none, moevement, .*every_n"):
        load_config(DEBUG_CONFIG, ["--checkpoint.strategy", "sparse"])


def test_nothing_in_the_trainer_asks_which_class_a_strategy_is():
    """A strategy's capabilities are its registry entry's (or methods of `CheckpointStrategy`)."""
    pattern = re.compile(rf"isinstance\([^)]*\b({'|'.join(STRATEGY_CLASSES)})\b")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in [ROOT / "train.py", *sorted((ROOT / "trainer").rglob("*.py"))]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
