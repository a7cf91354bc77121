"""Where training text comes from and how it becomes one packed 1-D tensor of token ids.

`data.dataset` may be:
* ``"wikitext-2"``: ``<repo>/../shared/data/wikitext-2`` when it exists (split ``valid`` ->
  ``valid.txt``), else the hub's ``Salesforce/wikitext`` / ``wikitext-2-raw-v1`` (split names
  ``valid``/``val`` -> ``validation``).
* a directory written by `datasets`' ``save_to_disk`` (read with ``datasets.load_from_disk``): a
  ``DatasetDict``'s split is the one the split key names; a ``Dataset`` is every split, as a single
  file is (:mod:`trainer.data.saved_dataset`).
* a local directory: a split is a file stem -- ``<split>.txt|.text|.json|.jsonl|.parquet``,
  also shards ``<split>-<digit>*.<ext>`` / ``<split>_<digit>*.<ext>``, the files of a
  ``<split>/`` sub-directory, or a ``<split>/`` sub-directory written by ``Dataset.save_to_disk``.
  A directory with none of these (nor a prepared corpus) is refused, naming what it holds.
* a single local file: that file, whatever the split name.
* anything else that looks like ``name`` or ``owner/name``: a hub dataset id
  (``data.hub_config`` is its config name, the split names are the hub's).
Relative paths are resolved against the repository root first, then the CWD.

Documents: each row of a json/jsonl/parquet/hub/saved dataset (column ``data.text_field``) is a
document. Plain-text files are read line by line with line breaks kept, and a WikiText
article heading line (`` = Title = ``) starts a new document. Documents are joined with
the tokenizer's ``eos_id`` between them; results are cached in-process.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.data.saved_dataset import (
    SavedDatasetError,
    fingerprint,
    is_saved_dataset,
    is_saved_dataset_dict,
    open_saved,
    saved_splits,
)
from trainer.data.tokenizer import REPO_ROOT, Tokenizer, encode_documents, resolve_path

SHARED_WIKITEXT2 = REPO_ROOT.parent / "shared" / "data" / "wikitext-2"
WIKITEXT_HUB_ID = "Salesforce/wikitext"
WIKITEXT_HUB_CONFIG = "wikitext-2-raw-v1"
_WIKITEXT_HUB_SPLITS = {"valid": "validation", "val": "validation", "dev": "validation"}

# file extension -> datasets packaged builder
_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


class DataError(ValueError):
    """A data configuration or data content problem; the message names the config key."""


# --------------------------------------------------------------------------------------
# Source resolution
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str  # "local" | "hub" | "saved" (a save_to_disk directory)
    # local: the data files; saved: the directory load_from_disk reads
    builder: str = ""  # "text" | "json" | "parquet"
    files: tuple[str, ...] = ()
    saved_split: str = ""  # saved: the split of a DatasetDict ("": a Dataset)
    # hub
    hub_id: str = ""
    hub_config: str = ""
    hub_split: str = ""
    lines_are_rows: bool = False  # hub wikitext: rows are lines of text -> group into articles

    def describe(self) -> str:
        if self.kind == "saved":
            return str(Path(self.files[0]) / self.saved_split) if self.saved_split else self.files[0]
        if self.kind == "local":
            return self.files[0] if len(self.files) == 1 else f"{len(self.files)} files in {Path(self.files[0]).parent}"
        cfg = f" ({self.hub_config})" if self.hub_config else ""
        return f"hub dataset {self.hub_id}{cfg} split {self.hub_split!r}"

    def cache_key(self) -> tuple:
        if self.kind == "saved":
            directory = Path(self.describe())  # a DatasetDict's split lives in its <split>/ sub-directory
            try:
                return ("saved", self.files[0], self.saved_split, fingerprint(directory))
            except SavedDatasetError as e:
                raise DataError(f"data.dataset: {e}") from None
        if self.kind == "local":
            stats = []
            for f in self.files:
                st = os.stat(f)
                stats.append((f, st.st_mtime_ns, st.st_size))
            return ("local", self.builder, tuple(stats))
        return ("hub", self.hub_id, self.hub_config, self.hub_split)


def _format_of(files: Sequence[Path], where: str) -> str:
    fmts = {_FORMATS[f.suffix.lower()] for f in files}
    if len(fmts) != 1:
        raise DataError(f"data.dataset: {where} mixes file formats {sorted(fmts)}; use one format per split")
    return fmts.pop()


def _split_files(directory: Path, split: str, key: str) -> list[Path]:
    """The files of split ``split`` in ``directory``; DataError naming ``key`` when there are none."""
    try:
        return _find_split_files(directory, split, key)
    except OSError as e:
        raise DataError(
            f"data.dataset: cannot list directory {str(directory)!r} ({key}={split!r}): {e.strerror}"
        ) from None


def _find_split_files(directory: Path, split: str, key: str) -> list[Path]:
    cands: list[Path] = []
    for f in sorted(directory.iterdir()):
        if not f.is_file() or f.suffix.lower() not in _FORMATS:
            continue
        stem = f.name[: -len(f.suffix)]
        if stem == split or re.match(re.escape(split) + r"[-_]\d", stem):  # valid.txt, train-00000-of-00002.parquet
            cands.append(f)
    sub = directory / split
    if not cands and sub.is_dir():
        cands = sorted(f for f in sub.rglob("*") if f.is_file() and f.suffix.lower() in _FORMATS)
    if not cands:
        present = sorted(f.name for f in directory.iterdir() if f.suffix.lower() in _FORMATS)
        if not present:
            raise DataError(
                f"data.dataset: directory {str(directory)!r} holds no data for {key}={split!r}: expected "
                f"text/json/jsonl/parquet files, a prepared corpus (token_index.json) or a datasets save_to_disk "
                f"directory (dataset_dict.json, or state.json with dataset_info.json); found: {_listing(directory)}"
            )
        raise DataError(
            f"{key}: no file for split {split!r} in data.dataset directory {str(directory)!r} "
            f"(looked for {split}{{{','.join(sorted(_FORMATS))}}}, shards {split}-NNNN*.*, {split}/; "
            f"found: {present})"
        )
    return cands


_LISTED = 10


def _listing(directory: Path) -> str:
    """What ``directory`` holds, for an error line: the first entries by name (directories with a "/")."""
    entries = sorted(f.name + ("/" if f.is_dir() else "") for f in directory.iterdir())
    if not entries:
        return "nothing (an empty directory)"
    more = f" and {len(entries) - _LISTED} more" if len(entries) > _LISTED else ""
    return f"{entries[:_LISTED]}{more}"


def _directory_source(path: Path, split: str, key: str) -> Source:
    """Split ``split`` (config key ``key``) of the local directory ``path``: a saved ``Dataset`` (whatever the
    split), a saved ``DatasetDict``'s split, a ``<split>/`` saved ``Dataset``, else the split's data files."""
    if is_saved_dataset(path):
        return Source("saved", files=(str(path),))
    if is_saved_dataset_dict(path):
        try:
            splits = saved_splits(path)
        except SavedDatasetError as e:
            raise DataError(f"data.dataset: {e}") from None
        if split not in splits:
            raise DataError(f"{key}: no split {split!r} in the DatasetDict saved at {str(path)!r} (splits: {splits})")
        return Source("saved", files=(str(path),), saved_split=split)
    if is_saved_dataset(path / split):
        return Source("saved", files=(str(path / split),))
    files = _split_files(path, split, key)
    return Source("local", builder=_format_of(files, str(path)), files=tuple(map(str, files)))


def resolve_source(cfg: DataConfig, split: str, key: str) -> Source:
    """Where split ``split`` of ``cfg.dataset`` lives. ``key`` names the config key of the split."""
    ds = cfg.dataset.strip()
    if not ds:
        raise DataError("data.dataset: empty; set it to 'wikitext-2', a local path or a hub dataset id")
    if not split:
        raise DataError(f"{key}: empty split name")

    if ds == "wikitext-2":
        if SHARED_WIKITEXT2.is_dir():
            files = _split_files(SHARED_WIKITEXT2, split, key)
            return Source("local", builder=_format_of(files, str(SHARED_WIKITEXT2)), files=tuple(map(str, files)))
        return Source(
            "hub",
            hub_id=WIKITEXT_HUB_ID,
            hub_config=cfg.hub_config or WIKITEXT_HUB_CONFIG,
            hub_split=_WIKITEXT_HUB_SPLITS.get(split, split),
            lines_are_rows=True,
        )

    path = resolve_path(ds)
    if path.is_dir():
        return _directory_source(path, split, key)
    if path.is_file():
        if path.suffix.lower() not in _FORMATS:
            raise DataError(
                f"data.dataset: {str(path)!r} has unsupported extension {path.suffix!r} "
                f"(expected one of {sorted(_FORMATS)})"
            )
        return Source("local", builder=_FORMATS[path.suffix.lower()], files=(str(path),))
    # hub ids are "name" or "owner/name"; anything else path-like is a missing local path
    looks_local = ds.startswith((".", "/", "~")) or Path(ds).suffix.lower() in _FORMATS or not _HUB_ID_RE.match(ds)
    if looks_local:
        raise DataError(f"data.dataset: path {ds!r} does not exist (resolved to {str(path)!r})")
    return Source("hub", hub_id=ds, hub_config=cfg.hub_config, hub_split=split)


# --------------------------------------------------------------------------------------
# Loading + tokenizing
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars, and no log lines that repeat the error :class:`DataError` reports."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not was_disabled:
            datasets.enable_progress_bars()


def _is_article_heading(line: str) -> bool:
    s = line.strip()
    return len(s) > 4 and s.startswith("= ") and s.endswith(" =") and not s.startswith("= =") and not s.endswith("= =")


def group_lines(lines: Iterable[str | None]) -> Iterator[str]:
    """Lines (line breaks kept) -> documents, lazily; a WikiText article heading starts a new one."""
    cur: list[str] = []
    has_text = False
    for line in lines:
        if line is None:
            continue
        if has_text and _is_article_heading(line):
            yield "".join(cur)
            cur, has_text = [], False
        cur.append(line)
        has_text = has_text or bool(line.strip())
    if has_text:
        yield "".join(cur)


_CHECK_CHUNK = 1 << 20


def _text_problem(path: str) -> str | None:
    """Why the file at ``path`` is not UTF-8 text (a NUL byte or an invalid sequence), or ``None``."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHECK_CHUNK)
            nul = chunk.find(b"\0")
            if nul >= 0:
                return f"is binary, not text (NUL byte at offset {offset + nul})"
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                return f"is not UTF-8 text (invalid byte 0x{e.object[e.start]:02x} near offset {offset + e.start})"
            if not chunk:
                return None
            offset += len(chunk)


