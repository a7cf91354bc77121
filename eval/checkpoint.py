"""Load a dense checkpoint written by ``train.py --checkpoint.save_final DIR`` for evaluation.

The directory holds DCP shards keyed by global parameter names plus ``meta.json`` (model shape,
step, sha256 of every file; see :mod:`trainer.checkpoint`). :func:`load_checkpoint` checks it with
:func:`trainer.checkpoint.read_meta`, builds the whole model on one device with
:func:`models.build_model` and loads only the model tensors (not the AdamW state) through
``torch.distributed.checkpoint`` with ``no_dist=True``: every process reads the full model by
global name, so a checkpoint saved from any parallel layout (pipeline stages, FSDP shards, expert
shards) loads into the single-device model, with or without ``torch.distributed`` initialised.

The tokenizer is the trainer's (:func:`trainer.tokenizer.build_tokenizer`), chosen in this order:
the ``tokenizer`` argument, ``data.tokenizer`` of the ``config`` TOML, a ``tokenizer`` (or
``data.tokenizer``) entry of ``meta.json`` (the trainer records ``data.tokenizer`` there), else ``"byte"`` (the
trainer's default).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from eval.errors import EvalError
from models import build_model
from models.args import ModelArgs
from models.transformer import Transformer
from trainer.checkpoint import META, CheckpointError, read_meta
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
    def step(self) -> Optional[int]:
        return self.meta.get("step")


def tokenizer_spec(meta: dict, tokenizer: Optional[str] = None, config_tokenizer: Optional[str] = None
                   ) -> tuple[str, str]:
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


def _read_raw_meta(directory: Path) -> dict:
    meta_path = directory / META
    if not meta_path.is_file():
        raise EvalError(f"checkpoint {str(directory)!r}: no {META}; not a checkpoint written by "
                        f"'train.py --checkpoint.save_final DIR'")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EvalError(f"{meta_path}: unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise EvalError(f"{meta_path}: not a JSON object")
    return meta


def load_model_weights(directory: str, model: torch.nn.Module) -> None:
    """Read the model tensors (only) of a dense checkpoint into ``model`` by global name."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp_load(state, checkpoint_id=directory, no_dist=True)
    except Exception as e:  # DCP wraps failures in CheckpointException; keep one clear line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise EvalError(f"{directory}: cannot load the model tensors ({type(e).__name__}: {first})") from e
    set_model_state_dict(model, state["model"])


def load_checkpoint(directory: str | Path, *, tokenizer: Optional[str] = None, config: Optional[str] = None,
                    device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Validate and load ``directory`` (a ``--checkpoint.save_final`` output) for evaluation.

    ``config``: the training TOML (its ``[model]`` must match the checkpoint; its
    ``data.tokenizer`` picks the tokenizer). Raises :class:`EvalError` with a one-line message.
    """
    path = Path(directory)
    if not path.exists():
        raise EvalError(f"checkpoint {str(path)!r}: no such directory")
    if not path.is_dir():
        raise EvalError(f"checkpoint {str(path)!r}: not a directory")
    meta = _read_raw_meta(path)
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
        meta = read_meta(str(path), model_args)  # format, shape and per-file sha256
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    spec, source = tokenizer_spec(meta, tokenizer, config_tokenizer)
    try:
        tok = build_tokenizer(spec)
    except ValueError as e:
        raise EvalError(f"tokenizer ({source}): {e}") from None
    if tok.vocab_size > model_args.vocab_size:
        raise EvalError(f"tokenizer {spec!r} ({source}) has {tok.vocab_size} ids but the checkpoint's "
                        f"model.vocab_size is {model_args.vocab_size}: wrong tokenizer for this checkpoint")
    with torch.random.fork_rng(devices=[]):  # build_model's init draws from the global RNG
        model = build_model(model_args, device=device)
    load_model_weights(str(path), model)
    model.float().eval()
    return LoadedCheckpoint(model=model, tokenizer=tok, model_args=model_args, directory=str(path),
                            tokenizer_spec=spec, tokenizer_source=source, meta=meta)
