"""Model FLOPs, TFLOP/s and MFU (trainer/flops.py) on the step line and in TensorBoard (trainer/records/metrics.py).

The FLOP count per token is checked against torch's own counter on a real forward and backward; the step line
gains `tflops=` (model TFLOP/s per device) and, only where the device's peak is known (a known GPU, or
`metrics.peak_tflops`), `mfu=`: a CPU's MFU is not reported."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from models import ModelArgs, build_model
from models.experts import GROUPED_MM_FLOPS
from tests.helpers import DEBUG_CONFIG, ROOT, base_args, run_cli, steps
from tests.tiny_moe import ARGS
from trainer import event_writer
from trainer.config import ConfigError, load_config
from trainer.flops import bf16_peak_flops, device_peak_flops, flops_per_token, step_throughput
from trainer.records.event_lines import StepLine
from trainer.records.metrics import MetricsLogger


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_embeddings": True}, {"family": "qwen", "qkv_bias": True, "n_kv_heads": 2}, {"family": "gpt"}],
    ids=["deepseek", "tied", "qwen-gqa-bias", "gpt"],
)
def test_flops_per_token_is_what_torchs_counter_counts_in_a_forward_and_backward(overrides):
    """Every product of a real forward and backward (the routed experts' grouped GEMMs at top_k per token, the
    attention's products through the math kernel, which the counter sees) equals `flops_per_token` times the
    tokens, exactly."""
    args = ModelArgs(**{**ARGS, **overrides, **({"n_shared_experts": 0} if overrides.get("family") == "gpt" else {})})
    torch.manual_seed(0)
    model = build_model(args)
    batch, seq_len = 2, 16
    x = torch.randint(0, args.vocab_size, (batch, seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=GROUPED_MM_FLOPS) as counter:
        F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten()).backward()
    assert counter.get_total_flops() == flops_per_token(args, seq_len) * batch * seq_len


def test_the_peak_is_a_known_gpus_or_the_users_never_a_cpus():
    assert bf16_peak_flops("NVIDIA H100 80GB HBM3") == bf16_peak_flops("NVIDIA H200") == 989e12
    assert bf16_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and bf16_peak_flops("Tesla T4") is None
    assert device_peak_flops(torch.device("cpu")) is None
    assert device_peak_flops(torch.device("cpu"), peak_tflops=2.5) == 2.5e12
    assert step_throughput(8e12, seconds=2.0, devices=2, peak=None) == {"tflops": 2.0}
    assert step_throughput(8e12, seconds=2.0, devices=2, peak=4e12) == {"tflops": 2.0, "mfu": 0.5}


def test_a_negative_peak_is_one_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"^config key 'metrics.peak_tflops' must be >= 0"):
        load_config(str(ROOT / DEBUG_CONFIG), ["--metrics.peak_tflops", "-1"])


def logged_step(tmp_path, capsys, *overrides: str) -> tuple[StepLine, float]:
    """Rank 0's `step` record of an iteration of 0.5 s under `overrides` (its events and TensorBoard's into
    `tmp_path`), checked to be what it printed, and the config's model FLOPs per iteration."""
    cfg = load_config(
        str(ROOT / DEBUG_CONFIG), ["--metrics.log_every", "1", "--metrics.tensorboard_every", "1000", *overrides]
    )
    tmp_path.mkdir()
    event_writer.record_events_in(tmp_path)
    try:
        logger = MetricsLogger(cfg, rank=0, stage=0, run_dir=tmp_path)
        logger.start(1)
        scalars = {"loss": 5.0, "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0}
        logger.step(1, scalars, {}, {}, elapsed_s=0.5, wall_s=0.5)
        logger.close()
    finally:
        event_writer.record_events_in(None)
    [record] = steps(tmp_path)
    assert [out for out in capsys.readouterr().out.splitlines() if out.startswith("step=")] == [record.line()]
    t = cfg.training
    return record, flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len


def printed(value: float):
    """`value` as the step line prints it: 6 decimals, or 4 significant digits below 0.001."""
    return pytest.approx(value, abs=5e-7, rel=5e-4)


def test_the_step_line_and_tensorboard_get_tflops_and_mfu_only_with_a_peak(tmp_path, capsys):
    """On CPU: `tflops=` (the iteration's model FLOPs per second per device) before `wall_s=`, which stays last,
    and no `mfu=`; with `metrics.peak_tflops` also `mfu=` (tflops over the peak). TensorBoard's `train/` scalars
    mirror both."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    line, flops = logged_step(tmp_path / "cpu", capsys)
    names = [name for name, _ in line.fields]
    assert names[:2] == ["loss", "aux_loss"] and names[-2:] == ["tflops", "wall_s"] and "mfu" not in names
    assert line.value("tflops") == printed(flops / 0.5 / 1e12)
    line, _ = logged_step(tmp_path / "peak", capsys, "--metrics.peak_tflops", "0.002", "--parallelism.pp", "2")
    assert [name for name, _ in line.fields][-4:] == ["tok_per_s", "tflops", "mfu", "wall_s"], line
    assert line.value("tflops") == printed(flops / 0.5 / 2 / 1e12)  # per device of pp=2
    assert line.value("mfu") == printed(flops / 0.5 / 2 / 0.002e12)
    for run, tags in (("cpu", {"train/tflops"}), ("peak", {"train/tflops", "train/mfu"})):
        events = EventAccumulator(str(tmp_path / run))
        events.Reload()
        assert {t for t in events.Tags()["scalars"] if t in ("train/tflops", "train/mfu")} == tags


@pytest.mark.slow
def test_train_prints_tflops_on_every_step_line():
    """train.py end to end on CPU: every `step` record has a positive `tflops` and no `mfu`."""
    out = run_cli(*base_args(2)).stdout
    lines = steps(out)
    assert [line.step for line in lines] == [1, 2], out
    assert all(line.value("tflops") > 0 and "mfu" not in dict(line.fields) for line in lines), out
