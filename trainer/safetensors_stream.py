"""Write a safetensors file one tensor at a time: never more than one tensor's bytes in memory beyond the
caller's, where `safetensors.torch.save` builds the whole file in memory first.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON
header naming each tensor's dtype, shape and byte range, padded with spaces to a multiple of 8, then the
tensors' bytes back to back. Tensors are laid out by element size, largest first, then by name, as the
library does, so every tensor starts at a multiple of its element size. `safe_open` reads the result.
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


def layout(specs: Mapping[str, Spec], metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The file's header bytes (length prefix included) and the tensor names in the order their bytes follow."""
    order = sorted(specs, key=lambda name: (-specs[name][0].itemsize, name))
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


def write_safetensors(
    path: Path,
    specs: Mapping[str, Spec],
    tensor_of: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
    sha256: bool = True,
) -> str:
    """Create the new file `path` (owner-only; never an existing one, never through a symlink), synced,
    holding `tensor_of(name)` for every name of `specs` (its dtype and shape checked); the file's sha256
    ("" with `sha256=False`). On an error the partial file stays: write into a temporary directory."""
    head, order = layout(specs, metadata)
    digest = hashlib.sha256(head) if sha256 else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(head)
        for name in order:
            tensor = tensor_of(name).detach().cpu().contiguous()
            if (tensor.dtype, tuple(tensor.shape)) != (specs[name][0], tuple(specs[name][1])):
                raise ValueError(f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, the header says {specs[name]}")
            data = tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else b""
            if digest is not None:
                digest.update(data)
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest() if digest is not None else ""
