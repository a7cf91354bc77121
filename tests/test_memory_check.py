"""A run whose estimated per-rank peak is over its device's memory says so in one line before it allocates,
with keys that fit it (trainer/estimates/memory_check.py); the provided cluster configs fit 80 GB GPUs in the
layouts their headers name."""

from __future__ import annotations

import re

import pytest

from tests.helpers import DEBUG_CONFIG, ROOT, run_cli
from trainer.config import load_config
from trainer.estimates.memory_check import DeviceMemory, over_line, peaks

PIPELINE = ["--parallelism.pp", "2", "--training.micro_batches", "2", "--training.batch_size", "32"]
OPTION = re.compile(r"((?:--\S+ \S+ ?)+) \(([0-9.]+) GB\)")


def _options(line: str) -> list[tuple[list[str], float]]:
    """(overrides, the peak the line gives them) of each option a warning line names."""
    fits = line.split("; fits with ", 1)[1]
    return [(keys.split(), float(peak)) for keys, peak in OPTION.findall(fits)]


def test_the_keys_a_warning_names_fit_and_are_the_lightest():
    """Over its memory with no checkpointing: the line names the lightest checkpointing and the fewest
    micro-batches that each fit (by the same estimate), and nothing lighter does."""
    cfg = load_config(DEBUG_CONFIG, PIPELINE)
    configured = peaks(cfg)
    budget = (configured["none"] + configured["full"]) // 2
    line = over_line(cfg, DeviceMemory(budget, "a test device"))
    assert line.startswith("WARNING: memory: the largest rank's estimated peak") and "\n" not in line
    assert f"{configured['none'] / 1e9:.3f} GB (activation_checkpoint=none, micro-batch 16x128)" in line
    options = _options(line)
    assert [keys[0] for keys, _ in options] == ["--training.activation_checkpoint", "--training.micro_batches"]
    for keys, peak in options:
        fitted = load_config(DEBUG_CONFIG, [*PIPELINE, *keys])
        mode = fitted.training.activation_checkpoint
        assert peaks(fitted)[mode] <= budget and peak == pytest.approx(peaks(fitted)[mode] / 1e9, abs=1e-3)
    mode = options[0][0][1]
    assert configured["selective"] > budget or mode == "selective"  # the lightest that fits
    fewest = int(options[1][0][1])
    assert peaks(load_config(DEBUG_CONFIG, [*PIPELINE, "--training.micro_batches", str(fewest // 2)]))["none"] > budget


def test_a_run_that_fits_says_nothing_and_one_that_nothing_fits_says_so():
    cfg = load_config(DEBUG_CONFIG, PIPELINE)
    assert over_line(cfg, DeviceMemory(peaks(cfg)["none"], "a test device")) is None
    line = over_line(cfg, DeviceMemory(1, "a test device"))
    assert "no activation checkpointing or micro-batch count fits it: more ranks do" in line


def test_a_run_over_its_host_s_memory_says_so_before_it_allocates(tmp_path):
    """On the CPU, against this host's memory: a model of some 2.6B parameters (60 GB by the estimate) in one
    process. Its vocabulary is one token short of the tokenizer's, which train.py refuses once it reads the
    data, after the memory check and before anything of the model exists: the warning is printed first."""
    big = ["--model.dim", "2048", "--model.n_layers", "24", "--model.dense_hidden_dim", "8192"]
    big += ["--model.expert_hidden_dim", "2048", "--model.shared_expert_hidden_dim", "2048"]
    proc = run_cli(
        *("--config", DEBUG_CONFIG, *big, "--model.vocab_size", "256", "--metrics.tensorboard", "false"),
        *("--job.output_dir", str(tmp_path)),
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (warning,) = [line for line in proc.stdout.splitlines() if line.startswith("WARNING: memory:")]
    assert "is more than this host's" in warning and "more ranks do" in warning, warning
    assert proc.stderr.strip().startswith("error: config key 'model.vocab_size' (256)"), proc.stderr


# the layouts the cluster configs' headers name (16 or 8 GPUs of 80 GB), as in README's command
LAYOUTS = {
    "deepseek_moe_16b": ["--parallelism.pp", "4", "--parallelism.dp", "4", "--parallelism.ep", "4"],
    "deepseek_moe_16b_hf": [],  # pp, dp and ep in its [parallelism]
    "qwen_moe_14b": ["--parallelism.dp", "8", "--parallelism.ep", "4"],
    "qwen_moe_14b_hf": [],  # dp and ep in its [parallelism]
    "gpt_moe_7b": ["--parallelism.dp", "8", "--parallelism.ep", "4"],
}
H100_80GB = 79.2 * 2**30  # what torch reports as an 80 GB H100's total memory


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_cluster_configs_fit_80_gb_gpus(name):
    text = (ROOT / "train_configs" / f"{name}.toml").read_text()
    layout = LAYOUTS[name]
    assert " ".join(layout) in text.replace("\n#", "")  # the header names the layout
    cfg = load_config(str(ROOT / "train_configs" / f"{name}.toml"), layout)
    assert over_line(cfg, DeviceMemory(int(H100_80GB * 0.75), "three quarters of an H100")) is None
