"""Every config key is bounded (trainer/config_bounds.py): an absurd value (a huge or negative number, NaN or
infinity, 100 kB of text) is one short `error:` line naming the key, at once, from a file or the command line;
never a hang, a memory blow-up or a traceback further on."""

import re
import time

import pytest

from tests.helpers import DEBUG_CONFIG, ROOT, run_cli
from trainer.config import ConfigError, load_config
from trainer.config_bounds import BOUNDS, MAX_WINDOW
from trainer.config_help import config_keys, toml_value
from trainer.error_line import error_line

KEYS = {k.key: k.type for k in config_keys()}
SEEDS = {"job.seed", "fault.seed"}  # any non-negative 64-bit value is a seed
ABSURD = {
    "int": [2**62, -(2**62)],
    "float": [float("nan"), float("inf"), float("-inf"), 1e300, -1e300],
    "str": ["a" * 100_000],
}
QUIET = ("--metrics.tensorboard", "false", "--metrics.progress", "false", "--training.steps", "2")


def refusal(args: list[str], config: str = str(ROOT / DEBUG_CONFIG)) -> str:
    """The error line `load_config` refuses `args` with, within a few seconds."""
    started = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_config(config, args)
    assert time.monotonic() - started < 5, args[:1]
    return error_line(e.value)


def test_every_number_and_string_key_has_a_bound():
    assert set(BOUNDS) == {key for key, kind in KEYS.items() if kind != "bool"}


@pytest.mark.parametrize("key", [key for key, kind in KEYS.items() if kind != "bool"])
def test_an_absurd_value_of_any_key_is_one_short_line_naming_it(key, tmp_path):
    section, name = key.split(".")
    for value in ABSURD[KEYS[key]]:
        if key in SEEDS and value > 0:
            assert getattr(getattr(load_config(None, [f"--{key}={value}"]), section), name) == value
            continue
        for args, config in (
            ([f"--{key}={value}"], str(ROOT / DEBUG_CONFIG)),
            ([], _toml(tmp_path, section, name, value)),
        ):
            line = refusal(args, config)
            assert f"'{key}'" in line and "\n" not in line and len(line) < 300, line[:400]


def _toml(tmp_path, section: str, name: str, value) -> str:
    """The debug config with `[section] name = value` added (a file of the same keys, one of them absurd)."""
    text = (ROOT / DEBUG_CONFIG).read_text()
    text = re.sub(rf"(?m)^{name} = .*\n", "", text) if f"[{section}]" in text else text + f"\n[{section}]\n"
    path = tmp_path / "absurd.toml"
    path.write_text(text.replace(f"[{section}]\n", f"[{section}]\n{name} = {toml_value(value)}\n", 1))
    return str(path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data.dataset", "a" * 300], "has a path component of 300 bytes, longer than a file name may be (255)"),
        (["--checkpoint.folder", "é/" * 400], "must be at most 1024 bytes (a path), got 1200 bytes"),
        (["--data.text_field", "text\x01"], "must not hold control characters, got '\\x01' at character 4"),
        (["--checkpoint.window", "100000"], f"must be at most {MAX_WINDOW} (a recovery replays up to 2W iterations)"),
        (["--checkpoint.window", "200"], "(200) must be at most the model's 25 operators"),
        (["--training.steps", "100000000", "--fault.mtbf_iters", "1"], "would draw about 100000000 failures"),
        (["--checkpoint.interval", "9" * 5000], "must be at most 255 characters"),
        (["--parallelism.split_points", "x"], "must be 0 increasing layer ids in (0, 3), comma-separated, got 'x'"),
    ],
)
def test_values_beyond_what_the_run_can_use_say_why(args, message):
    """A path the file system cannot hold, a window longer than the model has operators (a hang of minutes in
    the schedule), a Poisson schedule of a hundred million failures (drawn at start-up): refused at once."""
    line = refusal(["--checkpoint.strategy", "moevement", *args])
    assert message in line, line


def test_a_config_file_path_too_long_or_not_toml_is_one_line(tmp_path):
    assert "unreadable (File name too long)" in refusal([], "x" * 300)
    huge_int = tmp_path / "int.toml"
    huge_int.write_text(f"[training]\nsteps = {'9' * 5000}\n")
    assert "invalid TOML: Exceeds the limit" in refusal([], str(huge_int))


def test_the_error_line_cuts_what_it_does_not_bound_itself():
    line = error_line(ValueError("x" * 50_000))
    assert len(line) < 1100 and line.endswith("... (49000 more characters)")


@pytest.mark.parametrize(
    "args, key",
    [(("--data.dataset", "a" * 300), "data.dataset"), (("--checkpoint.window", "100000"), "checkpoint.window")],
)
def test_train_py_refuses_them_in_one_line(args, key):
    """The reported cases end as one `error:` line with exit status 2 (a traceback, and a start-up that hung
    over 100 s, before)."""
    proc = run_cli("--config", DEBUG_CONFIG, *QUIET, "--checkpoint.strategy", "moevement", *args, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: config key '{key}' ") and len(lines[0]) < 300, lines[0]