def _check_local_files(src: Source, where: str) -> None:
    """Refuse, naming the file, local files that cannot be read, are all empty, or are not UTF-8 text.

    ``where`` names the split's config key, e.g. ``(data.train_split='valid')``.
    """
    empty = []
    for path in src.files:
        try:
            if os.path.getsize(path) == 0:
                empty.append(path)
                continue
            problem = _text_problem(path) if src.builder in ("text", "json") else None
        except OSError as e:
            raise DataError(f"data.dataset: cannot read {path!r} {where}: {e.strerror}") from None
        if problem:
            raise DataError(f"data.dataset: {path!r} {where} {problem}")
    if len(empty) == len(src.files):
        if len(empty) == 1:
            raise DataError(f"data.dataset: {empty[0]!r} {where} is empty")
        raise DataError(f"data.dataset: all {len(empty)} files of {src.describe()!r} {where} are empty")


def _cause(e: BaseException) -> str:
    """The first line of the innermost useful error under a ``datasets`` wrapper (which says only
    "An error occurred while generating the dataset")."""
    import datasets

    seen = set()
    while isinstance(e, datasets.exceptions.DatasetGenerationError) and id(e) not in seen:
        seen.add(id(e))
        inner = e.__cause__ or e.__context__
        if inner is None:
            break
        e = inner
    msg = str(e).splitlines()[0] if str(e).strip() else ""
    if "corresponds to no data" in msg:  # datasets' wording for a file without a single row
        return "it has no rows"
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _load_local(src: Source, cache_dir: str | None, where: str):
    """A local json, jsonl or parquet split (plain text is read by `read_text_lines`)."""
    import datasets

    _check_local_files(src, where)
    try:
        return datasets.load_dataset(
            src.builder, data_files={"split": list(src.files)}, split="split", cache_dir=cache_dir
        )
    except Exception as e:
        why = _cause(e)
        raise DataError(f"data.dataset: could not read {src.describe()!r} {where} as {src.builder}: {why}") from e


