"""Tokenize a corpus once into memory-mapped token shards (the format: trainer/data/token_shards.py).

    python -m trainer.data.prepare --out DIR [--config TOML] [--data.KEY VALUE ...]
                                   [--shard-tokens N] [--max-shards N]
    python -m trainer.data.prepare --verify DIR

Prepares splits ``data.train_split`` and ``data.val_split`` (unless ``""``) of ``data.dataset`` with
``data.tokenizer`` -- the ``[data]`` keys of ``--config`` and of the ``--data.KEY VALUE`` overrides, as
``train.py`` reads them -- reading the source as the in-memory path does (trainer/data/corpus.py), one
document at a time, tokenized in chunks. Train on the result with ``--data.dataset DIR`` and the same
tokenizer and split names.

Resumable: every shard is written under a temporary name, fsynced and renamed, then recorded with the
source position after it in ``prepare_progress.jsonl``; run the same command again after an interruption
and it checks the finished shards' sha256, skips their documents without tokenizing them and goes on.
The index ``token_index.json`` is written last; until it exists training refuses the directory.
``--max-shards N`` stops after N new shards (an interruption on purpose). ``--verify DIR`` reads every
shard and checks its sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from trainer.atomic_write import write_atomically
from trainer.config import ConfigError, load_config
from trainer.data.corpus import DataConfig, DataError, iter_documents, resolve_source
from trainer.data.prepare_progress import append_progress, read_progress, write_progress
from trainer.data.token_shards import (
    DOCUMENTS,
    DTYPES,
    FORMAT,
    INDEX_NAME,
    PROGRESS_NAME,
    VERSION,
    file_sha256,
    read_json,
    shard_dtype,
    tokenizer_identity,
    verify_prepared,
)
from trainer.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer, encode_documents
from trainer.error_line import error_line
from trainer.sealed_json import sealed

DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 per shard
CHUNK_CHARS = 1 << 24  # documents tokenized together: bounds the text and tokens held at once


class ShardLimit(Exception):
    """``--max-shards`` new shards are written: the preparation stops here, resumable."""


def header(cfg: DataConfig, tok: Tokenizer, shard_tokens: int, splits: list[tuple[str, str]]) -> dict:
    """What a preparation's output depends on; a resumed one must match it exactly."""
    sources = {}
    for split, key in splits:
        src = resolve_source(cfg, split, key)
        fingerprint = json.loads(json.dumps(src.cache_key()))  # tuples -> lists, as read back
        sources[split] = {"source": src.describe(), "fingerprint": fingerprint, "text_field": cfg.text_field}
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer_identity(tok),
        "dtype": shard_dtype(tok.vocab_size),
        "shard_tokens": shard_tokens,
        "documents": DOCUMENTS,
        "sources": sources,
    }


def open_out(out: Path, head: dict) -> dict | None:
    """The progress record to continue in ``out`` (a fresh one for a new directory); None when ``out``
    already holds this preparation, finished. DataError when ``out`` holds anything else."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise DataError(f"--out {str(out)!r} is not a directory (a symlink or a file)")
    for name in (INDEX_NAME, PROGRESS_NAME):
        if (out / name).exists():
            record = read_json(out / name) if name == INDEX_NAME else read_progress(out)
            if {k: record.get(k) for k in head} != head:
                differ = sorted(k for k in head if record.get(k) != head[k])
                raise DataError(f"--out {str(out)!r} holds a preparation with other settings ({', '.join(differ)})")
            return None if name == INDEX_NAME else record
    if out.exists() and any(out.iterdir()):
        raise DataError(f"--out {str(out)!r} is neither empty nor a preparation directory; choose a new one")
    out.mkdir(parents=True, exist_ok=True)
    record = {**head, "splits": {}}
    write_progress(out, record)
    return record


def kept_shards(out: Path, entry: dict) -> list[dict]:
    """The finished shards of an unfinished split whose files still match their sha256 (a prefix)."""
    kept = []
    for shard in entry["shards"]:
        path = out / shard["file"]
        if path.is_symlink() or not path.is_file() or file_sha256(path) != shard["sha256"]:
            print(f"prepare: {str(path)!r} differs from its record: preparing again from there", flush=True)
            break
        kept.append(shard)
    return kept


def token_chunks(tok: Tokenizer, docs: Iterator[str], first_doc: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(index of its first document, documents, tokens)`` of consecutive documents of about CHUNK_CHARS characters,
    from document ``first_doc`` on; a chunk's tokens begin with the eos separating it from the document
    before (none before document 0), so the chunks concatenated are the packed stream."""
    chunk, chars, start = [], 0, first_doc
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if chars >= CHUNK_CHARS:
            yield start, len(chunk), _encode(tok, chunk, start)
            start += len(chunk)
            chunk, chars = [], 0
    if chunk:
        yield start, len(chunk), _encode(tok, chunk, start)


