"""Hugging Face weights in and out: ``python -m trainer.hf import HF_DIR CKPT_DIR`` and ``export CKPT_DIR HF_DIR``.

``import`` reads a local Hugging Face model directory (``config.json`` and ``model.safetensors`` or the
shards a ``model.safetensors.index.json`` names; a pickled ``pytorch_model.bin`` is refused unread) of
Qwen1.5-MoE (``qwen2_moe``) or DeepSeek-MoE v1 (``deepseek``) and writes a dense checkpoint at step 0 with no
optimizer state: ``train.py --checkpoint.load CKPT_DIR`` starts from its weights with a fresh optimizer, and
``eval.harness --checkpoint CKPT_DIR`` scores it. A file it reads that is a symlink is refused, never followed
(as the trainer's checkpoints), and so is a weight holding NaN or infinity (one line naming the file and the
tensor); nothing of the checkpoint is left behind then. Weights are stored in float32, read (nothing mapped:
:mod:`trainer.safetensors_read`) and written one tensor at a time (host memory: the largest tensor, not the
model). A ``tokenizer.json`` beside the weights is recorded (by absolute path) as the checkpoint's tokenizer.
``--config-out FILE`` also writes a training config whose ``[model]`` is the imported one.

``export`` writes what the original's class loads and a Hub upload expects (:mod:`trainer.hf_export`):
``config.json``, ``generation_config.json``, the weights as safetensors shards (``--dtype``, float32 by
default; ``--max-shard-size``, 5GB by default) with ``model.safetensors.index.json``, and the tokenizer. A
family ``transformers`` has no class for (deepseek) also gets this project's modeling code
(:mod:`trainer.hf_modeling`, named by ``config.json``'s ``auto_map``), with which
``AutoModelForCausalLM.from_pretrained(HF_DIR, trust_remote_code=True)`` loads the export offline.
Nothing is downloaded.

It lives in the trainer layer because it writes and reads the trainer's checkpoint format;
:mod:`models.hf_mapping` holds the pure name and config correspondence.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from models import stored_shapes
from models.args import ModelArgs
from models.hf_mapping import UnsupportedModel, args_from_hf_config, check_names, sources
from trainer.checkpoint.dense import CheckpointError, Tensors, save_imported
from trainer.data.tokenizer import TokenizerError, build_tokenizer
from trainer.hf_errors import HFError
from trainer.hf_export import DEFAULT_MAX_SHARD, DTYPES, INDEX, MODEL_FILE, export_hf
from trainer.safetensors_read import SafetensorsFile, read_or_raise

# ---------------------------------------------------------------- import


def _not_a_symlink(path: Path) -> Path:
    """`path`, refused (HFError) when it is a symlink: an imported file is read where it is, never followed."""
    if path.is_symlink():
        raise HFError(
            f"{path}: is a symlink; refused, never followed (a Hugging Face cache snapshot links its files: "
            "import a copy, e.g. `huggingface-cli download MODEL --local-dir DIR`)"
        )
    return path


def _read_json(path: Path) -> dict:
    _not_a_symlink(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{path}: missing") from None
    except (OSError, ValueError, RecursionError) as e:
        raise HFError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise HFError(f"{path}: not a JSON object")
    return data


def _weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files holding the model: one, or the shards an index names (none a symlink)."""
    if _not_a_symlink(hf_dir / MODEL_FILE).is_file():
        return [hf_dir / MODEL_FILE]
    if _not_a_symlink(hf_dir / INDEX).is_file():
        weight_map = _read_json(hf_dir / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFError(f"{hf_dir / INDEX}: has no 'weight_map'")
        names = sorted(set(weight_map.values()))
        if any(Path(n).name != n for n in names):
            raise HFError(f"{hf_dir / INDEX}: shard names must be plain file names")
        return [_not_a_symlink(hf_dir / n) for n in names]
    if any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pt")):
        raise HFError(
            f"{hf_dir}: only pickled weights (*.bin / *.pt), which could run code; not read: save as safetensors"
        )
    raise HFError(f"{hf_dir}: no {MODEL_FILE} or {INDEX}")


def _reading(file: Path, fn):
    """`fn()`, a safetensors read of `file`; any failure is one HFError line naming the file."""
    return read_or_raise(file, fn, HFError)


def _open(file: Path) -> SafetensorsFile:
    return _reading(file, lambda: SafetensorsFile(file))


class HFWeights:
    """The tensors of a Hugging Face model's safetensors files (one, or every shard of an index), each read when
    it is asked for (nothing unpickled, nothing mapped: :mod:`trainer.safetensors_read`)."""

    def __init__(self, hf_dir: Path):
        self.where: dict[str, tuple[Path, SafetensorsFile]] = {}
        for file in _weight_files(hf_dir):
            handle = _open(file)
            for name in _reading(file, handle.keys):
                if name in self.where:
                    raise HFError(f"{file}: tensor {name!r} is also in {self.where[name][0].name}")
                self.where[name] = (file, handle)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name][1].shape(name)

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name`, refused (HFError naming it and its file) when it holds NaN or infinity: training
        from it could only diverge, and the error would surface far from its cause."""
        file, handle = self.where[name]
        tensor = _reading(file, lambda: handle.get_tensor(name))
        bad = _non_finite(tensor)
        if bad:
            raise HFError(f"{file}: tensor {name} holds {bad} non-finite value(s) (NaN or infinity); refused")
        return tensor


def _non_finite(tensor: torch.Tensor) -> int:
    """How many of `tensor`'s values are NaN or infinite, counted in parts of 16 Mi values (the check holds
    no more than that beside the tensor)."""
    if not tensor.is_floating_point():
        return 0
    return sum(int((~torch.isfinite(part)).sum()) for part in tensor.reshape(-1).split(1 << 24))


def _import_plan(weights: HFWeights, args: ModelArgs, source: str) -> Tensors:
    """The checkpoint's model tensors (float32, project names), each read when it is written."""
    check_names(weights.where, args)
    plan = sources(args)
    expected = stored_shapes(args)
    specs = {}
    for ours, theirs in plan.items():
        shape = weights.shape(theirs)
        if shape != expected[ours]:
            raise HFError(f"{source}: {theirs} gives {ours} the shape {shape}, the model {expected[ours]}")
        specs[ours] = (torch.float32, expected[ours])
    return Tensors(specs, lambda ours: weights.get(plan[ours]).to(torch.float32))


def _tokenizer_of(hf_dir: Path) -> str | None:
    """Absolute path of ``hf_dir/tokenizer.json`` when the trainer can use it (a note otherwise), else None."""
    path = _not_a_symlink(hf_dir / "tokenizer.json")
    if not path.is_file():
        return None
    try:
        build_tokenizer(str(path.resolve()))
    except TokenizerError as e:
        print(f"note: {path} not recorded as the tokenizer ({e})", file=sys.stderr)
        return None
    return str(path.resolve())


def import_hf(hf_dir: str, ckpt_dir: str, config_out: str | None = None, base_config: str | None = None) -> ModelArgs:
    """Convert the Hugging Face model in ``hf_dir`` into a step-0 checkpoint at ``ckpt_dir``; its ModelArgs."""
    source = Path(hf_dir)
    if not source.is_dir():
        raise HFError(f"{hf_dir}: not a directory")
    args = args_from_hf_config(_read_json(source / "config.json"))
    model = _import_plan(HFWeights(source), args, str(source))
    tokenizer = _tokenizer_of(source)
    origin = {"source": str(source.resolve()), "format": "huggingface", "tokenizer": tokenizer}
    try:
        save_imported(ckpt_dir, model, args, origin, key="CKPT_DIR")
    except CheckpointError as e:
        raise HFError(str(e)) from None
    if config_out:
        _write_config(config_out, args, ckpt_dir, tokenizer, base_config)
    return args


def _write_config(path: str, args: ModelArgs, ckpt_dir: str, tokenizer: str | None, base: str | None) -> None:
    """A training config (``base``'s, or the defaults) with the imported ``[model]``, loading ``ckpt_dir``."""
    from trainer.config import ConfigError, load_config, safe_job_name, validate
    from trainer.config_help import to_toml

    try:
        cfg = load_config(base)
        cfg.model = args
        cfg.job.name = safe_job_name(Path(ckpt_dir).resolve().name)
        cfg.checkpoint.load = str(Path(ckpt_dir).resolve())
        cfg.data.tokenizer = tokenizer or cfg.data.tokenizer
        cfg.training.seq_len = min(cfg.training.seq_len, args.max_seq_len)
        validate(cfg)
    except ConfigError as e:
        raise HFError(f"--config-out: {e}") from None
    target = Path(path)
    if target.exists() or target.is_symlink():
        raise HFError(f"--config-out: {path} exists; not replaced")
    _write_new_file(target, to_toml(cfg).encode())


def _write_new_file(target: Path, data: bytes) -> None:
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.rename(tmp, target)


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.hf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face model directory -> step-0 checkpoint")
    imp.add_argument("hf_dir", metavar="HF_DIR")
    imp.add_argument("ckpt_dir", metavar="CKPT_DIR")
    imp.add_argument("--config-out", metavar="FILE", help="also write a training config for this model")
    imp.add_argument("--base-config", metavar="TOML", help="the config --config-out starts from (default: defaults)")
    exp = sub.add_parser("export", help="checkpoint -> Hugging Face model directory")
    exp.add_argument("ckpt_dir", metavar="CKPT_DIR")
    exp.add_argument("hf_dir", metavar="HF_DIR")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the written weights")
    exp.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD,
        metavar="SIZE",
        help=f"largest safetensors file, as save_pretrained takes it (default {DEFAULT_MAX_SHARD}; at most 50GB)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            model = import_hf(args.hf_dir, args.ckpt_dir, args.config_out, args.base_config)
            print(
                f"imported {args.hf_dir} -> {args.ckpt_dir}: family {model.family}, {model.n_layers} layers, "
                f"{model.n_routed_experts} experts top-{model.top_k}; step 0, no optimizer state"
                + (f"; config {args.config_out}" if args.config_out else "")
            )
        else:
            shards = export_hf(args.ckpt_dir, args.hf_dir, args.dtype, args.max_shard_size)
            print(
                f"exported {args.ckpt_dir} -> {args.hf_dir} ({args.dtype}, {len(shards)} safetensors file(s) of at "
                f"most {args.max_shard_size})"
            )
    except (HFError, UnsupportedModel) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
