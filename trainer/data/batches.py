"""Batches addressed by iteration: packed sequences, data-parallel layout, stateful loader.

* :class:`TokenBatches` cuts the tokens into ``num_sequences`` rows of ``seq_len + 1``
  tokens (trailing remainder dropped) and serves the global batch of any step as a pure
  function of ``(seed, step)``; :meth:`TokenBatches.local_batch` gives one data-parallel
  rank's share, laid out so that micro-batch ``m`` of every rank together is exactly
  micro-batch ``m`` of the single-process run.
* :func:`make_loader` wraps a :class:`TokenBatches` in a ``torchdata``
  ``StatefulDataLoader`` yielding ``(step, inputs, labels)`` from a start step; its
  ``state_dict()``/``load_state_dict()`` round-trip the position.
* :func:`build_data` is what the trainer calls. Its tokens come from one of two sources behind the
  same interface: a split packed in memory (:mod:`trainer.data.corpus`, for small files) or a split of a
  prepared corpus memory-mapped from its shards (:mod:`trainer.data.token_shards`, when ``data.dataset`` is
  a directory written by ``python -m trainer.data.prepare``).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from trainer.data.corpus import DataConfig, DataError, describe_split, load_tokens
from trainer.data.token_shards import ShardedTokens, is_prepared, open_split
from trainer.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer, resolve_path

__all__ = ["DataConfig", "DataError", "TokenBatches", "build_data", "make_loader"]

# --------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------


def _mix_seed(seed: int, epoch: int) -> int:
    h = hashlib.blake2b(f"trainer.data:{int(seed)}:{int(epoch)}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class InMemoryTokens:
    """A packed 1-D token tensor in memory: the token source of small corpora."""

    def __init__(self, tokens: torch.Tensor):
        self.data = torch.as_tensor(tokens).reshape(-1)
        self.num_tokens = int(self.data.numel())

    def sequences(self, indices: torch.Tensor, row: int) -> torch.Tensor:
        """``LongTensor[len(indices), row]``: row ``i`` is tokens ``indices[i] * row`` onwards."""
        rows = self.data[: self.num_tokens // row * row].view(-1, row)
        return rows.index_select(0, indices).long()


TokenSource = InMemoryTokens | ShardedTokens


class TokenBatches:
    """Packed ``seq_len + 1``-token sequences served as batches addressed by step.

    The global batch of ``step`` is a pure function of ``(seed, step)``: with
    ``batches_per_epoch = num_sequences // global_batch_size``, step ``t`` is in epoch
    ``t // batches_per_epoch`` and takes block ``t % batches_per_epoch`` of that epoch's
    order -- a ``torch.randperm`` seeded by ``(seed, epoch)`` when ``shuffle``, else the
    sequences in file order. The ``num_sequences % global_batch_size`` sequences left over
    after the last full block of an epoch's order are not visited in that epoch.

    Data-parallel layout: the ``B`` sequences of a global batch are viewed as
    ``[micro_batches][dp_size][b]`` with ``b = B // (micro_batches * dp_size)``; rank ``r``
    gets ``rows[m*dp*b + r*b : m*dp*b + (r+1)*b]`` for ``m = 0..M-1`` concatenated, so
    cutting its local batch into ``M`` contiguous micro-batches gives, for each ``m``, rank
    ``r``'s share of single-process micro-batch ``m`` (ranks in order).
    """

    def __init__(
        self,
        tokens: torch.Tensor | TokenSource,
        seq_len: int,
        global_batch_size: int,
        micro_batches: int = 1,
        seed: int = 0,
        *,
        shuffle: bool = True,
        name: str = "data.train_split",
    ):
        if seq_len < 1:
            raise DataError(f"model seq_len must be >= 1, got {seq_len}")
        if global_batch_size < 1:
            raise DataError(f"training.batch_size must be >= 1, got {global_batch_size}")
        if micro_batches < 1:
            raise DataError(f"training.micro_batches must be >= 1, got {micro_batches}")
        if global_batch_size % micro_batches:
            raise DataError(
                f"training.batch_size ({global_batch_size}) must be divisible by "
                f"training.micro_batches ({micro_batches})"
            )
        self.tokens = tokens if isinstance(tokens, TokenSource) else InMemoryTokens(tokens)
        self.seq_len = int(seq_len)
        self.global_batch_size = int(global_batch_size)
        self.micro_batches = int(micro_batches)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.name = name
        row = self.seq_len + 1
        self.num_tokens = self.tokens.num_tokens
        self.num_sequences = self.num_tokens // row
        if self.num_sequences < self.global_batch_size:
            raise DataError(
                f"data.dataset: {name} has {self.num_tokens} tokens = {self.num_sequences} sequences of "
                f"seq_len+1={row} tokens, fewer than one global batch needs "
                f"(training.batch_size={self.global_batch_size} sequences = {self.global_batch_size * row} tokens)"
            )
        self.batches_per_epoch = self.num_sequences // self.global_batch_size
        self._perm_cache: dict[int, torch.Tensor] = {}

    # -- sizes ------------------------------------------------------------------------
    @property
    def num_batches(self) -> int:
        """Distinct global batches per pass over the data (= number of validation batches)."""
        return self.batches_per_epoch

    def __len__(self) -> int:
        return self.batches_per_epoch

    def check_dp(self, dp_size: int) -> None:
        if dp_size < 1 or self.global_batch_size % (self.micro_batches * dp_size):
            raise DataError(
                f"training.batch_size ({self.global_batch_size}) must be divisible by "
                f"training.micro_batches ({self.micro_batches}) x data-parallel size ({dp_size})"
            )

    # -- indexing ---------------------------------------------------------------------
    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_sequences)
        perm = self._perm_cache.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(_mix_seed(self.seed, epoch))
            perm = torch.randperm(self.num_sequences, generator=g)
            if len(self._perm_cache) >= 4:  # cache only; results never depend on it
                self._perm_cache.pop(next(iter(self._perm_cache)))
            self._perm_cache[epoch] = perm
        return perm

    def global_indices(self, step: int) -> torch.Tensor:
        """Sequence indices of the global batch of ``step``, in order (sequence ``i`` is the ``seq_len + 1``
        tokens from ``i * (seq_len + 1)`` on)."""
        step = int(step)
        if step < 0:
            raise IndexError(f"step must be >= 0, got {step}")
        epoch, block = divmod(step, self.batches_per_epoch)
        B = self.global_batch_size
        return self._order(epoch)[block * B : (block + 1) * B]

    def local_indices(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> torch.Tensor:
        self.check_dp(dp_size)
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} out of range for data-parallel size {dp_size}")
        b = self.global_batch_size // (self.micro_batches * dp_size)
        # [M][dp][b] -> rank's [M][b]
        g = self.global_indices(step).view(self.micro_batches, dp_size, b)
        return g[:, dp_rank, :].reshape(-1)

    def _rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.tokens.sequences(idx, self.seq_len + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)``, each ``LongTensor[global_batch_size, seq_len]``."""
        return self._rows(self.global_indices(step))

    def local_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``dp_rank``'s share of the global batch of ``step``.

        ``(inputs, labels)``, each ``LongTensor[global_batch_size // dp_size, seq_len]``;
        ``labels`` are ``inputs`` shifted left by one token. Split it into
        ``micro_batches`` contiguous chunks for gradient accumulation.
        """
        return self._rows(self.local_indices(step, dp_rank, dp_size))

    def val_batch(self, i: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch ``i`` (``0 <= i < num_batches``): same as ``local_batch(i, ...)``,
        range-checked; with ``shuffle=False`` it is the i-th block of sequences in file order."""
        if not 0 <= int(i) < self.batches_per_epoch:
            raise IndexError(f"validation batch {i} out of range (0..{self.batches_per_epoch - 1})")
        return self.local_batch(i, dp_rank, dp_size)

    def __repr__(self) -> str:
        return (
            f"TokenBatches({self.name}: {self.num_tokens} tokens, {self.num_sequences} x {self.seq_len + 1}, "
            f"B={self.global_batch_size}, M={self.micro_batches}, {self.batches_per_epoch} batches/epoch, "
            f"shuffle={self.shuffle}, seed={self.seed})"
        )


# --------------------------------------------------------------------------------------
# StatefulDataLoader plumbing
# --------------------------------------------------------------------------------------


class StepBatchDataset(torch.utils.data.Dataset):
    """Map-style dataset: item ``step`` is ``(step, inputs, labels)`` of this rank's local batch."""

    def __init__(self, batches: TokenBatches, dp_rank: int = 0, dp_size: int = 1):
        batches.check_dp(dp_size)
        self.batches, self.dp_rank, self.dp_size = batches, dp_rank, dp_size

    def __getitem__(self, step: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        inputs, labels = self.batches.local_batch(step, self.dp_rank, self.dp_size)
        return int(step), inputs, labels


class StepSampler(torch.utils.data.Sampler[int]):
    """Yields ``start_step, start_step + 1, ...`` (forever, or up to ``end_step`` exclusive).

    Stateful (``state_dict`` / ``load_state_dict``), so ``StatefulDataLoader`` restores the
    position directly instead of fast-forwarding.
    """

    def __init__(self, start_step: int = 0, end_step: int | None = None):
        self.next_step = int(start_step)
        self.end_step = end_step

    def __iter__(self) -> Iterator[int]:
        while self.end_step is None or self.next_step < self.end_step:
            step = self.next_step
            self.next_step += 1
            yield step

    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_step = int(state["next_step"])


def make_loader(
    batches: TokenBatches,
    start_step: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    num_workers: int = 0,
    *,
    end_step: int | None = None,
    pin_memory: bool = False,
):
    """A ``torchdata.stateful_dataloader.StatefulDataLoader`` yielding ``(step, inputs, labels)``
    for ``step = start_step, start_step + 1, ...`` (``end_step`` exclusive; default: forever).

    ``inputs``/``labels`` are this rank's local batch (``batches.local_batch(step, dp_rank, dp_size)``).
    ``loader.state_dict()`` / ``loader.load_state_dict(sd)`` (before iterating) resume at the
    step after the last one yielded.
    """
    from torchdata.stateful_dataloader import StatefulDataLoader

    if num_workers < 0:
        raise DataError(f"data.num_workers must be >= 0, got {num_workers}")
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
        warnings.filterwarnings("ignore", message=".*set_vital.*deprecated", category=UserWarning)
        return StatefulDataLoader(
            StepBatchDataset(batches, dp_rank, dp_size),
            batch_size=None,
            sampler=StepSampler(start_step, end_step),
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=False,
        )


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def split_tokens(cfg: DataConfig, split: str, tok: Tokenizer, key: str) -> tuple[TokenSource, str]:
    """``(tokens, name)`` of split ``split`` (config key ``key``): memory-mapped from a prepared corpus
    when ``data.dataset`` is one, else read, tokenized and packed in memory."""
    path = resolve_path(cfg.dataset.strip()) if cfg.dataset.strip() else None
    if path is not None and is_prepared(path):
        tokens = open_split(path, split, tok, key)
        return tokens, tokens.name
    return InMemoryTokens(load_tokens(cfg, split, tok, split_key=key)), describe_split(cfg, split, key)


def build_data(
    cfg: DataConfig, seq_len: int, global_batch_size: int, micro_batches: int, seed: int
) -> tuple[Tokenizer, TokenBatches, TokenBatches | None]:
    """``(tokenizer, train_batches, val_batches)``.

    ``train_batches`` is shuffled per epoch with ``seed``; ``val_batches`` serves the val
    split's sequences in file order (``val_batches.val_batch(i, rank, dp)`` for
    ``i < val_batches.num_batches``), or is ``None`` when ``cfg.val_split == ""``.
    Bad settings, a bad tokenizer file or bad data files raise :class:`DataError` naming the key and file.
    """
    if cfg.num_workers < 0:
        raise DataError(f"data.num_workers must be >= 0, got {cfg.num_workers}")
    try:
        tok = build_tokenizer(cfg.tokenizer)
    except TokenizerError as e:  # the trainer reports DataError as one line
        raise DataError(str(e)) from None
    tokens, name = split_tokens(cfg, cfg.train_split, tok, "data.train_split")
    train = TokenBatches(tokens, seq_len, global_batch_size, micro_batches, seed, shuffle=True, name=name)
    val = None
    if cfg.val_split:
        tokens, name = split_tokens(cfg, cfg.val_split, tok, "data.val_split")
        val = TokenBatches(tokens, seq_len, global_batch_size, micro_batches, seed, shuffle=False, name=name)
    return tok, train, val