def _encode(tok: Tokenizer, docs: list[str], first_doc: int) -> np.ndarray:
    tokens = encode_documents(tok, docs)
    return np.concatenate([[tok.eos_id], tokens]) if first_doc else tokens


class ShardWriter:
    """Cuts one split's token stream into shards of ``shard_tokens`` tokens and publishes each (temporary
    name, fsync, rename), then records it with the source position after it in the progress file."""

    def __init__(self, out: Path, split: str, record: dict, max_shards: int | None):
        self.out, self.split, self.record = out, split, record
        self.entry = record["splits"][split]
        self.buf = np.empty(record["shard_tokens"], dtype=DTYPES[record["dtype"]])
        self.fill = 0
        self.budget = max_shards

    def add(self, tokens: np.ndarray, chunk_doc: int, offset: int) -> None:
        """Tokens ``offset..`` of the chunk that begins at document ``chunk_doc``."""
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.record["tokenizer"]["vocab_size"]):
            raise DataError(f"data.tokenizer: token ids outside the vocabulary in split {self.split!r}")
        done = 0
        while done < len(tokens):
            take = min(len(tokens) - done, len(self.buf) - self.fill)
            self.buf[self.fill : self.fill + take] = tokens[done : done + take]
            self.fill, done = self.fill + take, done + take
            if self.fill == len(self.buf):
                self.publish((chunk_doc, offset + done))

    def publish(self, resume: tuple[int, int]) -> None:
        if self.budget is not None and self.budget <= 0:
            raise ShardLimit
        name = f"{self.split}-{len(self.entry['shards']):05d}.bin"
        data = memoryview(self.buf[: self.fill]).cast("B")
        write_atomically(self.out / name, data)
        shard = {"file": name, "tokens": self.fill, "sha256": hashlib.sha256(data).hexdigest(), "resume": resume}
        append_progress(self.out, self.record, self.split, shard=shard)
        self.fill = 0
        if self.budget is not None:
            self.budget -= 1


def prepare_split(
    cfg: DataConfig, tok: Tokenizer, out: Path, record: dict, split: str, key: str, writer_budget: int | None
) -> int:
    """Write (the rest of) ``split``'s shards; returns how many new shards the budget has left."""
    entry = record["splits"].setdefault(split, {"shards": [], "done": False})
    kept = kept_shards(out, entry)
    if len(kept) < len(entry["shards"]):
        entry["shards"] = kept
        write_progress(out, record)
    first_doc, offset = entry["shards"][-1]["resume"] if entry["shards"] else (0, 0)
    written = sum(s["tokens"] for s in entry["shards"])
    src = resolve_source(cfg, split, key)
    docs = iter_documents(src, cfg, f"({key}={split!r})")
    skipped = sum(1 for _ in islice(docs, first_doc))  # read, not tokenized
    if skipped < first_doc:
        raise DataError(f"data.dataset: {src.describe()!r} has {skipped} documents, fewer than its record in {out}")
    writer = ShardWriter(out, split, record, writer_budget)
    bar = tqdm(initial=written, unit="tok", unit_scale=True, desc=split, disable=not sys.stderr.isatty())
    end_doc = skipped
    with bar:
        for chunk_doc, n_docs, tokens in token_chunks(tok, docs, skipped):
            drop = min(offset, len(tokens))
            offset -= drop
            writer.add(tokens[drop:], chunk_doc, drop)
            bar.update(len(tokens) - drop)
            end_doc = chunk_doc + n_docs
    if writer.fill:
        writer.publish((end_doc, 0))  # the end: a resume skips every document
    num_tokens = sum(s["tokens"] for s in entry["shards"])
    if not num_tokens:
        raise DataError(f"data.dataset: {src.describe()!r} ({key}={split!r}) contains no text")
    append_progress(out, record, split, done={"done": True, "num_tokens": num_tokens, "num_documents": end_doc})
    return writer.budget


