"""The prepared GPU check (benchmarks/gpu_check) stays alive without a GPU: it exits 0 saying so, and the
parts that run on CPU (report arithmetic, the numerics and throughput code, the shared-GPU collectives on
gloo) are exercised here."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.gpu_check import numerics, throughput
from benchmarks.gpu_check.report import (
    Check,
    Section,
    bf16_peak_flops,
    compare,
    run_section,
    summary,
    throughput_fields,
)
from benchmarks.gpu_check.shared_gpu import LINE
from models.experts import GROUPED_MM_FLOPS
from tests.helpers import CHILD_ENV, ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check runs for real (make gpu-check)")
def test_without_cuda_the_check_says_so_in_one_line_and_exits_0():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "gpu-check: no CUDA device (torch.cuda.is_available() is False): nothing to check here, exiting 0"
    ]


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla T4", None),
    ],
)
def test_bf16_peak_by_device_name(name, peak):
    assert bf16_peak_flops(name) == peak


def test_throughput_fields_mfu_against_the_peak_or_flops_only():
    line = throughput_fields(flops=989e12, tokens=8192, seconds=2.0, device_name="NVIDIA H100 80GB HBM3")
    assert line == "tokens_per_s=4096 tflops=494.5 mfu=0.500 (peak 989 TFLOP/s)"
    unknown = throughput_fields(flops=1e12, tokens=100, seconds=0.5, device_name="Tesla T4")
    assert unknown == "tokens_per_s=200 tflops=2.0 mfu=unknown (GPU not in the peak table)"


def test_compare_elementwise_and_relative_l2():
    ref = torch.linspace(1.0, 2.0, 100)
    assert compare("near", ref + 1e-7, ref, atol=1e-6).ok
    assert not compare("far", ref + 1e-3, ref, atol=1e-6, rtol=1e-4).ok
    outlier = ref.clone()
    outlier[0] += 0.5  # one element far off (a flipped routing decision), the vector close
    assert not compare("elementwise", outlier, ref, atol=1e-3).ok
    assert compare("l2", outlier, ref, rel_l2=0.05).ok
    assert not compare("nan", torch.full_like(ref, float("nan")), ref, rel_l2=0.05).ok
    assert not compare("shape", ref[:10], ref, atol=1.0).ok


def test_a_failing_section_reports_its_first_line_and_the_next_still_runs():
    def broken(section: Section) -> None:
        raise RuntimeError("No backend type associated with device type cpu\nlong traceback text")

    def fine(section: Section) -> None:
        section.checks.append(Check("ok", True, "fine"))

    first = run_section(Section(1, "broken", 10), broken)
    second = run_section(Section(2, "fine", 10), fine)
    assert first.status == "FAIL"
    assert first.lines()[-1] == "  FAIL error: RuntimeError: No backend type associated with device type cpu"
    assert second.status == "PASS"
    assert re.fullmatch(r"gpu-check FAIL: \[1\]=FAIL \[2\]=PASS \(1 failed\) in 3 s", summary([first, second], 3.2))
    slow = run_section(Section(3, "slow", 0.0), fine)
    assert slow.status == "FAIL" and "time budget" in slow.lines()[-1]


def test_numerics_section_code_runs_on_cpu():
    """Section 1's code on CPU: fp32 against itself is exact, bf16 against fp32 within its stated bound."""
    section = run_section(Section(1, "numerics", 120), lambda s: numerics.run(s, "cpu"))
    assert section.status == "PASS", "\n".join(section.lines())
    assert [c.name for c in section.checks] == [
        "fp32 loss",
        "fp32 grads",
        "bf16 loss",
        "bf16 grads",
        "grouped GEMM bfloat16 vs loop",
        "grouped GEMM float32 vs loop",
    ]


@pytest.mark.slow
def test_16b_stage_flop_count_is_six_times_active_parameters_per_token():
    """The counted FLOPs of a 16B-shaped MoE layer (short sequences: attention scores negligible) are 6 x its
    active parameters per token (norm scales aside): the routed experts' grouped GEMMs are counted
    (GROUPED_MM_FLOPS)."""
    stage, dim = throughput.moe_stage(1, torch.device("cpu"))
    moe = stage.moe_layers()["1"]
    idle = (moe.n_experts - moe.top_k) * moe.experts.params_per_expert()
    active = sum(p.numel() for p in stage.parameters()) - idle
    x = throughput.stage_input(dim, torch.device("cpu"), tokens=16)
    with FlopCounterMode(display=False, custom_mapping=GROUPED_MM_FLOPS) as counter:
        throughput.fwd_bwd(stage, x)
    assert 0.99 < counter.get_total_flops() / (6 * active * x.shape[0] * x.shape[1]) < 1.02


@pytest.mark.slow
def test_shared_gpu_collectives_run_on_two_gloo_processes():
    """Section 5's worker on CPU (plain gloo): the same trainer functions, two real processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, "-m", "benchmarks.gpu_check.shared_gpu", "cpu"],
        cwd=ROOT,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = sorted((int(rank), name, ok) for rank, name, ok, _ in LINE.findall(proc.stdout))
    names = ("boundary_logs", "scalars", "tensorboard")
    assert found == [(rank, name, "1") for rank in (0, 1) for name in names], proc.stdout
