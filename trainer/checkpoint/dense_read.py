"""Reading a dense checkpoint (`trainer.checkpoint.dense` writes it), by every rank in parallel.

Nothing is unpickled: the sealed `meta.json` is checked first, each file against its sha256 (the files
spread over the ranks) before anything parses it, then read with safetensors, and every rank takes the
tensors it holds (its slice of FSDP-sharded ones), so a checkpoint saved in any parallel layout loads into
any other. A checkpoint of a run must hold optimizer state for every parameter, with AdamW's step count
equal to `step`. Older formats are refused with one line: v2 and v3 (`meta.json` not sealed), and the DCP
format v1 (whose `.metadata` is a pickle) without being read. Loading an imported (weights-only)
checkpoint sets the weights and leaves the optimizer fresh.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor, distribute_tensor

from models.args import ModelArgs
from models.experts import stacked_experts
from trainer.checkpoint.dense import file_sha256
from trainer.checkpoint.identity import RunIdentity
from trainer.checkpoint.publish import (
    FORMAT,
    LINEAGE,
    LINEAGE_ID,
    META,
    OLD_FORMAT,
    SHARD_FILE,
    UNSEALED_FORMATS,
    CheckpointError,
)
from trainer.checkpoint.rank0 import all_records
from trainer.checkpoint.state import OPTIM_PREFIX
from trainer.sealed_json import seal_holds


def is_imported(meta: dict) -> bool:
    """A checkpoint written by `save_imported`: weights only, from outside any run (`open_meta` checked
    that such a checkpoint is of step 0 and lists no optimizer file)."""
    return meta.get("weights_only") is True


def open_meta(directory: str) -> dict:
    """The checked `meta.json` of a checkpoint in this format: sealed, its files named as this program
    names them, its step and loss numbers. Older formats are refused (the DCP one unread)."""
    path = Path(directory)
    meta_path = path / META
    old = (
        f"{path}: old checkpoint format {OLD_FORMAT} (torch DCP, whose .metadata is a pickle that could run "
        f"code); not loaded: re-save it with this version of train.py"
    )
    if os.path.lexists(path / ".metadata"):
        raise CheckpointError(old)
    if meta_path.is_symlink() or not meta_path.is_file():
        why = "a symlink (refused, never followed)" if meta_path.is_symlink() else "missing"
        raise CheckpointError(f"{meta_path}: {why}; '{directory}' is not a complete MoEvement checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{meta_path}: unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: not a JSON object")
    if meta.get("format") == OLD_FORMAT:
        raise CheckpointError(old)
    if meta.get("format") in UNSEALED_FORMATS:
        raise CheckpointError(
            f"{meta_path}: format {meta['format']} of an older version (meta.json not sealed); not loaded: "
            f"load it with that version and save it again with --checkpoint.save_final"
        )
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if not seal_holds(meta):
        raise CheckpointError(f"{meta_path}: does not match its seal (edited or damaged); not loaded")
    _check_fields(meta, meta_path)
    return meta


def _check_fields(meta: dict, meta_path: Path) -> None:
    """`files` maps this format's file names to sha256 strings, with a model file; `step` is an integer
    >= 0 and `loss` a number; a weights-only checkpoint is of step 0 and lists no optimizer file."""
    files = meta.get("files")
    if not isinstance(files, dict) or not all(isinstance(n, str) and SHARD_FILE.match(n) for n in files):
        raise CheckpointError(f"{meta_path}: 'files' must map model-NNNNN.safetensors / optim-NNNNN.safetensors")
    if not all(isinstance(sha, str) for sha in files.values()) or not files_of(meta, "model"):
        raise CheckpointError(f"{meta_path}: 'files' must give a sha256 per file and hold a model file")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{meta_path}: 'step' must be an integer >= 0, got {step!r}")
    if not isinstance(meta.get("loss", 0.0), (int, float)) or isinstance(meta.get("loss"), bool):
        raise CheckpointError(f"{meta_path}: 'loss' must be a number, got {meta.get('loss')!r}")
    lineage = meta.get(LINEAGE)
    if lineage is not None and not (isinstance(lineage, str) and LINEAGE_ID.fullmatch(lineage)):
        raise CheckpointError(f"{meta_path}: '{LINEAGE}' must be 16 hex digits, got {lineage!r}")
    if meta.get("weights_only", False) not in (True, False):
        raise CheckpointError(f"{meta_path}: 'weights_only' must be true or false")
    if meta.get("weights_only") and (step != 0 or files_of(meta, "optim") or meta.get("run") is not None):
        raise CheckpointError(f"{meta_path}: a weights-only checkpoint is of step 0 with no run and no optimizer file")


def files_of(meta: dict, kind: str) -> list[str]:
    """The names of the checkpoint's `kind` ("model" or "optim") files (`open_meta` checked them)."""
    return sorted(name for name in meta["files"] if SHARD_FILE.match(name)[1] == kind)


