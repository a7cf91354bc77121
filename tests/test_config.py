"""Config loading: TOML + overrides, and one clear error naming the key."""

import pytest

from tests.conftest import DEBUG_CONFIG, ROOT
from trainer.config import ConfigError, load_config


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_debug_config_loads_and_overrides_apply():
    cfg = load_config(
        str(ROOT / DEBUG_CONFIG),
        ["--training.steps", "7", "--training.lr=0.001", "--metrics.tensorboard", "false", "--model.dropout", "0.1"],
    )
    assert cfg.training.steps == 7
    assert cfg.training.lr == 0.001
    assert cfg.metrics.tensorboard is False
    assert cfg.model.dropout == 0.1


@pytest.mark.parametrize(
    "text, key",
    [
        ("[training]\nstepz = 3\n", "training.stepz"),
        ("[trainin]\nsteps = 3\n", "[trainin]"),
        ("[training]\nsteps = 'many'\n", "training.steps"),
        ("[training]\nlr = true\n", "training.lr"),
        ("[training]\nbatch_size = 6\nmicro_batches = 4\n", "training.batch_size"),
        ("[training]\nmixed_precision = 'fp8'\n", "training.mixed_precision"),
        ("[checkpoint]\nstrategy = 'magic'\n", "checkpoint.strategy"),
        ("[model]\ntop_k = 99\n", "model.top_k"),
        ("[model]\nfamily = 'llama'\n", "model.family"),
    ],
)
def test_bad_file_values_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    "args, key",
    [
        (["--training.steps", "x"], "training.steps"),
        (["--training.nope", "1"], "training.nope"),
        (["--metrics.tensorboard", "maybe"], "metrics.tensorboard"),
        (["--training.steps"], "training.steps"),
    ],
)
def test_bad_overrides_name_the_key(args, key):
    with pytest.raises(ConfigError, match=key):
        load_config(str(ROOT / DEBUG_CONFIG), args)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "absent.toml"))
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[training\n"))
