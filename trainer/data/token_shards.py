"""A prepared corpus: token shards on disk plus their index, opened memory-mapped.

``python -m trainer.data.prepare`` writes a directory holding, for each split, fixed-size raw token
files ``<split>-NNNNN.bin`` (little-endian ``uint16`` when the tokenizer's vocabulary fits in 16 bits,
else ``uint32``; no header; every shard but a split's last holds exactly ``shard_tokens`` tokens) and
one index, ``token_index.json``, written last::

    {"format": "moevement-token-shards", "version": 2, "seal": "<sha256 of the rest>",
     "tokenizer": {"kind": "ByteTokenizer", "vocab_size": 257, "eos_id": 256},   # + "sha256" of a tokenizer.json
     "dtype": "uint16", "shard_tokens": 134217728, "documents": DOCUMENTS,
     "splits": {"valid": {"source": "...", "num_tokens": N, "num_documents": D,
                          "shards": [{"file": "valid-00000.bin", "tokens": n, "sha256": "..."}, ...]}}}

The tokens of a split are exactly what :func:`trainer.data.corpus.load_tokens` packs in memory from the same
source and tokenizer, so both paths serve identical batches.

What is checked when: :func:`read_index` checks the index's seal (a sha256 over all of it, so the shards'
order, counts and hashes are bound to the preparation; a hash, not a signature); :func:`open_split` checks
what costs no reading -- the tokenizer's identity, each shard's name and position, that it is a regular file
(not a symlink) and its size -- so a start or a restart opens any corpus in milliseconds. The sha256 of every
byte is checked by `trainer/data/shard_check.py` before a shard's tokens can train twice (a small split at
its opening, a large one on a background thread from its first read), by :func:`verify_prepared`
(``prepare --verify``), and when an interrupted preparation resumes over its finished shards.
"""

from __future__ import annotations

import json
import os
import re
import stat
from bisect import bisect_right
from pathlib import Path

import numpy as np
import torch

from trainer.data.corpus import DataError
from trainer.data.shard_check import VERIFY_AT_OPEN_BYTES, ShardCheck, file_sha256
from trainer.data.tokenizer import Tokenizer
from trainer.sealed_json import seal_holds

INDEX_NAME = "token_index.json"
PROGRESS_NAME = "prepare_progress.jsonl"  # an unfinished preparation's record (trainer.data.prepare)
FORMAT = "moevement-token-shards"
VERSION = 2  # 2: sealed (version 1 indexes are refused: prepare again)
DOCUMENTS = "one eos_id between consecutive documents, none after the last (as trainer.data.corpus packs them)"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*-\d{5,}\.bin$")


def shard_dtype(vocab_size: int) -> str:
    """``uint16`` when every token id fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenizer_identity(tok: Tokenizer) -> dict:
    """What makes two tokenizers produce the same ids: kind, vocabulary size, eos id, and the sha256 of a
    ``tokenizer.json`` (its path may differ)."""
    ident = {"kind": type(tok).__name__, "vocab_size": int(tok.vocab_size), "eos_id": int(tok.eos_id)}
    path = getattr(tok, "path", None)
    if path is not None:
        ident["sha256"] = file_sha256(Path(path))
    return ident


def is_prepared(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``trainer.data.prepare`` (finished or not)."""
    return path.is_dir() and any(os.path.lexists(path / name) for name in (INDEX_NAME, PROGRESS_NAME))


