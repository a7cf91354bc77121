"""Safetensors files read one tensor at a time while holding a bounded amount of them in memory.

``safe_open`` maps a file, and ``get_tensor`` returns a tensor over the mapping: every page a reader touches
stays resident in its process until the mapping goes, so reading a 65 GB checkpoint through handles kept
open ends with the whole file in the process's memory (file-backed, but counted, and the reason a 16B
export would not fit beside anything else). A :class:`MappingBudget` hands out :class:`MappedFile` handles
that open their file on first use and are all closed again once ``budget`` bytes of tensors have been
handed out since the last close: a reader holds at most about the budget of mapped pages, plus the tensors
it still keeps (a tensor keeps its own mapping alive until it is freed, so closing never invalidates one).

Nothing is unpickled. The handles raise what ``safe_open`` raises (``SafetensorError``, ``OSError``);
:func:`read_or_raise` turns that into a caller's one-line error naming the file. Single-threaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

DEFAULT_BUDGET = 1 << 30  # 1 GiB of tensors between two closes


def read_or_raise(path: Path, read, error: type[Exception]):
    """``read()``, a safetensors read of ``path``; a failure is raised as ``error`` with one line naming the file."""
    try:
        return read()
    except (SafetensorError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise error(f"{path}: unreadable ({reason})") from None


class MappedFile:
    """A ``safe_open`` handle of ``path`` (``keys``, ``get_slice``, ``get_tensor``), opened when first used and
    reopened after its :class:`MappingBudget` closed it."""

    def __init__(self, path: Path, budget: MappingBudget):
        self.path, self.budget = path, budget
        self._handle = None

    def _open(self):
        if self._handle is None:
            self._handle = safe_open(str(self.path), framework="pt", device="cpu")
        return self._handle

    def keys(self) -> list[str]:
        return list(self._open().keys())

    def get_slice(self, name: str):
        return self._open().get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self._open().get_tensor(name)
        self.budget.handed_out(tensor.nbytes)
        return tensor

    def close(self) -> None:
        self._handle = None  # the mapping goes with the last reference: this handle's, or a tensor's


class MappingBudget:
    """The :class:`MappedFile` handles of one reader; all are closed whenever ``budget`` bytes of tensors have
    been handed out since the last close."""

    def __init__(self, budget: int = DEFAULT_BUDGET):
        self.budget, self.since_close = budget, 0
        self.files: list[MappedFile] = []

    def file(self, path: Path) -> MappedFile:
        handle = MappedFile(path, self)
        self.files.append(handle)
        return handle

    def handed_out(self, nbytes: int) -> None:
        self.since_close += nbytes
        if self.since_close >= self.budget:
            self.close()

    def close(self) -> None:
        for handle in self.files:
            handle.close()
        self.since_close = 0
