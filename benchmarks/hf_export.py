"""The Hugging Face export's time, peak memory and shards at a size that does not fit in memory.

    python -m benchmarks.hf_export --checkpoint DIR --out HF_DIR [--dtype bfloat16] [--max-shard-size 5GB]
    python -m benchmarks.hf_export --config TOML [--model.KEY VALUE ...] --out HF_DIR [...]

With `--checkpoint`, a dense checkpoint (e.g. `train.py ... --checkpoint.save_final DIR`) is exported; with
`--config`, a weights-only checkpoint of that config's model (`--model.*` overrides scale it) is first written
next to `--out`, tensor by tensor with a constant per tensor (the values do not matter to the export's
memory or time; the checkpoint never exists in memory either), and deleted afterwards. The export runs as
`python -m trainer.hf export` in a child process; the line gives its wall time, its peak resident memory
(the child's ru_maxrss, as `/usr/bin/time -v` reports it), the model's parameters and bytes, and the shards.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from models import stored_shapes
from trainer.checkpoint.dense import Tensors, save_imported
from trainer.config import load_config


def synthetic_checkpoint(config: str, overrides: list[str], directory: Path) -> int:
    """A weights-only checkpoint of the config's model at `directory`, written a tensor at a time; its
    parameters."""
    args = load_config(config, overrides).model
    shapes = stored_shapes(args)
    index = {name: i for i, name in enumerate(shapes)}
    specs = {name: (torch.float32, tuple(shape)) for name, shape in shapes.items()}

    def tensor_of(name: str) -> torch.Tensor:
        return torch.full(specs[name][1], (index[name] % 97) * 1e-3)

    save_imported(str(directory), Tensors(specs, tensor_of), args, {"source": "benchmarks.hf_export"}, key="--out")
    return sum(math.prod(shape) for shape in shapes.values())


def export(checkpoint: Path, out: Path, dtype: str, max_shard_size: str) -> tuple[float, int]:
    """(wall seconds, the child's peak resident bytes) of `python -m trainer.hf export`."""
    cmd = [sys.executable, "-m", "trainer.hf", "export", str(checkpoint), str(out), "--dtype", dtype]
    start = time.perf_counter()
    subprocess.run([*cmd, "--max-shard-size", max_shard_size], check=True)
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="a dense checkpoint to export")
    source.add_argument("--config", help="write a weights-only checkpoint of this config's model first")
    parser.add_argument("--out", type=Path, required=True, help="the export directory (new)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-shard-size", default="5GB")
    args, overrides = parser.parse_known_args()
    checkpoint = args.checkpoint or args.out.with_name(args.out.name + ".checkpoint")
    if args.config:
        params = synthetic_checkpoint(args.config, overrides, checkpoint)
        print(f"wrote {checkpoint}: {params} parameters, {params * 4 / 1e9:.1f} GB of float32", flush=True)
    try:
        seconds, peak = export(checkpoint, args.out, args.dtype, args.max_shard_size)
    finally:
        if args.config:
            shutil.rmtree(checkpoint)
    index = args.out / "model.safetensors.index.json"
    shards = len(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else 1
    written = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
    print(
        f"hf_export dtype={args.dtype} max_shard_size={args.max_shard_size} shards={shards} "
        f"weights_gb={written / 1e9:.2f} wall_s={seconds:.1f} peak_rss_gb={peak / 1e9:.2f}"
    )


if __name__ == "__main__":
    main()
