"""What hashing a snapshot costs the training thread beside it: XXH3-64 per chunk (`moevement.storage.snapshot`:
one call per ~4 MB of entries) against XXH3-64 per entry (the scheme it replaced, kept here only as the
compared variant), interleaved.

    python -m benchmarks.snapshot_hash [--mb 64] [--entries 3000] [--rounds 9]

Entries are laid out as in a snapshot (1 KiB aligned): `--entries` of them, a few large expert slices and
many small ones, as a tiny-expert MoE has. Per variant it prints the hashing thread's CPU time and, the
figure that matters, how much slower a launch-bound thread runs beside it: a loop of tiny torch ops that
drops and re-takes the GIL at every op, as a training thread launching GPU kernels does (`main_slowdown`,
against the same loop alone, median of the rounds).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import torch

from moevement.storage.snapshot import BLOCK, Entry, checksum, entry_view
from moevement.storage.snapshot_copy import CopyPlan


def layout(total_mb: int, count: int, seed: int = 0) -> tuple[torch.Tensor, list[Entry]]:
    """`count` entries of about `total_mb` together: nine in ten small (4 B-16 KiB), the rest sharing the bulk."""
    rng = random.Random(seed)
    small = [rng.randint(4, 16 << 10) for _ in range(count - count // 10)]
    large = (total_mb << 20) // max(1, count // 10)
    sizes = small + [large] * (count // 10)
    rng.shuffle(sizes)
    entries, offset = [], 0
    for i, nbytes in enumerate(sizes):
        entries.append(Entry("op", f"t{i}", "master", "uint8", [nbytes], offset, nbytes))
        offset += -(-nbytes // BLOCK) * BLOCK
    buffer = torch.randint(0, 256, (offset,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return buffer, entries


def per_entry(buffer: torch.Tensor, entries: list[Entry], _plan: CopyPlan) -> None:
    whole = memoryview(buffer.numpy())
    for e in entries:
        checksum(whole[e.offset : e.offset + e.nbytes])


def per_chunk(_buffer: torch.Tensor, _entries: list[Entry], plan: CopyPlan) -> None:
    for group in plan.groups:
        checksum(group.raw)


def launch_bound_ms(ops: int) -> float:
    """Wall milliseconds of `ops` tiny torch ops (each releases and re-takes the GIL)."""
    x = torch.zeros(4)
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1)
    return (time.perf_counter() - start) * 1e3


def beside(hash_fn, args, ops: int) -> tuple[float, float]:
    """(the launch-bound loop's ms, the hashing thread's CPU ms) with the snapshot hashed, repeatedly, beside
    the loop until it ends."""
    done, cpu = threading.Event(), []

    def hasher():
        start = time.thread_time()
        while not done.is_set():
            hash_fn(*args)
        cpu.append((time.thread_time() - start) * 1e3)

    thread = threading.Thread(target=hasher)
    thread.start()
    ms = launch_bound_ms(ops)
    done.set()
    thread.join()
    return ms, cpu[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=64, help="snapshot size")
    parser.add_argument("--entries", type=int, default=3000)
    parser.add_argument("--ops", type=int, default=20000, help="tiny ops of the launch-bound loop")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    buffer, entries = layout(args.mb, args.entries)
    plan = CopyPlan.of(buffer, entries, [entry_view(buffer, e) for e in entries])
    variants = {"per_entry": per_entry, "per_chunk": per_chunk}
    alone: list[float] = []
    slowdown: dict[str, list[float]] = {name: [] for name in variants}
    hash_ms: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        alone.append(launch_bound_ms(args.ops))
        for name, fn in variants.items():
            start = time.thread_time()
            fn(buffer, entries, plan)
            hash_ms[name].append((time.thread_time() - start) * 1e3)
            ms, _ = beside(fn, (buffer, entries, plan), args.ops)
            slowdown[name].append(ms / alone[-1] - 1)
    calls = {"per_entry": len(entries), "per_chunk": len(plan.groups)}
    print(f"snapshot mb={buffer.numel() / 1e6:.1f} entries={len(entries)} chunks={len(plan.groups)}")
    for name in variants:
        s = slowdown[name]
        print(
            f"hash={name} calls={calls[name]} cpu_ms={statistics.median(hash_ms[name]):.2f} "
            f"main_slowdown={statistics.median(s):.3f} (min {min(s):.3f}, max {max(s):.3f})"
        )


if __name__ == "__main__":
    main()