def read_text_lines(files: Sequence[str]) -> Iterator[str]:
    """The lines of plain-text files, line breaks kept, lazily: what `datasets`' ``text`` builder yields
    with ``keep_linebreaks`` (universal newlines, split on "\\n" only), without importing `datasets`,
    which costs every restarted worker about a second."""
    for path in files:
        with open(path, encoding="utf-8") as f:
            yield from f


def _open_dataset(src: Source, cfg: DataConfig, where: str):
    """The Arrow-backed (memory-mapped, not loaded) `datasets.Dataset` of a json/jsonl/parquet, saved or hub
    ``src``."""
    import datasets

    cache_dir = cfg.cache_dir or None
    with _quiet_datasets():
        if src.kind == "saved":
            try:
                return open_saved(src.files[0], src.saved_split)
            except SavedDatasetError as e:
                raise DataError(f"data.dataset: {e} {where}") from e
        if src.kind == "local":
            return _load_local(src, cache_dir, where)
        try:
            return datasets.load_dataset(src.hub_id, src.hub_config or None, split=src.hub_split, cache_dir=cache_dir)
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            why = (
                f"{str(SHARED_WIKITEXT2)!r} does not exist"
                if cfg.dataset.strip() == "wikitext-2"
                else f"{cfg.dataset!r} is not a local path"
            )
            raise DataError(
                f"data.dataset: {why} and loading {src.describe()} "
                f"from the Hugging Face hub failed ({type(e).__name__}: {msg})"
            ) from e


