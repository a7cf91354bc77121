"""CPU cost of hashing a snapshot's entries: XXH3-64 per entry (`moevement.storage.snapshot.checksums`)
against the Fletcher-style block sums it replaced (kept here only as the compared variant), interleaved.

    python -m benchmarks.snapshot_hash [--mb 256] [--rounds 9]

Entries are laid out as in a snapshot (1 KiB aligned), with sizes drawn like a MoE layer's: many
expert slices of 0.25-4 MB and a few small norms and router weights. Prints the median GB/s of each
and the ratio of their CPU times (one thread, as the copy thread runs).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from moevement.storage.snapshot import BLOCK, Entry, checksums

MASK = (1 << 64) - 1


def block_sums(buffer: torch.Tensor, entries: list[Entry]) -> list[str]:
    """The replaced checksum: wrapping sums of 8-byte words per 1 KiB block, and of the block sums
    weighted by position (one vectorised pass, prefix sums per entry)."""
    end = max(e.offset + -(-e.nbytes // BLOCK) * BLOCK for e in entries)
    blocks = buffer[:end].view(torch.int64).view(-1, BLOCK // 8).sum(dim=1)
    zero = torch.zeros(1, dtype=torch.int64)
    prefix = torch.cat([zero, blocks.cumsum(0)])
    weighted = torch.cat([zero, (blocks * torch.arange(1, blocks.numel() + 1)).cumsum(0)])
    start = torch.tensor([e.offset // BLOCK for e in entries])
    count = torch.tensor([-(-e.nbytes // BLOCK) for e in entries])
    length = torch.tensor([e.nbytes for e in entries])
    first = prefix[start + count] - prefix[start]
    second = weighted[start + count] - weighted[start] - start * first + (count + 1) * (first + length)
    return [f"{a & MASK:016x}{b & MASK:016x}" for a, b in zip(first.tolist(), second.tolist())]


def layout(total_mb: int, seed: int = 0) -> tuple[torch.Tensor, list[Entry]]:
    rng = random.Random(seed)
    entries, offset = [], 0
    while offset < total_mb << 20:
        nbytes = rng.choice([rng.randint(256 << 10, 4 << 20)] * 9 + [rng.randint(4, 64 << 10)])
        entries.append(Entry("op", f"t{len(entries)}", "master", "uint8", [nbytes], offset, nbytes))
        offset += -(-nbytes // BLOCK) * BLOCK
    buffer = torch.randint(0, 256, (offset,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return buffer, entries


def cpu_seconds(fn) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="snapshot size")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    buffer, entries = layout(args.mb)
    variants = {"block_sums": block_sums, "xxh3": checksums}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(cpu_seconds(lambda fn=fn: fn(buffer, entries)))
    gb = buffer.numel() / 1e9
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in median.items():
        print(f"hash={name} entries={len(entries)} gb={gb:.3f} cpu_s={seconds:.4f} gb_per_s={gb / seconds:.2f}")
    print(f"ratio xxh3/block_sums cpu={median['xxh3'] / median['block_sums']:.3f}")


if __name__ == "__main__":
    main()
