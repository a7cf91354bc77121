"""Tokenizers for the data pipeline.

Two implementations share the small :class:`Tokenizer` interface:

* :class:`ByteTokenizer` -- UTF-8 bytes as ids 0..255 plus an end-of-sequence id 256
  (``vocab_size == 257``); needs no file and no download.
* :class:`HFTokenizer` -- a ``tokenizer.json`` file read through the ``tokenizers`` library;
  its end-of-sequence id is looked up in the file.

:func:`build_tokenizer` turns the ``data.tokenizer`` config string into one of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]

# Looked up in this order in a tokenizer.json's vocabulary / added tokens.
EOS_CANDIDATES: tuple[str, ...] = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<｜end▁of▁sentence｜>")


class TokenizerError(ValueError):
    """A bad ``data.tokenizer`` value or file; the message names the key and the file."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer and the data pipeline need from a tokenizer."""

    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; adds no special tokens (no BOS/EOS)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; the eos id (and other special tokens) decode to nothing."""
        ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus eos = 256."""

    vocab_size: int = 257
    eos_id: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def encode_documents(self, docs: Sequence[str]) -> np.ndarray:
        """All of ``docs`` encoded and joined with ``eos_id`` between them (int32, vectorised)."""
        encoded = [d.encode("utf-8") for d in docs]
        if not encoded:
            return np.zeros(0, dtype=np.int32)
        data = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int32)
        ends = np.cumsum([len(b) for b in encoded])[:-1]
        return np.insert(data, ends, self.eos_id)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _read_tokenizer_json(path: Path):
    """``path`` read as a ``tokenizers`` tokenizer.json; :class:`TokenizerError` saying why it is not one."""
    from tokenizers import Tokenizer as _HFTok

    name = f"data.tokenizer: {str(path)!r}"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"{name} does not exist") from None
    except OSError as e:
        raise TokenizerError(f"{name} cannot be read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{name} is not a tokenizer.json: not UTF-8 text (byte offset {e.start})") from None
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        what = "the file is empty" if not text.strip() else f"{e.msg} at line {e.lineno} column {e.colno}"
        raise TokenizerError(f"{name} is not a tokenizer.json: not JSON ({what})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise TokenizerError(f'{name} is JSON but not a Hugging Face tokenizers file (no "model" object)')
    try:
        return _HFTok.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        msg = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenizerError(f"{name} is not a valid tokenizers file: {msg}") from None


class HFTokenizer:
    """A ``tokenizer.json`` file (Hugging Face ``tokenizers`` format)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._tok = _read_tokenizer_json(self.path)
        eos = None
        for tok in EOS_CANDIDATES:
            tid = self._tok.token_to_id(tok)
            if tid is not None:
                eos = tid
                self.eos_token = tok
                break
        if eos is None:
            raise TokenizerError(
                f"data.tokenizer: {str(self.path)!r} has none of the end-of-sequence tokens {list(EOS_CANDIDATES)}"
            )
        self.eos_id: int = int(eos)
        self.vocab_size: int = int(self._tok.get_vocab_size(with_added_tokens=True))
        if self.eos_id >= self.vocab_size:  # defensive: some files have sparse added-token ids
            self.vocab_size = self.eos_id + 1

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_documents(self, docs: Sequence[str], chunk: int = 1024) -> np.ndarray:
        """All of ``docs`` encoded (batched, in Rust threads) and joined with ``eos_id`` between them."""
        parts: list[np.ndarray] = []
        sep = np.array([self.eos_id], dtype=np.int32)
        for start in range(0, len(docs), chunk):
            for enc in self._tok.encode_batch(list(docs[start : start + chunk]), add_special_tokens=False):
                if parts:
                    parts.append(sep)
                parts.append(np.asarray(enc.ids, dtype=np.int32))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def resolve_path(p: str | Path) -> Path:
    """A relative path is looked up against the repository root first, then the CWD.

    Returns the repository-root candidate when neither exists (for error messages).
    """
    path = Path(p).expanduser()
    if path.is_absolute():
        return path
    for cand in (REPO_ROOT / path, Path.cwd() / path):
        if cand.exists():
            return cand.resolve()
    return (REPO_ROOT / path).resolve()


def build_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; otherwise a path to a ``tokenizer.json``.

    A relative path is resolved against the repository root (then the CWD).
    Raises :class:`TokenizerError` naming ``data.tokenizer`` and the file when it is missing or is
    not a tokenizer.json.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TokenizerError(f"data.tokenizer: expected 'byte' or a path to a tokenizer.json, got {spec!r}")
    spec = spec.strip()
    if spec == "byte":
        return ByteTokenizer()
    path = resolve_path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"data.tokenizer: {spec!r} is neither 'byte' nor an existing tokenizer.json file (looked at {str(path)!r})"
        )
    return HFTokenizer(path)


def encode_documents(tok: Tokenizer, docs: Sequence[str]) -> np.ndarray:
    """Encode ``docs`` and join them with ``tok.eos_id`` between consecutive documents (int32)."""
    fast = getattr(tok, "encode_documents", None)
    if fast is not None:
        return fast(docs)
    parts: list[np.ndarray] = []
    for d in docs:
        if parts:
            parts.append(np.array([tok.eos_id], dtype=np.int32))
        parts.append(np.asarray(tok.encode(d), dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
