"""Dense save/resume of the whole training state with torch.distributed.checkpoint.

A checkpoint directory holds DCP shards (tensors only, keyed by global names, so it
loads into any parallel layout) and `meta.json`: format, step, model shape and a
sha256 per file. It is written to `<dir>.tmp`, checked, then renamed into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from models.args import ModelArgs

FORMAT = "moevement-dense-v1"
META = "meta.json"


class CheckpointError(RuntimeError):
    """A missing, corrupted or mismatched checkpoint; the message names the file."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def save_dense(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               step: int, model_args: ModelArgs, loss: float, tokenizer: str = "") -> None:
    """Save state after `step` completed iterations (`loss`: that iteration's); collective.

    `tokenizer` (the `data.tokenizer` spec) is recorded so that evaluation picks the same one."""
    final, tmp = Path(directory), Path(f"{directory}.tmp")
    if _rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, mode=0o700)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    if _rank0():
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        meta = {"format": FORMAT, "step": step, "loss": loss, "model": dataclasses.asdict(model_args), "files": files,
                **({"tokenizer": tokenizer} if tokenizer else {})}
        meta_tmp = tmp / f"{META}.tmp"
        meta_tmp.write_text(json.dumps(meta, indent=1))
        os.replace(meta_tmp, tmp / META)
        old = Path(f"{directory}.old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def read_meta(directory: str, model_args: ModelArgs) -> dict:
    """Validate a checkpoint directory against this model; return its metadata."""
    path = Path(directory)
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path}: missing; '{directory}' is not a complete MoEvement checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    expected = dataclasses.asdict(model_args)
    saved = meta.get("model", {})
    differ = [f"model.{k} (checkpoint {saved.get(k)!r}, config {v!r})" for k, v in expected.items() if saved.get(k) != v]
    if differ:
        raise CheckpointError(f"{meta_path}: checkpoint is of another model: {', '.join(differ)}")
    for name, digest in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from checkpoint")
        if _sha256(file) != digest:
            raise CheckpointError(f"{file}: checksum mismatch (truncated or corrupted)")
    return meta


def load_dense(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               model_args: ModelArgs) -> dict:
    """Load a dense checkpoint into `model` and `optimizer`; return its metadata (step, loss). Collective."""
    meta = read_meta(directory, model_args)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=directory)
    except Exception as e:  # DCP wraps per-rank failures; keep one clear line
        raise CheckpointError(f"{directory}: cannot load ({type(e).__name__}: {str(e).splitlines()[0]})") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta
