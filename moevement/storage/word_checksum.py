"""The chunk checksum a GPU computes beside its snapshot copy, and a CPU recomputes bit for bit.

XXH3 (`snapshot.checksum`) is a CPU hash: on a GPU it would need the copy's bytes back on the host, a
thread to hash them, and that thread would take the GIL from a training thread that takes it at every
kernel launch. This checksum is computed on the device, over the staging slot a chunk was gathered in, on
the copy's stream, in integer arithmetic every device does alike: int64 products and sums wrap modulo
2^64, and a sum of integers is exact in any order, so the CPU recomputes it with the same code.

For a chunk of n 64-bit words w (its bytes, padding included, zero-extended to whole 64 KiB blocks):

    x_i = w_i XOR (w_i >> 31)                         (arithmetic shift)
    S_b = sum over the block's words j of x_(bP+j) * K_j   (P = 8192 words; K: odd keys)
    C   = sum over blocks b of (S_b XOR (S_b >> 29)) * L_b  +  n * L_length      (L: odd keys)

Every word position has its own pair of keys, so swapped words and moved blocks change C; the shift makes
a flip of a word's top bit (which any odd multiplier maps to 2^63) change its low bits too, so two such
flips do not cancel; a change of one word alone never cancels (odd keys are invertible modulo 2^64).
Like XXH3, it detects corruption, not forgery: the sealed records and owner-only directories keep writers
out (docs/design/safety.md).
"""

from __future__ import annotations

import torch

FORMAT = "chunk-mix64"  # a header's `checksums`, this per chunk (written by a GPU's snapshot copy)
BLOCK_WORDS = 8192  # 64 KiB blocks
BLOCK_BYTES = BLOCK_WORDS * 8
_MASK = (1 << 64) - 1
_tables: dict[torch.device, torch.Tensor] = {}  # per device: K (BLOCK_WORDS keys), then L (as many as asked)


def _splitmix64(seed: int, count: int) -> list[int]:
    """`count` odd 64-bit keys from SplitMix64 (Steele, Lea and Flood, 2014), as signed int64 values."""
    keys, state = [], seed
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        z = (z ^ (z >> 31)) | 1
        keys.append(z - (1 << 64) if z >> 63 else z)
    return keys


_LENGTH_KEY = _splitmix64(0x6C656E677468, 1)[0] & _MASK


def _keys(device: torch.device, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, L[:blocks]) on `device`; the table grows (doubling) when more blocks are asked for."""
    table = _tables.get(device)
    if table is None or table.numel() < BLOCK_WORDS + blocks:
        count = max(blocks, 1024, 2 * (table.numel() - BLOCK_WORDS if table is not None else 0))
        keys = _splitmix64(0x4D6F45766D656E74, BLOCK_WORDS) + _splitmix64(0x626C6F636B73, count)
        table = _tables[device] = torch.tensor(keys, dtype=torch.int64, device=device)
    return table[:BLOCK_WORDS], table[BLOCK_WORDS : BLOCK_WORDS + blocks]


def block_rounded(nbytes: int) -> int:
    """`nbytes` rounded up to whole 64 KiB blocks (what `block_sums` reads of a staging slot)."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def block_sums(data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """S_b of every block of `data` (a uint8 tensor of whole 64 KiB blocks), into `out` if given, on `data`'s
    device and current stream."""
    words = data.view(torch.int64).view(-1, BLOCK_WORDS)
    word_keys, _ = _keys(data.device, 0)
    mixed = torch.bitwise_right_shift(words, 31)
    mixed.bitwise_xor_(words).mul_(word_keys)
    return torch.sum(mixed, dim=1, out=out)


def _mixed(sums: torch.Tensor, block_keys: torch.Tensor) -> torch.Tensor:
    """(S_b XOR (S_b >> 29)) * L_b, block by block."""
    return torch.bitwise_right_shift(sums, 29).bitwise_xor_(sums).mul_(block_keys)


def _block_terms(data: torch.Tensor, first_block: int = 0) -> torch.Tensor:
    """The block part of C over the blocks of `data`, block `first_block` of its chunk first: one int64."""
    sums = block_sums(data)
    _, block_keys = _keys(data.device, first_block + sums.numel())
    return _mixed(sums, block_keys[first_block:]).sum()


class ChunkSums:
    """The block parts of C of a plan's chunks, computed on the device without a host wait: each chunk's
    block sums go into `views[k]` (`block_sums`) as it is copied, then `combine` mixes every block at once
    and sums each chunk's row (a gather into one row per chunk, zero-padded: no atomics, which deterministic
    mode refuses, and integer sums are exact in any order)."""

    def __init__(self, blocks: list[int], device: torch.device):
        _, block_keys = _keys(device, max(blocks, default=0))
        total, widest = sum(blocks), max(blocks, default=0)
        self.blocks = torch.zeros(total, dtype=torch.int64, device=device)
        self.keys = torch.cat([block_keys[:n] for n in blocks]) if total else self.blocks.clone()
        rows, start = [], 0
        for n in blocks:  # chunk k's row: its blocks, then the zero appended after every block
            rows.append(list(range(start, start + n)) + [total] * (widest - n))
            start += n
        self.rows = torch.tensor(rows, dtype=torch.int64).view(-1).to(device)
        self.views = [self.blocks[sum(blocks[:k]) : sum(blocks[: k + 1])] for k in range(len(blocks))]
        self.sums = torch.zeros(len(blocks), dtype=torch.int64, device=device)
        self.zero = torch.zeros(1, dtype=torch.int64, device=device)

    def combine(self) -> None:
        """On the current stream: `sums[k]` = the block part of C of chunk k, from its `views[k]`."""
        if not self.rows.numel():
            return  # no chunk has blocks (all on the host): every sum stays zero
        mixed = torch.cat([_mixed(self.blocks, self.keys), self.zero]).index_select(0, self.rows)
        torch.sum(mixed.view(len(self.views), -1), dim=1, out=self.sums)


class SparseWords:
    """C of a chunk of `nbytes` on the host whose bytes are zero outside `spans` (byte ranges, 8-byte aligned
    starts), computed over the words of those spans alone: a zero word adds nothing to its S_b, and a block
    whose S_b is zero adds nothing to C. A GPU's host chunk is step counters, one per 1 KiB-padded entry:
    summing its few words instead of every padded block is ~40x faster on the training thread."""

    def __init__(self, spans: list[tuple[int, int]], nbytes: int):
        cpu = torch.device("cpu")
        words = [torch.arange(lo // 8, -(-hi // 8), dtype=torch.int64) for lo, hi in spans]
        self.positions = torch.cat(words) if words else torch.zeros(0, dtype=torch.int64)
        n_blocks = -(-nbytes // BLOCK_BYTES)
        word_keys, self.block_keys = _keys(cpu, n_blocks)
        self.word_keys = word_keys[self.positions % BLOCK_WORDS]
        self.block_of = self.positions // BLOCK_WORDS
        self.n_blocks, self.nbytes = n_blocks, nbytes

    def checksum(self, data: torch.Tensor) -> str:
        """C of `data` (a uint8 tensor of `nbytes`, zero outside the spans), as `checksum` gives it."""
        words = data.view(torch.int64).index_select(0, self.positions)
        mixed = torch.bitwise_right_shift(words, 31).bitwise_xor_(words).mul_(self.word_keys)
        sums = torch.zeros(self.n_blocks, dtype=torch.int64).index_add_(0, self.block_of, mixed)
        return finish(int(_mixed(sums, self.block_keys).sum()), self.nbytes)


def finish(block_part: int, nbytes: int) -> str:
    """C of a chunk of `nbytes` whose block part is `block_part` (`ChunkSums.sums`), as 16 hex digits."""
    return f"{(block_part + (nbytes // 8) * _LENGTH_KEY) & _MASK:016x}"


def checksum(data: memoryview) -> str:
    """C of these bytes (a whole number of 64-bit words), computed on the CPU: what `ChunkSums` and `finish`
    give on any device for the same bytes."""
    if len(data) % 8:
        raise ValueError(f"{FORMAT} covers whole 64-bit words, not {len(data)} bytes")
    raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    whole = raw.numel() - raw.numel() % BLOCK_BYTES
    total = int(_block_terms(raw[:whole])) if whole else 0
    if whole < raw.numel():
        tail = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
        tail[: raw.numel() - whole] = raw[whole:]
        total += int(_block_terms(tail, whole // BLOCK_BYTES))
    return finish(total, raw.numel())