def prepare(cfg: DataConfig, out: Path, shard_tokens: int, max_shards: int | None) -> list[str]:
    """Prepare (or finish preparing) ``cfg``'s splits in ``out``; one line per split. ShardLimit when
    ``max_shards`` new shards are written first."""
    try:
        tok = build_tokenizer(cfg.tokenizer)
    except TokenizerError as e:
        raise DataError(str(e)) from None
    splits = [(cfg.train_split, "data.train_split")]
    if cfg.val_split and cfg.val_split != cfg.train_split:
        splits.append((cfg.val_split, "data.val_split"))
    record = open_out(out, header(cfg, tok, shard_tokens, splits))
    if record is None:
        return [f"{str(out)!r} is already prepared ({INDEX_NAME}); --verify {out} reads it all"]
    budget = max_shards
    for split, key in splits:
        if not record["splits"].get(split, {}).get("done"):
            budget = prepare_split(cfg, tok, out, record, split, key, budget)
    write_atomically(out / INDEX_NAME, (json.dumps(sealed(record), indent=1) + "\n").encode())
    (out / PROGRESS_NAME).unlink()
    return [
        f"{split}: {e['num_tokens']} tokens, {e['num_documents']} documents, {len(e['shards'])} shards "
        f"of {record['dtype']}"
        for split, e in record["splits"].items()
    ]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, DataConfig]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory to prepare (new, empty, or an unfinished preparation)")
    parser.add_argument("--config", help="TOML training config whose [data] section to read")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    parser.add_argument("--max-shards", type=int, help="stop after writing this many new shards (resumable)")
    parser.add_argument("--verify", metavar="DIR", help="check every shard of a prepared DIR against its sha256")
    args, overrides = parser.parse_known_args(argv)
    if args.verify is None and args.out is None:
        parser.error("one of --out DIR or --verify DIR is required")
    bad = next((a for a in overrides if a.startswith("--") and not a.startswith("--data.")), None)
    if bad is not None:
        parser.error(f"{bad}: only --data.KEY VALUE overrides apply to a preparation")
    if args.shard_tokens < 1 or (args.max_shards is not None and args.max_shards < 0):
        parser.error("--shard-tokens must be >= 1 and --max-shards >= 0")
    return args, load_config(args.config, overrides).data


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args, cfg = parse_args(sys.argv[1:] if argv is None else argv)
        if args.verify is not None:
            lines = verify_prepared(Path(args.verify))
        else:
            lines = prepare(cfg, Path(args.out), args.shard_tokens, args.max_shards)
    except ShardLimit:
        print(f"prepare: stopped after --max-shards {args.max_shards} new shards; run again to continue")
        return 0
    except (ConfigError, DataError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except OSError as e:  # a full or read-only file system while writing: what is finished stays, to resume
        where = e.filename or getattr(args, "out", None) or getattr(args, "verify", None)
        message = f"prepare: cannot write {where}: {e.strerror or e}; the finished shards are kept: run again to resume"
        print(error_line(DataError(message)), file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
