"""Hugging Face weights in and out: ``python -m trainer.hf import HF_DIR CKPT_DIR`` and ``export CKPT_DIR HF_DIR``.

``import`` reads a local Hugging Face model directory (``config.json`` and ``model.safetensors`` or a
sharded ``model.safetensors.index.json``; a pickled ``pytorch_model.bin`` is refused unread) of
Qwen1.5-MoE (``qwen2_moe``) or DeepSeek-MoE v1 (``deepseek``) and writes a dense checkpoint at step 0
with no optimizer state: ``train.py --checkpoint.load CKPT_DIR`` starts from its weights with a fresh
optimizer, and ``eval.harness --checkpoint CKPT_DIR`` scores it. A file it reads that is a symlink is
refused, never followed (as the trainer's checkpoints), and so is a weight holding NaN or infinity (one
line naming the file and the tensor); nothing of the checkpoint is left behind then. Weights are stored
in float32, read and written one tensor at a time (host memory: the largest tensor, not the model). A
``tokenizer.json`` beside the weights is recorded (by absolute path) as the checkpoint's tokenizer.
``--config-out FILE`` also writes a training config whose ``[model]`` is the imported one.

``export`` writes what the original's class loads (see :mod:`models.hf_mapping`): ``config.json``,
``model.safetensors`` (``--dtype``, float32 by default), and the tokenizer: the run's ``tokenizer.json``
or, for the byte tokenizer, an equivalent byte-level ``tokenizer.json``, with a ``tokenizer_config.json``.
A family ``transformers`` has no class for (deepseek) also gets this project's modeling code
(:mod:`trainer.hf_modeling`, named by ``config.json``'s ``auto_map``), with which
``AutoModelForCausalLM.from_pretrained(HF_DIR, trust_remote_code=True)`` loads the export offline.
Nothing is downloaded; the target must be new or empty, and is written under a temporary name, then renamed.

It lives in the trainer layer because it writes and reads the trainer's checkpoint format;
:mod:`models.hf_mapping` holds the pure name and config correspondence.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from contextlib import suppress
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models import stored_shapes
from models.args import ModelArgs
from models.hf_mapping import UnsupportedModel, args_from_hf_config, check_names, hf_config, sources
from trainer.checkpoint.dense import CheckpointError, Tensors, save_imported
from trainer.checkpoint.dense_read import StoredTensors, files_of, open_meta, verify_files
from trainer.checkpoint.safetensors_stream import write_safetensors
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, build_tokenizer
from trainer.hf_modeling import remote_code_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFError(RuntimeError):
    """A bad Hugging Face directory, checkpoint or target; one line naming the file."""


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
    try:
        return fn()
    except (SafetensorError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HFError(f"{file}: unreadable ({reason})") from None


def _open(file: Path):
    return _reading(file, lambda: safe_open(str(file), framework="pt", device="cpu"))


class HFWeights:
    """The tensors of a Hugging Face model's safetensors files, read one at a time (nothing unpickled)."""

    def __init__(self, hf_dir: Path):
        self.where: dict[str, tuple[Path, object]] = {}
        for file in _weight_files(hf_dir):
            handle = _open(file)
            for name in _reading(file, handle.keys):
                self.where[name] = (file, handle)

    def shape(self, name: str) -> tuple[int, ...]:
        file, handle = self.where[name]
        return tuple(_reading(file, lambda: handle.get_slice(name).get_shape()))

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


# ---------------------------------------------------------------- export


def open_checkpoint(ckpt_dir: str) -> tuple[ModelArgs, StoredTensors, dict]:
    """(model shape, its model tensors, meta.json) of a dense checkpoint, every model file's checksum verified."""
    try:
        meta = open_meta(ckpt_dir)
        args = ModelArgs(**meta["model"])
        args.validate()
        verify_files(ckpt_dir, meta, files_of(meta, "model"))
        tensors = StoredTensors(ckpt_dir, meta, "model")
    except (CheckpointError, TypeError, ValueError) as e:
        raise HFError(f"{ckpt_dir}: {e}") from None
    missing = sorted(set(stored_shapes(args)) - set(tensors.where))
    if missing:
        raise HFError(f"{ckpt_dir}: the checkpoint's model files have no tensor {missing[0]!r}")
    return args, tensors, meta


def export_hf(ckpt_dir: str, hf_dir: str, dtype: str = "float32") -> Path:
    """Write the checkpoint ``ckpt_dir`` as a Hugging Face model directory ``hf_dir`` (new or empty), one
    tensor at a time."""
    args, tensors, meta = open_checkpoint(ckpt_dir)
    config = hf_config(args, dtype)
    ours_of = {theirs: ours for ours, theirs in sources(args).items()}
    try:
        specs = {theirs: (DTYPES[dtype], tensors.shape(ours)) for theirs, ours in ours_of.items()}
    except CheckpointError as e:
        raise HFError(str(e)) from None

    def tensor_of(name: str) -> torch.Tensor:
        return tensors.get(ours_of[name]).to(DTYPES[dtype])

    target = Path(hf_dir)
    _check_export_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write_safetensors(tmp / MODEL_FILE, specs, tensor_of, metadata={"format": "pt"}, sha256=False)
        eos = _write_tokenizer(tmp, meta.get("tokenizer") or "byte", args)
        config["eos_token_id"] = eos
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for code in remote_code_files(args.family):
            shutil.copyfile(code, tmp / code.name)
        if target.exists():
            target.rmdir()  # empty, checked above
        os.rename(tmp, target)
    except BaseException as e:
        with suppress(OSError):
            shutil.rmtree(tmp)
        if isinstance(e, CheckpointError):
            raise HFError(str(e)) from None
        raise
    return target


def _check_export_target(target: Path) -> None:
    if target.is_symlink():
        raise HFError(f"{target}: is a symlink; refused, never followed")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise HFError(f"{target}: exists and is not an empty directory; not replaced (choose a new directory)")


def _write_tokenizer(directory: Path, spec: str, args: ModelArgs) -> int:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the run's tokenizer in ``directory``; its eos id."""
    try:
        tok = build_tokenizer(spec)
    except TokenizerError as e:
        raise HFError(f"checkpoint tokenizer: {e}") from None
    if isinstance(tok, ByteTokenizer):
        byte_level_tokenizer().save(str(directory / "tokenizer.json"))
        eos_token = BYTE_EOS
    else:
        assert isinstance(tok, HFTokenizer)
        shutil.copyfile(tok.path, directory / "tokenizer.json")
        eos_token = tok.eos_token
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "model_max_length": args.max_seq_len,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return int(tok.eos_id)


BYTE_EOS = "</s>"


def byte_level_tokenizer():
    """A ``tokenizers`` Tokenizer like :class:`trainer.data.tokenizer.ByteTokenizer` (byte b is id b; `</s>` 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the others for code points 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


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
            target = export_hf(args.ckpt_dir, args.hf_dir, args.dtype)
            print(f"exported {args.ckpt_dir} -> {target} ({args.dtype})")
    except (HFError, UnsupportedModel) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
