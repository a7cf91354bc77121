"""Load a dense checkpoint written by ``train.py --checkpoint.save_final DIR`` for evaluation.

The directory holds the model files ``model-NNNNN.safetensors`` (every parameter by global name, each in
one file), the optimizer files ``optim-NNNNN.safetensors`` and ``meta.json`` (format, model shape, step,
sha256 of every file, sealed; see :mod:`trainer.checkpoint.dense`).
:func:`load_checkpoint` checks the format and the seal (older formats are refused, the pickled DCP one
unread), the model
shape and the sha256 of every model file before parsing it, builds the whole model on one device
with :func:`models.build_model` and reads only the model tensors (not the AdamW state) with
safetensors, by global name: nothing is unpickled, and a checkpoint saved from any parallel layout
(pipeline stages, FSDP shards, expert shards) loads into the single-device model, with or without
``torch.distributed`` initialised. There is no training config to compare the run identity with.

The tokenizer is the trainer's (:func:`trainer.data.tokenizer.build_tokenizer`), chosen in this order:
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
from trainer.checkpoint.dense_read import (
    META,
    CheckpointError,
    check_model,
    files_of,
    load_model,
    open_meta,
    verify_files,
)
from trainer.data.tokenizer import Tokenizer, build_tokenizer


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


def _read_meta(path: Path) -> dict:
    """``meta.json`` of the checkpoint directory ``path``, its format checked first (the old pickled
    format is refused unread). Raises :class:`EvalError`."""
    if not path.exists():
        raise EvalError(f"checkpoint {str(path)!r}: no such directory")
    if not path.is_dir():
        raise EvalError(f"checkpoint {str(path)!r}: not a directory")
    try:
        return open_meta(str(path))
    except CheckpointError as e:
        raise EvalError(str(e)) from None


def _model_args(path: Path, meta: dict, config: str | None) -> tuple[ModelArgs, str | None]:
    """``(model shape, data.tokenizer of the config)``: both from the training TOML ``config`` if given,
    else the shape recorded in ``meta`` and no tokenizer. Raises :class:`EvalError`."""
    if config is None:
        return _model_args_from_meta(path, meta), None
    from trainer.config import ConfigError, load_config

    try:
        cfg = load_config(config)
    except ConfigError as e:
        raise EvalError(f"config: {e}") from None
    return cfg.model, cfg.data.tokenizer


def _verify(path: Path, meta: dict, model_args: ModelArgs) -> None:
    """Check that the checkpoint's model is ``model_args`` and that each model file matches its
    sha256 in ``meta`` (before safetensors parses it). Raises :class:`EvalError`."""
    try:
        check_model(meta, path / META, model_args)
        verify_files(str(path), meta, files_of(meta, "model"))
    except CheckpointError as e:
        raise EvalError(str(e)) from None


def _tokenizer(
    meta: dict, model_args: ModelArgs, tokenizer: str | None, config_tokenizer: str | None
) -> tuple[Tokenizer, str, str]:
    """``(tokenizer, spec, source)``, chosen by :func:`tokenizer_spec`; raises :class:`EvalError` when it
    cannot be built or has more ids than the model's vocabulary."""
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
    return tok, spec, source


def _load_model(path: Path, meta: dict, model_args: ModelArgs, device: str | torch.device) -> Transformer:
    """The whole model built on ``device`` (leaving the global RNG untouched) with the checkpoint's
    weights read by global name, in eval mode and fp32. Raises :class:`EvalError`."""
    with torch.random.fork_rng(devices=[]):  # build_model's init draws from the global RNG
        model = build_model(model_args, device=device)
    try:
        load_model(str(path), meta, model)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    model.float().eval()
    return model


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
    meta = _read_meta(path)
    model_args, config_tokenizer = _model_args(path, meta, config)
    _verify(path, meta, model_args)
    tok, spec, source = _tokenizer(meta, model_args, tokenizer, config_tokenizer)
    model = _load_model(path, meta, model_args, device)
    return LoadedCheckpoint(
        model=model,
        tokenizer=tok,
        model_args=model_args,
        directory=str(path),
        tokenizer_spec=spec,
        tokenizer_source=source,
        meta=meta,
    )
