"""Dense checkpoints of the whole training state: the format, and saving it, by every rank in parallel.

A checkpoint (format `moevement-dense-v4`) is a directory holding, for each rank `r` that owns tensors,
`model-<r:05d>.safetensors` (parameters by global name) and `optim-<r:05d>.safetensors` (the AdamW
tensors, named `optim.<param>.<key>`), each tensor whole and in exactly one file, and `meta.json`:
format, step, loss, model shape, tokenizer, the run identity (`RunIdentity.of_dense`), the run lineage
that saved it (periodic saves: `trainer.checkpoint.lineage`) and a sha256 per file, sealed
(`trainer.sealed_json`: the sha256 of all the rest, checked before anything in it is used).
Each rank writes the tensors it owns (`trainer.checkpoint.state`: FSDP shards assembled within their
group one tensor at a time), so no rank holds more than the largest tensor beyond its own state; rank 0
gathers only the file names and checksums, and publishes the directory atomically
(`trainer.checkpoint.publish`).

A checkpoint of a run holds optimizer state for every parameter, with AdamW's step count equal to `step`.
An imported checkpoint (`python -m trainer.hf import`, `save_imported`) says `"weights_only": true` (with
`"run": null`, an `imported` record and step 0) and has no optimizer file. Reading either, in any parallel
layout, is `trainer.checkpoint.dense_read`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from models.args import ModelArgs
from trainer.checkpoint.identity import RunIdentity
from trainer.checkpoint.publish import (
    FORMAT,
    LINEAGE,
    CheckpointError,
    begin,
    check_target,
    publish,
    remove_temporary,
    shard_file,
    trusted_temporary,
)
from trainer.checkpoint.rank0 import from_rank0, gather_to_rank0, is_rank0
from trainer.checkpoint.safetensors_stream import SafetensorsWriter, Spec, write_safetensors
from trainer.checkpoint.state import OPTIM_PREFIX, owned_tensors, training_plan
from trainer.sealed_json import sealed

KEY = "checkpoint.save_final"
KINDS = ("model", "optim")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def check_save_target(directory: str) -> None:
    """Refuse, before any training, a save target that is unwritable, a file, a symlink, or a
    non-empty directory other than a checkpoint of this project. Collective."""
    error = None
    if is_rank0():
        try:
            check_target(Path(directory), KEY)
        except CheckpointError as e:
            error = str(e)
    error = from_rank0(error)
    if error is not None:
        raise CheckpointError(error)


# ---------------------------------------------------------------- writing


@dataclasses.dataclass
class Tensors:
    """What a checkpoint file will hold: each tensor's dtype and shape, and the tensor itself on demand (so
    that a file is written one tensor at a time)."""

    specs: dict[str, Spec]
    tensor_of: Callable[[str], torch.Tensor]


def _kind(name: str) -> str:
    return "optim" if name.startswith(OPTIM_PREFIX) else "model"


def write_owned(
    tmp: Path | None, rank: int, tensors: Iterator[tuple[str, torch.Tensor]], specs: dict
) -> dict[str, str]:
    """Write this rank's files into `tmp` from `tensors` (in `specs`' order); {file: sha256}.

    `tensors` may be a collective walk: without a directory to write to (None), or on an error, it is
    drained (before the error is raised), so that no other rank waits for this one."""
    if tmp is None:
        for _ in tensors:
            pass
        return {}
    try:
        with ExitStack() as stack:
            writers = {
                kind: stack.enter_context(SafetensorsWriter(tmp / shard_file(kind, rank), part, in_order=True))
                for kind in KINDS
                if (part := {n: spec for n, spec in specs.items() if _kind(n) == kind})
            }
            for name, tensor in tensors:
                writers[_kind(name)].write(name, tensor)
            return {shard_file(kind, rank): writer.finish() for kind, writer in writers.items()}
    except (OSError, ValueError):
        for _ in tensors:
            pass
        raise


def _save(
    path: Path,
    key: str,
    meta: dict,
    write: Callable[[Path | None], dict[str, str]],
    published: Callable[[], None] | None = None,
) -> None:
    """Rank 0 makes the temporary, every rank `write`s its files into it (None: a rank that cannot trust
    it writes nothing, but still takes part in `write`'s collectives), rank 0 writes `meta.json` with every
    file's sha256 and renames it into place; every rank raises the same CheckpointError, if any.
    `published`, once the checkpoint is in place: on rank 0 right after the rename, before it tells the
    others; on every other rank once told. Collective."""
    tmp, old_files, where, error = open_temporary(path, key)
    files = {}
    try:
        try:
            files = write(None if error else where)
        except (OSError, ValueError) as e:
            error = f"{key}: cannot save to {path} ({e})"
        records = gather_to_rank0((files, error))
    except BaseException:  # nothing half-written stays behind, whatever stopped the save (a peer's death)
        if tmp is not None:
            remove_temporary(tmp)
        raise
    if records is not None:
        error = publish_records(tmp, path, old_files, meta, records, key)
        if error is None and published is not None:
            published()
    error = from_rank0(error)
    if error is not None:
        raise CheckpointError(error)
    if records is None and published is not None:
        published()


def open_temporary(path: Path, key: str) -> tuple[Path | None, list[str], Path, str | None]:
    """Rank 0 makes the fresh temporary directory of a save to `path` (`publish.begin`), every rank learns
    where it is and checks it (`trusted_temporary`). Collective. Returns (rank 0's temporary, None
    elsewhere; the old checkpoint's files it replaces; the temporary; this rank's reason not to write
    into it, or None). CheckpointError on every rank when rank 0 could not make it."""
    tmp, old_files, error = None, [], None
    if is_rank0():
        try:
            tmp, old_files = begin(path, key)
        except CheckpointError as e:
            error = str(e)
    try:
        where, error = from_rank0((None if tmp is None else str(tmp), error))
    except BaseException:  # a peer's death: the temporary goes with the save
        if tmp is not None:
            remove_temporary(tmp)
        raise
    if error is not None:
        raise CheckpointError(error)
    try:
        trusted_temporary(Path(where), key)
    except CheckpointError as e:
        error = str(e)
    return tmp, old_files, Path(where), error


def publish_records(tmp: Path, path: Path, old_files: list[str], meta: dict, records: list, key: str) -> str | None:
    """Rank 0: publish `tmp` with the ranks' `records` ((files, error) of each), or remove it; the error
    line, if any."""
    errors = [error for _, error in records if error is not None]
    try:
        if errors:
            return errors[0]
        files = {name: sha for part, _ in records for name, sha in part.items()}
        publish(tmp, path, old_files, sealed({**meta, "files": dict(sorted(files.items()))}))
        return None
    except OSError as e:
        return f"{key}: cannot save to {path} ({e})"
    finally:
        if tmp.exists():
            remove_temporary(tmp)


def save_dense(
    directory: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    loss: float,
    cfg,
    published: Callable[[], None] | None = None,
) -> None:
    """Save this job's training state (`model`'s parameters and their `optimizer` state, on every rank)
    after `step` iterations (`loss`: that iteration's) as a checkpoint of the run `cfg`. Collective.
    `published`: called on every rank once the checkpoint is in place (see `_save`)."""
    plan = training_plan(model, optimizer)
    specs = owned_specs(plan)
    rank = dist.get_rank() if dist.is_initialized() else 0
    meta = dense_meta(step, loss, cfg)
    _save(Path(directory), KEY, meta, lambda tmp: write_owned(tmp, rank, owned_tensors(plan), specs), published)


def dense_meta(step: int, loss: float, cfg, lineage: str | None = None) -> dict:
    """`meta.json` of the training state after `step` iterations of the run `cfg` (of the run lineage
    `lineage`, if any: `trainer.checkpoint.lineage`), but its files and seal."""
    return {
        "format": FORMAT,
        "step": step,
        "loss": loss,
        "model": dataclasses.asdict(cfg.model),
        "run": RunIdentity.of_dense(cfg).to_json(),
        **({"tokenizer": cfg.data.tokenizer} if cfg.data.tokenizer else {}),
        **({LINEAGE: lineage} if lineage else {}),
    }


def owned_specs(plan: list) -> dict[str, Spec]:
    """{stored name: (dtype, shape)} of the tensors this rank owns in `plan` (`training_plan`)."""
    return {name: (dtype, shape) for unit in plan if unit.owner for name, dtype, shape in unit.specs()}


def save_imported(directory: str, model: Tensors, model_args: ModelArgs, origin: dict, key: str) -> None:
    """Save the model tensors `model` taken from elsewhere (`origin`: where from) as a step-0 checkpoint with
    no optimizer state and no run identity: `checkpoint.load` starts a run from its weights with a fresh
    optimizer. `key` names the argument in error messages. Single process."""
    meta = {
        "format": FORMAT,
        "step": 0,
        "model": dataclasses.asdict(model_args),
        "run": None,
        "imported": origin,
        "weights_only": True,
    }
    if origin.get("tokenizer"):
        meta["tokenizer"] = origin["tokenizer"]
    name = shard_file("model", 0)

    def write(tmp: Path | None) -> dict[str, str]:
        return {} if tmp is None else {name: write_safetensors(tmp / name, model.specs, model.tensor_of)}

    _save(Path(directory), key, meta, write)