def check_model(meta: dict, meta_path: Path, model_args: ModelArgs) -> None:
    """Refuse a checkpoint of another model shape, naming the keys that differ."""
    saved = meta.get("model")
    saved = saved if isinstance(saved, dict) else {}
    differ = [
        f"model.{k} (checkpoint {saved.get(k)!r}, config {v!r})"
        for k, v in dataclasses.asdict(model_args).items()
        if saved.get(k) != v
    ]
    if differ:
        raise CheckpointError(f"{meta_path}: checkpoint is of another model: {', '.join(differ)}")


def verify_files(directory: str, meta: dict, names: list[str]) -> None:
    """Check the sha256 of each of `names` against `meta.json` before anything parses them."""
    for name in names:
        file = Path(directory) / name
        if file.is_symlink():
            raise CheckpointError(f"{file}: is a symlink; refused, never followed")
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from checkpoint")
        if file_sha256(file) != meta["files"][name]:
            raise CheckpointError(f"{file}: checksum mismatch (truncated or corrupted)")


def _verify_spread(directory: str, meta: dict) -> None:
    """Every file of the checkpoint verified once, the files spread over the ranks; every rank raises the
    same first error. Collective."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    error = None
    try:
        verify_files(directory, meta, sorted(meta["files"])[rank::world])
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in all_records(error) if e is not None]
    if errors:
        raise CheckpointError(errors[0])


class StoredTensors:
    """The tensors of a checkpoint's `kind` files by stored name, read one at a time with safetensors
    (nothing unpickled); any failure is a CheckpointError naming the file. Verify the files first."""

    def __init__(self, directory: str, meta: dict, kind: str):
        self.where: dict[str, tuple[Path, object]] = {}
        self.files = f"{directory}: the checkpoint's {kind} files"
        for name in files_of(meta, kind):
            file = Path(directory) / name
            handle = self._reading(file, lambda f=file: safe_open(str(f), framework="pt", device="cpu"))
            for tensor in self._reading(file, handle.keys):
                if tensor in self.where:
                    raise CheckpointError(f"{file}: tensor {tensor!r} is also in {self.where[tensor][0].name}")
                self.where[tensor] = (file, handle)

    @staticmethod
    def _reading(file: Path, read):
        try:
            return read()
        except (SafetensorError, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{file}: unreadable ({reason})") from None

    def _where(self, name: str) -> tuple[Path, object]:
        if name not in self.where:
            raise CheckpointError(f"{self.files} have no tensor {name!r}")
        return self.where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        file, handle = self._where(name)
        return tuple(self._reading(file, lambda: handle.get_slice(name).get_shape()))

    def get(self, name: str) -> torch.Tensor:
        file, handle = self._where(name)
        return self._reading(file, lambda: handle.get_tensor(name))

    def take(self, names: list[str], like: torch.Tensor) -> torch.Tensor:
        """Tensor `names[0]`, or the stack of `names` (a stacked expert weight: one name per expert), shaped
        like `like`; only this rank's part when `like` is a DTensor."""
        shape = tuple(like.shape) if len(names) == 1 else tuple(like.shape[1:])
        parts = [self.get(name) for name in names]
        for name, part in zip(names, parts, strict=True):
            if tuple(part.shape) != shape:
                file = self.where[name][0]
                raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(part.shape)}, the model {shape}")
        full = parts[0] if len(names) == 1 else torch.stack(parts)
        if isinstance(like, DTensor):
            return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
        return full


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _stored_names(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, list[str]]]:
    """(parameter, the names it is stored under) of every parameter: one name per expert of a stacked one."""
    stacked = stacked_experts(model)
    return [(p, stacked[name][1] if name in stacked else [name]) for name, p in model.named_parameters()]