def _column_rows(ds, field: str) -> Iterator[str | None]:
    """Column ``field`` of ``ds``, one Arrow record batch at a time (straight from Arrow: much faster than
    row access, and never the whole column in Python objects)."""
    for chunk in ds.data.column(field).chunks:
        yield from chunk.to_pylist()


def iter_documents(src: Source, cfg: DataConfig, where: str) -> Iterator[str]:
    """The documents of ``src`` in order, streamed; ``where`` (e.g. ``(data.train_split='valid')``) is named
    in errors. Checks that read the files (readable, not all empty, UTF-8) run before the first document."""
    if src.kind == "local" and src.builder == "text":
        _check_local_files(src, where)
        yield from group_lines(read_text_lines(src.files))
        return
    ds = _open_dataset(src, cfg, where)
    field = cfg.text_field
    if field not in ds.column_names:
        raise DataError(
            f"data.text_field: column {field!r} not found in {src.describe()!r} {where} (columns: {ds.column_names})"
        )
    rows = _column_rows(ds, field)
    if src.lines_are_rows:
        yield from group_lines(rows)
        return
    for text in rows:
        if text is None:
            continue
        if not isinstance(text, str):
            raise DataError(
                f"data.text_field: column {field!r} of {src.describe()!r} {where} holds {type(text).__name__}, not text"
            )
        if text.strip():
            yield text


_TOKEN_CACHE: dict[tuple, torch.Tensor] = {}


def _tokenizer_key(tok: Tokenizer) -> tuple:
    path = getattr(tok, "path", None)
    if path is not None:
        st = os.stat(path)
        return (type(tok).__name__, str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    return (type(tok).__name__, tok.vocab_size, tok.eos_id)


def describe_split(cfg: DataConfig, split: str, split_key: str = "data.train_split") -> str:
    """Human-readable name of a split's source, e.g. ``'/.../valid.txt' (data.train_split='valid')``."""
    return f"{resolve_source(cfg, split, split_key).describe()!r} ({split_key}={split!r})"


def load_tokens(
    cfg: DataConfig, split: str, tokenizer: Tokenizer, *, split_key: str = "data.train_split"
) -> torch.Tensor:
    """Tokens of split ``split`` of ``cfg.dataset``: documents joined with ``eos_id`` between them.

    Returns a 1-D int32 tensor (shared with an in-process cache -- do not modify it).
    ``split_key`` is the config key named in errors about the split.
    """
    src = resolve_source(cfg, split, split_key)
    field = "text" if (src.kind == "local" and src.builder == "text") else cfg.text_field
    key = (src.cache_key(), field, _tokenizer_key(tokenizer))
    hit = _TOKEN_CACHE.get(key)
    if hit is not None:
        return hit
    where = f"({split_key}={split!r})"
    docs = list(iter_documents(src, cfg, where))
    if not docs:
        raise DataError(f"data.dataset: {src.describe()!r} {where} contains no text")
    arr = encode_documents(tokenizer, docs)
    tokens = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int32))
    _TOKEN_CACHE[key] = tokens
    return tokens
