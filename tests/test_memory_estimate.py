"""`train.py --dry-run`'s accelerator-memory estimate against real tensors (trainer/estimates/memory_estimate.py).

- Training state: the parameter, gradient and AdamW bytes the estimate gives each rank equal, exactly,
  the bytes of the storages the real tensors hold on that rank after one training step of a 2-rank gloo
  run (FSDP2 padded shards, expert parallelism, a pipeline), on CPU.
- Activations: the meta-device trace of one micro-batch, with the CPU's kernels, equals the bytes of the
  distinct storages autograd saves in a real CPU forward (and loss) of that micro-batch, plus the stage's
  input and output; with the accelerator's kernels (what `--dry-run` prints) it is within
  `ACTIVATION_TOLERANCE` (±25%) of that measurement. Under activation checkpointing the measurement is
  what stays alive outside the checkpointed blocks: what the hooks see, and the blocks' inputs.
- Peak: the printed peak of a one-rank run is within `ACTIVATION_TOLERANCE` of the peak resident memory
  two real training steps add on CPU (fp32 and FSDP bf16; no, full and selective checkpointing).
- Schedules: the micro-batches alive at the peak of GPipe, 1F1B and Interleaved1F1B; the dry run's lines.
"""

from __future__ import annotations

import json
import mmap
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.autograd.graph import saved_tensors_hooks

from tests.helpers import DEBUG_CONFIG, run_cli
from trainer.config import load_config
from trainer.estimates import activation_estimate, memory_estimate, training_state_bytes

ACTIVATION_TOLERANCE = 0.25
WORLD = 2
SMALL = ["--model.n_layers", "4", "--model.vocab_size", "261"]  # 261 rows: uneven shards, padded
LAYOUTS = {
    "dp2-fp32": ["--parallelism.dp", "2"],
    "dp2-ep2-bf16": ["--parallelism.dp", "2", "--parallelism.ep", "2", "--training.mixed_precision", "bf16"],
    "pp2-bf16": ["--parallelism.pp", "2", "--training.mixed_precision", "bf16"],
}