@torch.no_grad()
def load_model(directory: str, meta: dict, model: torch.nn.Module) -> None:
    """Copy every parameter of `model` (plain or DTensor) from the checkpoint's model files, by global name."""
    reader = StoredTensors(directory, meta, "model")
    for param, stored in _stored_names(model):
        _local(param).copy_(reader.take(stored, param))


@torch.no_grad()
def _load_optimizer(directory: str, meta: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Set the AdamW state of every parameter of `model` from the checkpoint's optimizer files. A checkpoint of
    a run that trained (step >= 1) must hold it for every parameter, with AdamW's step count equal to the
    checkpoint's `step`: a missing optimizer file or a changed step is refused, never trained on."""
    reader = StoredTensors(directory, meta, "optim")
    keys: dict[str, list[str]] = defaultdict(list)
    for stored in reader.where:
        param_name, _, key = stored[len(OPTIM_PREFIX) :].rpartition(".")
        keys[param_name].append(key)
    meta_path, step = Path(directory) / META, meta["step"]
    for param, names in _stored_names(model):
        if step >= 1 and names[0] not in keys:
            raise CheckpointError(
                f"{meta_path}: step {step} but no optimizer state for {names[0]!r} in the files it lists "
                f"({', '.join(files_of(meta, 'optim')) or 'no optimizer file'}): one is missing"
            )
        state = {}
        for key in sorted(keys.get(names[0], ())):
            stored = [f"{OPTIM_PREFIX}{name}.{key}" for name in names]
            if key == "step":  # AdamW keeps its step count as a CPU scalar (every expert's is the same)
                state[key] = reader.take(stored[:1], torch.empty(()))
                if float(state[key]) != step:
                    raise CheckpointError(
                        f"{reader.where[stored[0]][0]}: {stored[0]} is {float(state[key]):g}, but {meta_path} "
                        f"says step {step} (one of them was changed)"
                    )
            else:
                state[key] = torch.zeros_like(param)
                _local(state[key]).copy_(reader.take(stored, param))
        if state:
            optimizer.state[param] = state


def load_dense(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg) -> tuple[dict, list[str]]:
    """Validate `directory` against the run `cfg` and load it into this rank's `model` parts and `optimizer`.
    Collective (the files' checksums are spread over the ranks).

    Returns its metadata (step, loss) and the config keys that differ from the saved run's, which is
    empty unless `checkpoint.load_other_config` let them pass (IdentityError otherwise). An imported
    checkpoint (`save_imported`) has no run to compare and no optimizer state: the optimizer stays fresh."""
    meta = open_meta(directory)
    meta_path = Path(directory) / META
    check_model(meta, meta_path, cfg.model)
    identity = RunIdentity.of_dense(cfg)
    if is_imported(meta):  # weights from outside any run: no identity to compare, no optimizer state
        differ = []
    elif cfg.checkpoint.load_other_config:
        differ = identity.mismatch(meta.get("run"), check_job=False)
    else:
        identity.check(meta.get("run"), str(meta_path), check_job=False)
        differ = []
    _verify_spread(directory, meta)
    load_model(directory, meta, model)
    if not is_imported(meta):
        _load_optimizer(directory, meta, model, optimizer)
    return meta, differ
