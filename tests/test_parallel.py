"""Pipeline / expert / FSDP2 layouts under torchrun match the single-process run.

Each layout trains the same config for 10 steps in real processes over gloo; every step's
loss must match the single-process run within 1e-5 (relative), and so must every final
parameter (compared through the layout-independent checkpoints each run saves).
"""

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import base_args, final_line, run_cli, step_losses

STEPS = 10
BASE = [
    *base_args(steps=STEPS),
    *("--training.batch_size", "16", "--training.micro_batches", "4", "--training.seq_len", "64"),
]

LAYOUTS = {
    "pp2_dp2_ep2": (4, ["--parallelism.pp", "2", "--parallelism.dp", "2", "--parallelism.ep", "2"]),
    "pp4": (4, ["--parallelism.pp", "4"]),
    "pp2_interleaved": (
        2,
        ["--parallelism.pp", "2", "--parallelism.schedule", "Interleaved1F1B", "--parallelism.stages_per_rank", "2"],
    ),
    "dp4_ep4": (4, ["--parallelism.dp", "4", "--parallelism.ep", "4"]),
    # experts FSDP-sharded over the expert-data-parallel ranks (edp = 2)
    "dp4_ep2": (4, ["--parallelism.dp", "4", "--parallelism.ep", "2"]),
}
SLOW = {"dp4_ep2"}


def checkpoint_tensors(directory) -> dict[str, dict[str, torch.Tensor]]:
    """The model tensors of every rank's model file, each name in one file only."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("model-*.safetensors")):
        part = load_file(file)
        assert not set(part) & set(tensors), file
        tensors.update(part)
    return {"model": tensors}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ref") / "ckpt"
    out = run_cli(*BASE, "--checkpoint.save_final", str(ckpt)).stdout
    return step_losses(out), ckpt


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in LAYOUTS])
@pytest.mark.slow
def test_layout_matches_single_process(layout, reference, tmp_path):
    ref_losses, ref_ckpt = reference
    nproc, args = LAYOUTS[layout]
    ckpt = tmp_path / "ckpt"
    out = run_cli(*BASE, *args, "--checkpoint.save_final", str(ckpt), nproc=nproc).stdout
    losses = step_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert loss == pytest.approx(ref_losses[step], rel=1e-5), step
    # every rank wrote the model tensors it owns, each once (`checkpoint_tensors`)
    assert sorted(p.name for p in ckpt.glob("model-*")) == [f"model-{r:05d}.safetensors" for r in range(nproc)]
    ours, ref = checkpoint_tensors(ckpt), checkpoint_tensors(ref_ckpt)
    params = sorted(k for k in ref["model"])
    assert sorted(ours["model"]) == params  # global names: every expert of every layer, once
    for name in params:
        diff = (ours["model"][name] - ref["model"][name]).norm() / ref["model"][name].norm()
        assert diff < 1e-5, (name, float(diff))


@pytest.mark.slow
def test_checkpoint_from_one_layout_loads_into_another(tmp_path):
    """Saved by pp=2/dp=2/ep=2 in bf16, loaded into one process: the same state and digest."""
    ckpt = tmp_path / "ckpt"
    bf16 = ["--training.mixed_precision", "bf16", "--training.steps", "3"]
    saved = run_cli(*BASE, *bf16, *LAYOUTS["pp2_dp2_ep2"][1], "--checkpoint.save_final", str(ckpt), nproc=4).stdout
    loaded = run_cli(*BASE, *bf16, "--checkpoint.load", str(ckpt)).stdout
    assert step_losses(loaded) == {}
    assert final_line(loaded) == final_line(saved)


@pytest.mark.parametrize(
    "args, key",
    [
        (["--parallelism.pp", "2"], "parallelism.pp"),  # 2 stages x 1 rank != 1 process
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in (
                (["--parallelism.dp", "2", "--parallelism.ep", "4"], "parallelism.ep"),
                (["--parallelism.pp", "8"], "parallelism.pp"),  # more stages than layers
                (["--parallelism.schedule", "ZeroBubble"], "parallelism.schedule"),
                (
                    ["--parallelism.pp", "2", "--training.micro_batches", "1", "--training.batch_size", "4"],
                    "training.micro_batches",
                ),
            )
        ),
    ],
)
def test_bad_layouts_name_the_key(args, key):
    proc = run_cli(*BASE, *args, check=False)
    assert proc.returncode == 2 and key in proc.stderr, proc.stderr
