"""Load a dense checkpoint written by ``train.py --checkpoint.save_final DIR`` for evaluation.

The directory holds ``model.safetensors`` (every parameter by global name), ``optim.safetensors``
and ``meta.json`` (format, model shape, step, sha256 of every file; see :mod:`trainer.dense_checkpoint`).
:func:`load_checkpoint` checks the format (the old pickled DCP format is refused unread), the model
shape and the sha256 of ``model.safetensors`` before parsing it, builds the whole model on one device
with :func:`models.build_model` and reads only the model tensors (not the AdamW state) with
safetensors, by global name: nothing is unpickled, and a checkpoint saved from any parallel layout
(pipeline stages, FSDP shards, expert shards) loads into the single-device model, with or without
``torch.distributed`` initialised. There is no training config to compare the run identity with.

The tokenizer is the trainer's (:func:`trainer.tokenizer.build_tokenizer`), chosen in this order:
the ``tokenizer`` argument, ``data.tokenizer`` of the ``config`` TOML, a ``tokenizer`` (or
``data.tokenizer``) entry of ``meta.json`` (the trainer records ``data.tokenizer`` there), else ``"byte"`` (the
trainer's default).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eval.errors import EvalError
from models import build_model
from models.args import ModelArgs
from models.transformer import Transformer
from trainer.dense_checkpoint import META, MODEL_FILE, CheckpointError, check_model, load_model, open_meta, verify_files
from trainer.tokenizer import Tokenizer, build_tokenizer


@dataclass
class LoadedCheckpoint:
    """A checkpoint's model (eval mode, fp32) and tokenizer, ready to score text."""

    model: Transformer
    tokenizer: Tokenizer
    model_args: ModelArgs
    directory: str
    tokenizer_spec: str
    tokenizer_source: str  # "argument", "config", "meta.json" or "default"
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int | None:
        return self.meta.get("step")


def tokenizer_spec(meta: dict, tokenizer: str | None = None, config_tokenizer: str | None = None) -> tuple[str, str]:
    """``(spec, source)`` of the tokenizer to use; see the module docstring for the order."""
    if tokenizer:
        return tokenizer, "argument"
    if config_tokenizer:
        return config_tokenizer, "config"
    recorded = meta.get("tokenizer") or (meta.get("data") or {}).get("tokenizer")
    if isinstance(recorded, str) and recorded:
        return recorded, "meta.json"
    return "byte", "default"


def _model_args_from_meta(directory: Path, meta: dict) -> ModelArgs:
    saved = meta.get("model")
    if not isinstance(saved, dict):
        raise EvalError(f"{directory / META}: has no 'model' shape; not a checkpoint written by train.py")
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise EvalError(f"{directory / META}: unknown model keys {unknown} (checkpoint of another version?)")
    args = ModelArgs(**saved)
    try:
        args.validate()
    except ValueError as e:
        raise EvalError(f"{directory / META}: invalid model shape: {e}") from None
    return args


def load_checkpoint(
    directory: str | Path,
    *,
    tokenizer: str | None = None,
    config: str | None = None,
    device: str | torch.device = "cpu",
) -> LoadedCheckpoint:
    """Validate and load ``directory`` (a ``--checkpoint.save_final`` output) for evaluation.

    ``config``: the training TOML (its ``[model]`` must match the checkpoint; its
    ``data.tokenizer`` picks the tokenizer). Raises :class:`EvalError` with a one-line message.
    """
    path = Path(directory)
    if not path.exists():
        raise EvalError(f"checkpoint {str(path)!r}: no such directory")
    if not path.is_dir():
        raise EvalError(f"checkpoint {str(path)!r}: not a directory")
    try:
        meta = open_meta(str(path))  # the format first: the old pickled one is refused unread
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    config_tokenizer = None
    if config is not None:
        from trainer.config import ConfigError, load_config

        try:
            cfg = load_config(config)
        except ConfigError as e:
            raise EvalError(f"config: {e}") from None
        model_args, config_tokenizer = cfg.model, cfg.data.tokenizer
    else:
        model_args = _model_args_from_meta(path, meta)
    try:
        check_model(meta, path / META, model_args)
        verify_files(str(path), meta, (MODEL_FILE,))  # before safetensors parses it
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    spec, source = tokenizer_spec(meta, tokenizer, config_tokenizer)
    try:
        tok = build_tokenizer(spec)
    except ValueError as e:
        raise EvalError(f"tokenizer ({source}): {e}") from None
    if tok.vocab_size > model_args.vocab_size:
        raise EvalError(
            f"tokenizer {spec!r} ({source}) has {tok.vocab_size} ids but the checkpoint's "
            f"model.vocab_size is {model_args.vocab_size}: wrong tokenizer for this checkpoint"
        )
    with torch.random.fork_rng(devices=[]):  # build_model's init draws from the global RNG
        model = build_model(model_args, device=device)
    try:
        load_model(str(path), model)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    model.float().eval()
    return LoadedCheckpoint(
        model=model,
        tokenizer=tok,
        model_args=model_args,
        directory=str(path),
        tokenizer_spec=spec,
        tokenizer_source=source,
        meta=meta,
    )
