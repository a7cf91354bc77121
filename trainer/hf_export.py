"""``python -m trainer.hf export CKPT_DIR HF_DIR``: a dense checkpoint as the Hugging Face model directory that
``from_pretrained`` and a Hub upload expect.

The directory holds ``config.json`` (the keys of the pinned ``transformers``: :func:`models.hf_mapping.hf_config`,
with the tokenizer's special token ids), ``generation_config.json``, the tokenizer
(:mod:`trainer.hf_tokenizer`), for a family ``transformers`` has no class for this project's modeling code
(:mod:`trainer.hf_modeling`), and the weights (``--dtype``) as ``save_pretrained`` writes them: safetensors
shards of at most ``--max-shard-size`` bytes (default 5GB, ``huggingface_hub``'s split default; a tensor
larger than that is a shard of its own), filled in the model's order, ``model.safetensors`` when one shard
holds the model, else ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json`` naming each
tensor's shard. A shard size above the Hub's 50 GB per file is refused.

Memory: the checkpoint's model files are read one tensor at a time with plain reads, nothing mapped
(:mod:`trainer.safetensors_read`), and each shard is written as its tensors come: the process holds one tensor
and its converted copy, whatever the model's size. Every file's checksum is verified
first (``meta.json``). The target must be new or empty; the files are written into a temporary directory
beside it, which is renamed into place when complete, with the user's permissions (umask), as
``save_pretrained`` leaves them. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from contextlib import suppress
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch

from models import stored_shapes
from models.args import ModelArgs
from models.hf_mapping import hf_config, sources
from trainer.checkpoint.dense import CheckpointError
from trainer.checkpoint.dense_read import files_of, open_meta, verify_files
from trainer.checkpoint.safetensors_stream import SafetensorsWriter
from trainer.hf_errors import HFError
from trainer.hf_modeling import remote_code_files
from trainer.hf_tokenizer import write_tokenizer
from trainer.safetensors_read import SafetensorsFile, read_or_raise

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = "5GB"
HUB_FILE_LIMIT = 50 * 10**9  # the largest file the Hub serves (huggingface_hub's MAX_HTTP_DOWNLOAD_SIZE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``--max-shard-size``: bytes, or a number with a unit as ``save_pretrained`` takes it (``5GB``, ``500MB``,
    ``2GiB``); at least 1 byte and at most the Hub's 50 GB per file."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match[2].upper()
    if not match or unit not in _UNITS:
        raise HFError(f"--max-shard-size: {text!r} is not a size (bytes, or e.g. 5GB, 500MB, 2GiB)")
    size = int(float(match[1]) * _UNITS[unit])
    if not 1 <= size <= HUB_FILE_LIMIT:
        raise HFError(f"--max-shard-size: {text!r} must be at least 1 byte and at most the Hub's 50GB per file")
    return size


# ---------------------------------------------------------------- the checkpoint's tensors


class CheckpointTensors:
    """The model tensors of a dense checkpoint by stored name, each read when it is asked for (nothing unpickled,
    nothing mapped: :mod:`trainer.safetensors_read`); a failure is an HFError naming the file. Verify the files
    first."""

    def __init__(self, directory: str, meta: dict):
        self.where: dict[str, SafetensorsFile] = {}
        for name in files_of(meta, "model"):
            path = Path(directory) / name
            handle = read_or_raise(path, lambda p=path: SafetensorsFile(p), HFError)
            for tensor in handle.keys():
                if tensor in self.where:
                    raise HFError(f"{path}: tensor {tensor!r} is also in {self.where[tensor].path.name}")
                self.where[tensor] = handle

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(name)

    def get(self, name: str) -> torch.Tensor:
        handle = self.where[name]
        return read_or_raise(handle.path, lambda: handle.get_tensor(name), HFError)


def open_checkpoint(ckpt_dir: str) -> tuple[ModelArgs, CheckpointTensors, dict]:
    """(model shape, its model tensors, meta.json) of a dense checkpoint, every model file's checksum verified."""
    try:
        meta = open_meta(ckpt_dir)
        args = ModelArgs(**meta["model"])
        args.validate()
        verify_files(ckpt_dir, meta, files_of(meta, "model"))
    except (CheckpointError, TypeError, ValueError) as e:
        raise HFError(f"{ckpt_dir}: {e}") from None
    tensors = CheckpointTensors(ckpt_dir, meta)
    missing = [name for name in stored_shapes(args) if name not in tensors.where]
    if missing:
        raise HFError(f"{ckpt_dir}: the checkpoint's model files have no tensor {missing[0]!r}")
    return args, tensors, meta


# ---------------------------------------------------------------- shards


@dataclass
class Shard:
    """One safetensors file of the export and the tensors it holds, in order."""

    file: str
    names: list[str]


def plan_shards(nbytes: dict[str, int], limit: int) -> list[Shard]:
    """The tensors ``nbytes`` (in order) cut into shards of at most ``limit`` bytes, as ``huggingface_hub``'s
    ``split_torch_state_dict_into_shards`` cuts them (a tensor larger than the limit alone), named as
    ``save_pretrained`` names them."""
    groups: list[list[str]] = []
    used = 0
    for name, size in nbytes.items():
        if not groups or used + size > limit:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    if len(groups) == 1:
        return [Shard(MODEL_FILE, groups[0])]
    n = len(groups)
    return [Shard(f"model-{i:05d}-of-{n:05d}.safetensors", names) for i, names in enumerate(groups, 1)]


def _write_shards(directory: Path, shards: list[Shard], specs: dict, tensor_of) -> dict | None:
    """Each shard written tensor by tensor; the index (None for a single file)."""
    for shard in shards:
        shard_specs = {name: specs[name] for name in shard.names}  # one dtype: the model's order is aligned
        path = directory / shard.file
        with SafetensorsWriter(path, shard_specs, {"format": "pt"}, sha256=False, in_order=True) as writer:
            for name in shard.names:
                writer.write(name, tensor_of(name))
            writer.finish()
    if len(shards) == 1:
        return None
    return {
        "metadata": {
            "total_parameters": sum(math.prod(shape) for _, shape in specs.values()),
            "total_size": sum(dtype.itemsize * math.prod(shape) for dtype, shape in specs.values()),
        },
        "weight_map": {name: shard.file for shard in shards for name in shard.names},
    }


# ---------------------------------------------------------------- the directory


def export_hf(ckpt_dir: str, hf_dir: str, dtype: str = "float32", max_shard_size: str = DEFAULT_MAX_SHARD) -> list:
    """Write the checkpoint ``ckpt_dir`` as the Hugging Face model directory ``hf_dir`` (new or empty), one tensor
    at a time; its shards."""
    limit = parse_size(max_shard_size)
    args, tensors, meta = open_checkpoint(ckpt_dir)
    ours_of = {theirs: ours for ours, theirs in sources(args).items()}  # the model's order
    specs = {theirs: (DTYPES[dtype], tensors.shape(ours)) for theirs, ours in ours_of.items()}
    shards = plan_shards({name: d.itemsize * math.prod(shape) for name, (d, shape) in specs.items()}, limit)

    target = Path(hf_dir)
    _check_export_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        token_ids = write_tokenizer(tmp, meta.get("tokenizer") or "byte", args.max_seq_len)
        index = _write_shards(tmp, shards, specs, lambda name: tensors.get(ours_of[name]).to(DTYPES[dtype]))
        if index is not None:
            _write_json(tmp / INDEX, index, sort_keys=True)
        made_by = {"transformers_version": version("transformers")}
        _write_json(tmp / "config.json", hf_config(args, dtype) | token_ids | made_by)
        generation = {k: v for k, v in token_ids.items() if v is not None}
        _write_json(tmp / "generation_config.json", generation | made_by)
        for code in remote_code_files(args.family):
            shutil.copyfile(code, tmp / code.name)
        _open_to_the_user(tmp)
        if target.exists():
            target.rmdir()  # empty, checked above
        os.rename(tmp, target)
    except BaseException:
        with suppress(OSError):
            shutil.rmtree(tmp)
        raise
    return shards


def _check_export_target(target: Path) -> None:
    if target.is_symlink():
        raise HFError(f"{target}: is a symlink; refused, never followed")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise HFError(f"{target}: exists and is not an empty directory; not replaced (choose a new directory)")


def _write_json(path: Path, data: dict, sort_keys: bool = False) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")


def _open_to_the_user(directory: Path) -> None:
    """The permissions the user's umask gives new files and directories, as ``save_pretrained`` leaves them: the
    temporary directory and the shards were created owner-only while incomplete."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)  # files this export created: no symlink among them
