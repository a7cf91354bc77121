"""Write a safetensors file one tensor at a time: never more than one tensor's bytes in memory beyond the
caller's, where `safetensors.torch.save` builds the whole file in memory first.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON
header naming each tensor's dtype, shape and byte range, padded with spaces to a multiple of 8, then the
tensors' bytes back to back. Tensors are laid out by element size, largest first, then by name, as the
library does (or in an order the writer is given, of element sizes that never grow), so every tensor
starts at a multiple of its element size. `safe_open` reads the result.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

Spec = tuple[torch.dtype, tuple[int, ...]]  # a tensor's dtype and shape


def layout(
    specs: Mapping[str, Spec], metadata: dict[str, str] | None = None, in_order: bool = False
) -> tuple[bytes, list[str]]:
    """The file's header bytes (length prefix included) and the tensor names in the order their bytes follow:
    by element size, largest first, then by name; or, with `in_order`, the order of `specs` (whose element
    sizes must not grow, so that every tensor stays aligned)."""
    order = list(specs) if in_order else sorted(specs, key=lambda name: (-specs[name][0].itemsize, name))
    sizes = [specs[name][0].itemsize for name in order]
    if any(a < b for a, b in zip(sizes, sizes[1:])):
        raise ValueError("safetensors layout: tensors must come largest element size first")
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        dtype, shape = specs[name]
        nbytes = dtype.itemsize * math.prod(shape)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


class SafetensorsWriter:
    """A new file `path` (owner-only; never an existing one, never through a symlink) whose header lists
    `specs`; `write` then takes the tensors one at a time in the header's order (`layout`). Use as a
    context manager; `finish` syncs the file and returns its sha256 ("" with `sha256=False`). On an error
    the partial file stays: write into a temporary directory."""

    def __init__(
        self,
        path: Path,
        specs: Mapping[str, Spec],
        metadata: dict[str, str] | None = None,
        sha256: bool = True,
        in_order: bool = False,
    ):
        head, self.order = layout(specs, metadata, in_order)
        self.specs, self.written = specs, 0
        self.digest = hashlib.sha256(head) if sha256 else None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self.file = os.fdopen(fd, "wb")
        self.file.write(head)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self.written] if self.written < len(self.order) else None
        if name != expected:
            raise ValueError(f"{name}: written out of order (the header's next tensor is {expected!r})")
        tensor = tensor.detach().cpu().contiguous()
        if (tensor.dtype, tuple(tensor.shape)) != (self.specs[name][0], tuple(self.specs[name][1])):
            raise ValueError(f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, the header says {self.specs[name]}")
        data = tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else b""
        if self.digest is not None:
            self.digest.update(data)
        self.file.write(data)
        self.written += 1

    def finish(self) -> str:
        if self.written != len(self.order):
            raise ValueError(f"safetensors file: {len(self.order) - self.written} tensor(s) never written")
        self.file.flush()
        os.fsync(self.file.fileno())
        return self.digest.hexdigest() if self.digest is not None else ""


def write_safetensors(
    path: Path,
    specs: Mapping[str, Spec],
    tensor_of: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
    sha256: bool = True,
) -> str:
    """Create the new file `path` holding `tensor_of(name)` for every name of `specs` (its dtype and shape
    checked), laid out by `layout`; its sha256 ("" with `sha256=False`). See `SafetensorsWriter`."""
    with SafetensorsWriter(path, specs, metadata, sha256) as writer:
        for name in writer.order:
            writer.write(name, tensor_of(name))
        return writer.finish()