def _storages(tensors) -> dict[int, int]:
    """data_ptr -> bytes of the distinct storages under `tensors` (a DTensor's local tensor)."""
    out = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        out[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return out


def _held(model, optimizer) -> dict[str, int]:
    params = [p for part in model.parts for p in part.parameters()]
    state = [optimizer.state[p] for p in params]
    return {
        "params": sum(_storages(params).values()),
        "grads": sum(_storages(p.grad for p in params if p.grad is not None).values()),
        "moments": sum(_storages(s[k] for s in state for k in ("exp_avg", "exp_avg_sq")).values()),
        "steps_host": sum(s["step"].untyped_storage().nbytes() for s in state),
        "step_on_cpu": all(s["step"].device.type == "cpu" for s in state),
        "buffers": sum(_storages(b for part in model.parts for b in part.buffers()).values()),
    }


def _worker(rank: int, overrides: list[str], store: str, out: str) -> None:
    import torch.distributed as dist

    from parallelisms.mesh import build_mesh
    from parallelisms.parallelize import BuildOptions, parallelize
    from trainer.optim import build_optimizer
    from trainer.step import forward_backward

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    try:
        cfg = load_config(DEBUG_CONFIG, overrides)
        t, dims = cfg.training, build_mesh(cfg.parallelism, "cpu")
        shape = activation_estimate.micro_batch_shape(cfg)
        opts = BuildOptions(0, shape, t.micro_batches, t.mixed_precision, t.cpu_bf16_gemm, loss_chunk_tokens=1024)
        model = parallelize(cfg.model, dims, opts)
        optimizer = build_optimizer(model.view, t)
        tokens = torch.randint(0, 256, (t.batch_size // cfg.parallelism.dp, t.seq_len), generator=torch.Generator())
        forward_backward(model, tokens, tokens, t.micro_batches)
        optimizer.step()
        Path(out, f"rank{rank}.json").write_text(json.dumps(_held(model, optimizer)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "layout", [name if i == 0 else pytest.param(name, marks=pytest.mark.slow) for i, name in enumerate(LAYOUTS)]
)
def test_training_state_bytes_equal_what_each_rank_holds(tmp_path, layout):
    overrides = [*SMALL, *LAYOUTS[layout]]
    mp.spawn(_worker, args=(overrides, str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    cfg = load_config(DEBUG_CONFIG, overrides)
    for rank in range(WORLD):
        held = json.loads((tmp_path / f"rank{rank}.json").read_text())
        est = training_state_bytes.rank_state(cfg, rank)
        assert held["step_on_cpu"]
        estimated = {k: getattr(est, k) for k in ("params", "grads", "moments", "steps_host", "buffers")}
        print(layout, rank, estimated, held)
        assert estimated == {k: held[k] for k in estimated}, (layout, rank)


def measured_activations(cfg, pp_rank: int, mode: str) -> int:
    """Bytes a real CPU forward (and loss, on the last stage) of one micro-batch keeps for backward on stage
    `pp_rank` (`training.activation_checkpoint = mode`): the distinct storages autograd saves, the inputs of
    the checkpointed blocks (kept by torch.utils.checkpoint) and the stage's input and output."""
    from models import build_model
    from parallelisms.pipeline import split_model

    torch.manual_seed(0)
    (part,) = split_model(build_model(cfg.model), cfg.parallelism, pp_rank)[1]
    part.loss_chunk_tokens = cfg.training.loss_chunk_tokens
    for p in part.parameters():
        p.data = p.data.to(torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32)
    if mode != "none":
        from parallelisms.activation_checkpoint import apply_activation_checkpoint, is_checkpointed

        apply_activation_checkpoint(part, mode)
    part.train()
    state = {t.untyped_storage().data_ptr() for t in [*part.parameters(), *part.buffers()]}
    kept: dict[int, int] = {}
    held: list[torch.Tensor] = []  # to the end: a freed storage's address could be reused

    def keep(t: torch.Tensor) -> torch.Tensor:
        held.append(t)
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def keep_input(_module, args) -> None:
        keep(args[0])

    for block in part.layers.values():
        if mode != "none" and is_checkpointed(block):
            block.register_forward_pre_hook(keep_input)
    b, s = activation_estimate.micro_batch_shape(cfg)
    x = torch.randint(0, 256, (b, s)) if pp_rank == 0 else torch.randn(b, s, cfg.model.dim, requires_grad=True)
    x = x.to(torch.bfloat16) if x.is_floating_point() and cfg.training.mixed_precision == "bf16" else x
    with saved_tensors_hooks(keep, lambda t: t):
        out = part(x)
        if part.output is not None:
            part.loss(out, torch.randint(0, 256, (b, s)))
    keep(x), keep(out)
    return sum(n for ptr, n in kept.items() if ptr not in state)


ACTIVATION_CASES = {
    "fp32": ([], 0, "none"),
    "bf16": (["--training.mixed_precision", "bf16"], 0, "none"),
    "unchunked-loss": (["--training.loss_chunk_tokens", "0"], 0, "none"),
    "pp2-stage0": (["--parallelism.pp", "2"], 0, "none"),
    "pp2-stage1-bf16": (["--parallelism.pp", "2", "--training.mixed_precision", "bf16"], 1, "none"),
    "full-ac": ([], 0, "full"),
    "selective-ac-bf16": (["--training.mixed_precision", "bf16"], 0, "selective"),
}


@pytest.mark.parametrize("case", list(ACTIVATION_CASES))
def test_activation_trace_matches_what_autograd_saves_on_cpu(case):
    overrides, pp_rank, mode = ACTIVATION_CASES[case]
    cfg = load_config(DEBUG_CONFIG, ["--model.n_layers", "4", *overrides])
    measured = measured_activations(cfg, pp_rank, mode)
    cpu = activation_estimate.trace_rank(cfg, pp_rank, kernels="cpu")[0].saved[mode]
    cuda = activation_estimate.trace_rank(cfg, pp_rank, kernels="cuda")[0].saved[mode]
    print(f"{case}: measured={measured} traced_cpu_kernels={cpu} estimate_cuda_kernels={cuda} ({cuda / measured:.3f})")
    assert cpu == pytest.approx(measured, rel=0.01)
    assert cuda == pytest.approx(measured, rel=ACTIVATION_TOLERANCE)


def test_micro_batches_alive_follow_the_schedule():
    from parallelisms.mesh import ParallelismConfig
    from trainer.estimates.pipeline_peak import peak_alive

    assert peak_alive(ParallelismConfig(), 8, 0, {0: 10}).nbytes == 10  # pp=1: one at a time
    gpipe = ParallelismConfig(pp=4, schedule="GPipe")
    assert [peak_alive(gpipe, 8, r, {r: 10}).nbytes for r in range(4)] == [80] * 4
    one_f_one_b = ParallelismConfig(pp=4, schedule="1F1B")
    assert [peak_alive(one_f_one_b, 8, r, {r: 10}).micro_batches for r in range(4)] == [4, 3, 2, 1]
    assert peak_alive(one_f_one_b, 2, 0, {0: 10}).micro_batches == 2  # fewer micro-batches than stages
    # Interleaved, pp=2, 2 stages per rank, 4 micro-batches (2 per round): rank 0 warms up with 4 forwards
    # (stage 0: micro-batches 0-1, stage 2: 0-1), then runs stage 0's third forward before stage 2's first
    # backward: 3 of stage 0 and 2 of stage 2 alive; rank 1 warms up with 2 (stage 1's), then runs stage 3's
    # first forward before its backward: 2 of stage 1 and 1 of stage 3.
    interleaved = ParallelismConfig(pp=2, schedule="Interleaved1F1B", stages_per_rank=2)
    assert peak_alive(interleaved, 4, 0, {0: 1, 2: 100}).nbytes == 3 * 1 + 2 * 100
    assert peak_alive(interleaved, 4, 1, {1: 1, 3: 100}).nbytes == 2 * 1 + 100


DRY_RUN_LAYOUT = ["--parallelism.pp", "2", "--parallelism.dp", "2", "--parallelism.ep", "2"]
MEMORY_LINE = re.compile(r"^accel_memory ranks=(\S+) pp=(\d+) params=(\S+) grads=(\S+) adamw=(\S+) .*$", re.M)


def test_dry_run_prints_every_ranks_accelerator_memory():
    args = ["--config", DEBUG_CONFIG, *DRY_RUN_LAYOUT, "--training.mixed_precision", "bf16"]
    args += ["--checkpoint.strategy", "moevement", "--checkpoint.window", "2"]
    out = run_cli(*args, "--dry-run").stdout
    ranks = {r.rank: r for r in memory_estimate.estimate(load_config(DEBUG_CONFIG, args[2:]))}
    printed: dict[int, tuple] = {}
    for text, pp, *figures in MEMORY_LINE.findall(out):
        for rank in _expand(text):
            printed[rank] = (int(pp), *map(float, figures))
    assert sorted(printed) == sorted(ranks) == list(range(4))
    for rank, r in ranks.items():
        expected = (r.pp_rank, *(round(b / 1e9, 3) for b in (r.state.params, r.state.grads, r.state.moments)))
        assert printed[rank] == expected
        assert r.alive["full"].nbytes <= r.alive["selective"].nbytes <= r.alive["none"].nbytes
        assert r.moevement > 0  # the bandwidth probe's source, at least
    assert "accel_moevement per_rank_max=" in out and "host_memory node=0 ranks=0-3" in out


def _expand(text: str) -> list[int]:
    out = []
    for span in text.split(","):
        a, _, b = span.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


# A model big enough for its tensors to dwarf the process's small allocations (4,096 tokens a micro-batch).
PEAK_MODEL = [
    *("--model.dim", "128", "--model.n_layers", "4", "--model.n_routed_experts", "16"),
    *("--model.expert_hidden_dim", "128", "--model.shared_expert_hidden_dim", "128", "--model.dense_hidden_dim", "384"),
    *("--training.batch_size", "16", "--training.seq_len", "256"),
]
PEAK_CASES = {
    "fp32": ["--training.micro_batches", "1"],
    "fp32-2-micro-batches-full-ac": ["--training.micro_batches", "2", "--training.activation_checkpoint", "full"],
    "fp32-selective-ac": ["--training.micro_batches", "1", "--training.activation_checkpoint", "selective"],
    # SGEMM products on every CPU: `auto` picks oneDNN's native bf16 kernels where the CPU has AMX, and those
    # held about 150 MB more at this peak (estimate/measured 0.53 against 0.88), which no GPU kernel does
    "bf16-fsdp": [
        *("--training.micro_batches", "1", "--training.mixed_precision", "bf16"),
        *("--training.cpu_bf16_gemm", "fp32"),
    ],
}


def _peak_worker(rank: int, overrides: list[str], out: str) -> None:
    """Two training steps in a fresh one-rank process; the growth of its peak resident memory over what it
    held before building the model (the kernel's peak, `VmHWM`, reset there: what the imports peaked at
    before does not count). glibc is told to map every block of 64 KiB or more on its own and unmap it
    when freed, so resident memory follows the live tensors."""
    import ctypes

    import torch.distributed as dist

    from parallelisms.mesh import build_mesh
    from parallelisms.parallelize import BuildOptions, parallelize
    from trainer.optim import build_optimizer
    from trainer.step import forward_backward

    ctypes.CDLL(None).mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    cfg = load_config(DEBUG_CONFIG, overrides)
    t, dims = cfg.training, build_mesh(cfg.parallelism, "cpu")
    tokens = torch.randint(0, 256, (t.batch_size, t.seq_len))
    before = int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from here
    shape = activation_estimate.micro_batch_shape(cfg)
    mode = memory_estimate.configured_mode(cfg)
    opts = BuildOptions(0, shape, t.micro_batches, t.mixed_precision, t.cpu_bf16_gemm, 1024, activation_checkpoint=mode)
    model = parallelize(cfg.model, dims, opts)
    optimizer = build_optimizer(model.view, t)
    for _ in range(2):  # the second step runs with the AdamW moments the first one created
        forward_backward(model, tokens, tokens, t.micro_batches)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    status = Path("/proc/self/status").read_text()
    peak = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)[1]) * 1024 - before
    Path(out).write_text(json.dumps({"peak": peak}))
    dist.destroy_process_group()


@pytest.mark.slow  # resident memory depends on the environment (the allocator, the CPU's kernels)
@pytest.mark.parametrize("case", list(PEAK_CASES))
def test_peak_estimate_is_within_tolerance_of_a_measured_cpu_peak(tmp_path, case):
    """One process on CPU (the accelerator's bookkeeping, CPU kernels): the printed peak against the peak
    resident memory a real run adds. The CPU saves more than the CUDA kernels the estimate assumes (FP32
    RMSNorm copies; bf16 products upcast to FP32 for SGEMM), while the estimate adds up what may be alive
    together: the two err in opposite directions, within `ACTIVATION_TOLERANCE`."""
    overrides = [*PEAK_MODEL, *PEAK_CASES[case]]
    mp.spawn(_peak_worker, args=(overrides, str(tmp_path / "peak.json")), nprocs=1, join=True)
    measured = json.loads((tmp_path / "peak.json").read_text())["peak"]
    cfg = load_config(DEBUG_CONFIG, overrides)
    (rank,) = memory_estimate.estimate(cfg)
    estimate = rank.peak(memory_estimate.configured_mode(cfg))
    print(f"{case}: measured_peak={measured} estimate={estimate} ({estimate / measured:.3f})")
    assert estimate == pytest.approx(measured, rel=ACTIVATION_TOLERANCE)