def read_json(path: Path) -> dict:
    """The JSON object in ``path``, read without following a symlink; DataError naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        why = "is a symlink (refused)" if path.is_symlink() else f"is not readable JSON ({type(e).__name__})"
        raise DataError(f"data.dataset: {str(path)!r} {why}") from None
    if not isinstance(value, dict):
        raise DataError(f"data.dataset: {str(path)!r} is not a JSON object")
    return value


def read_index(directory: Path) -> dict:
    """The checked index of a prepared ``directory``; DataError naming the file otherwise."""
    index_path = directory / INDEX_NAME
    where = f"data.dataset: prepared corpus {str(directory)!r}"
    if not os.path.lexists(index_path):
        raise DataError(
            f"{where} is an unfinished preparation (no {INDEX_NAME}); run python -m trainer.data.prepare "
            "with the same settings and --out again to finish it"
        )
    index = read_json(index_path)
    if index.get("format") == FORMAT and index.get("version") == 1:
        raise DataError(
            f"{where}: {str(index_path)!r} was written by an older version (index version 1, not sealed); "
            "prepare it again with python -m trainer.data.prepare and a new --out"
        )
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise DataError(f"{where}: {str(index_path)!r} is not a {FORMAT} version {VERSION} index")
    if not seal_holds(index):
        raise DataError(f"{where}: {str(index_path)!r} does not match its seal (edited or damaged)")
    if index.get("dtype") not in DTYPES or not isinstance(index.get("splits"), dict):
        raise DataError(f"{where}: {str(index_path)!r} has no valid dtype or splits")
    return index


def check_tokenizer(index: dict, tok: Tokenizer, directory: Path) -> None:
    want, have = index.get("tokenizer"), tokenizer_identity(tok)
    if want != have:
        raise DataError(
            f"data.tokenizer: prepared corpus {str(directory / INDEX_NAME)!r} was tokenized by {want}, "
            f"not by this data.tokenizer ({have})"
        )


class ShardedTokens:
    """One split of a prepared corpus as one read-only 1-D token sequence over memory-mapped shards.

    Opening maps the files and reads no tokens; :meth:`sequences` copies rows out (those that cross a
    shard boundary are joined), each shard's bytes checked against its sha256 before they can train twice
    (`check`, trainer/data/shard_check.py) and every token id against the tokenizer's `vocab_size` (a
    damaged shard is one DataError naming it, not an index error inside the model). Pickling (a spawned
    loader worker) carries the paths, hashes and what is verified, and maps the files again.
    """

    def __init__(self, files: list[Path], counts: list[int], dtype: str, name: str, vocab_size: int, check: ShardCheck):
        self.files, self.counts, self.dtype, self.name, self.vocab_size = files, counts, dtype, name, vocab_size
        self.ends = np.cumsum(counts).tolist()
        self.num_tokens = int(self.ends[-1]) if counts else 0
        self.maps = [_map_shard(f, n, DTYPES[dtype]) for f, n in zip(files, counts, strict=True)]
        self.check = check

    def __reduce__(self):
        check = ShardCheck(self.check.files, self.check.digests, self.check.index_name, frozenset(self.check.verified))
        return (ShardedTokens, (self.files, self.counts, self.dtype, self.name, self.vocab_size, check))

    def read(self, start: int, out: np.ndarray) -> None:
        """Fill ``out`` with tokens ``start .. start + len(out) - 1`` (which may span shards)."""
        k = bisect_right(self.ends, start)
        done = 0
        while done < len(out):
            if k >= len(self.maps):
                raise IndexError(f"tokens {start}..{start + len(out) - 1} of {self.name}: past its {self.num_tokens}")
            offset = start + done - (self.ends[k - 1] if k else 0)
            self.check.before_read(k)
            piece = self.maps[k][offset : offset + len(out) - done]
            self._check_ids(k, offset, piece)
            out[done : done + len(piece)] = piece
            done += len(piece)
            k += 1

    def _check_ids(self, shard: int, offset: int, piece: np.ndarray) -> None:
        """DataError naming shard `shard` and the token's position unless every id in `piece` (its tokens from
        `offset`) is below the vocabulary size."""
        if len(piece) and int(piece.max()) >= self.vocab_size:
            at = int(np.argmax(piece >= self.vocab_size))
            raise DataError(
                f"data.dataset: shard {str(self.files[shard])!r} holds token id {int(piece[at])} at token "
                f"{offset + at}, outside the tokenizer's vocabulary of {self.vocab_size} (damaged; "
                "python -m trainer.data.prepare --verify checks every shard)"
            )

    def sequences(self, indices: torch.Tensor, row: int) -> torch.Tensor:
        """``LongTensor[len(indices), row]``: row ``i`` is tokens ``indices[i] * row`` onwards; one batch
        for the shard check (its reads never wait for a hash this batch started)."""
        out = np.empty((len(indices), row), dtype=np.int64)
        self.check.next_batch()
        for i, seq in enumerate(indices.tolist()):
            self.read(seq * row, out[i])
        return torch.from_numpy(out)


def _map_shard(path: Path, count: int, dtype: np.dtype) -> np.ndarray:
    """``path`` memory-mapped read-only after checking it is a regular file (never through a symlink) of
    exactly ``count`` tokens; DataError naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DataError(f"data.dataset: shard {str(path)!r} listed in {INDEX_NAME} is missing") from None
    except OSError as e:
        why = "is a symlink (refused)" if os.path.islink(path) else f"cannot be opened: {e.strerror}"
        raise DataError(f"data.dataset: shard {str(path)!r} {why}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"data.dataset: shard {str(path)!r} is not a regular file")
        if st.st_size != count * dtype.itemsize:
            raise DataError(
                f"data.dataset: shard {str(path)!r} is {st.st_size} bytes, its index says {count} tokens = "
                f"{count * dtype.itemsize} bytes (truncated or replaced)"
            )
        return np.memmap(f, dtype=dtype, mode="r", shape=(count,))


def _split_shards(index: dict, directory: Path, split: str, key: str) -> tuple[list[Path], list[int], list[str]]:
    """(paths, token counts, sha256s) of ``split``'s shards, the index's entry checked for consistency."""
    index_path = str(directory / INDEX_NAME)
    where = f"data.dataset: prepared corpus {index_path!r}"
    entry = index["splits"].get(split)
    if not isinstance(entry, dict):
        raise DataError(f"{key}: split {split!r} is not in {index_path!r} (prepared: {sorted(index['splits'])})")
    try:
        shards = entry["shards"]
        names = [str(s["file"]) for s in shards]
        counts = [int(s["tokens"]) for s in shards]
        digests = [str(s["sha256"]) for s in shards]
        total, per_shard = int(entry["num_tokens"]), int(index["shard_tokens"])
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{where}: malformed entry for split {split!r}") from None
    bad = next((n for n in names if not _SHARD_NAME.match(n)), None)
    if bad is not None:
        raise DataError(f"{where}: shard name {bad!r} of split {split!r} is not a plain shard file name")
    moved = next((i for i, n in enumerate(names) if n != f"{split}-{i:05d}.bin"), None)
    if moved is not None:
        raise DataError(
            f"{where}: shard {names[moved]!r} is listed at position {moved} of split {split!r}, where the "
            f"preparation wrote {split}-{moved:05d}.bin (the shards' order is not the preparation's)"
        )
    full = all(c == per_shard for c in counts[:-1])
    if not shards or sum(counts) != total or not full or not 0 < counts[-1] <= per_shard:
        raise DataError(f"{where}: token counts of split {split!r} do not add up")
    return [directory / n for n in names], counts, digests


def open_split(directory: Path, split: str, tok: Tokenizer, key: str) -> ShardedTokens:
    """Split ``split`` of the prepared ``directory``, memory-mapped, for tokenizer ``tok``.

    Cheap checks only (see the module docstring); ``key`` names the split's config key in errors."""
    index = read_index(directory)
    check_tokenizer(index, tok, directory)
    files, counts, digests = _split_shards(index, directory, split, key)
    name = f"{str(directory)!r} split {split!r} ({key}={split!r})"
    check = ShardCheck(files, digests, INDEX_NAME)
    tokens = ShardedTokens(files, counts, index["dtype"], name, int(tok.vocab_size), check)
    if sum(counts) * DTYPES[index["dtype"]].itemsize <= VERIFY_AT_OPEN_BYTES:
        check.all_now()
    return tokens


def verify_prepared(directory: Path) -> list[str]:
    """Check every shard of every split against its sha256 in the index (reads everything);
    one line per split. DataError naming the first shard that differs."""
    index = read_index(directory)
    lines = []
    for split in index["splits"]:
        files, counts, digests = _split_shards(index, directory, split, "split")
        check = ShardCheck(files, digests, INDEX_NAME)
        ShardedTokens(files, counts, index["dtype"], split, 0, check)  # names, types and sizes first
        check.all_now()
        lines.append(f"{split}: {sum(counts)} tokens in {len(files)} shards, sha256 ok")
    return lines
