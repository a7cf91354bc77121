"""Safetensors files read one tensor at a time with plain reads: whatever a file's size, a reader holds the
tensor it returns and nothing else of the file.

``safe_open`` maps the whole file copy-on-write: under the kernel's default overcommit heuristic a mapping
larger than the host's memory is refused (a 28 GB checkpoint on a 24 GiB host: ENOMEM), and every page a reader
touches stays in its resident memory until the mapping goes. :class:`SafetensorsFile` reads the header, checks
it as the safetensors library does (a JSON object of at most 100 MB; each tensor a known dtype, a shape, and the
byte range that shape needs, the ranges back to back over the whole data), and reads each tensor's bytes into a
new tensor when it is asked for. Nothing is unpickled and no symlink is followed. A malformed file raises
:class:`SafetensorsFileError`; :func:`read_or_raise` turns it (or an ``OSError``) into a caller's one-line error
naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_HEADER = 100_000_000  # the safetensors library's limit
READ_CHUNK = 1 << 30  # bytes per read call (Linux returns at most about 2 GiB from one)
DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
}


class SafetensorsFileError(ValueError):
    """A file that is not a well-formed safetensors file; the message says why."""


def read_or_raise(path: Path, read, error: type[Exception]):
    """``read()``, a read of the safetensors file ``path``; a failure is raised as ``error`` with one line naming
    the file."""
    try:
        return read()
    except (SafetensorsFileError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise error(f"{path}: unreadable ({reason})") from None


@dataclass(frozen=True)
class Entry:
    """One tensor of the header: its dtype, shape and byte range in the data after the header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _open(path: Path):
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb", buffering=0)


def _entry(name: str, spec) -> Entry:
    if not isinstance(spec, dict) or spec.get("dtype") not in DTYPES:
        raise SafetensorsFileError(f"tensor {name!r}: no dtype of safetensors ({spec!r:.80})")
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SafetensorsFileError(f"tensor {name!r}: shape {shape!r:.80} is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
        raise SafetensorsFileError(f"tensor {name!r}: data_offsets {offsets!r:.80} are not two offsets")
    entry = Entry(DTYPES[spec["dtype"]], tuple(shape), *offsets)
    if entry.end - entry.begin != entry.dtype.itemsize * math.prod(entry.shape):
        raise SafetensorsFileError(f"tensor {name!r}: data_offsets {offsets} do not hold its shape {shape}")
    return entry


def _read_header(path: Path) -> tuple[dict[str, Entry], int]:
    """The tensors of the file's header, checked, and where its data begins."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 2 <= length <= min(MAX_HEADER, size - 8):
            raise SafetensorsFileError(f"header length {length} does not fit the file's {size} bytes")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise SafetensorsFileError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsFileError("header is not a JSON object")
    header.pop("__metadata__", None)
    entries = {name: _entry(name, spec) for name, spec in header.items()}
    end = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != end:
            raise SafetensorsFileError(
                f"tensor {name!r} starts at {entry.begin}, not where the one before ends ({end})"
            )
        end = entry.end
    if end != size - 8 - length:
        raise SafetensorsFileError(f"the tensors hold {end} bytes, the file's data {size - 8 - length}")
    return entries, 8 + length


class SafetensorsFile:
    """The tensors of one safetensors file, read when asked for (``keys``, ``shape``, ``get_tensor``)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries, self.data_start = _read_header(self.path)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def get_tensor(self, name: str) -> torch.Tensor:
        """A new CPU tensor holding tensor ``name``'s bytes, read from the file (which may have changed: a short
        read is an error)."""
        entry = self.entries[name]
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        target = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
        with _open(self.path) as f:
            f.seek(self.data_start + entry.begin)
            done = 0
            while done < len(target):
                n = f.readinto(target[done : done + READ_CHUNK])
                if not n:
                    raise SafetensorsFileError(f"tensor {name!r}: the file ends {len(target) - done} bytes short")
                done += n
        return tensor
