"""What committing a snapshot costs the training thread: the commit record rewritten in place where it repeats
the last one (`moevement.storage.commit_file.CommitFile`) against a fresh file per commit (`write_json_atomic`),
interleaved, in the host directory's file system.

    python -m benchmarks.commit_record [--entries 5704] [--commits 200] [--rounds 7] [--dir /dev/shm]

Each commit is a real snapshot header of `--entries` entries (the launch-bound `debug_moe` run has 5,704), its
layout's entries encoded once as the trainer does, the iteration's fields and `meta` new each time; before each
commit the record is retired, as a buffer is before its next copy. Prints per variant the median wall time of a
commit per round, and the in-place/fresh ratio with its spread over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from moevement.storage.commit_file import CommitFile
from moevement.storage.private_files import make_private_dir, write_json_atomic
from moevement.storage.snapshot import Entry, SnapshotHeader, encode_entries


def header(entries: list[Entry], iteration: int) -> SnapshotHeader:
    """A W=1 snapshot header of `entries` at `iteration`, with a checksum and a scalar log like the trainer's."""
    names = sorted({e.op for e in entries})
    meta = {"seed": 0, "data_position": iteration, "scalars": {"loss": 2.5 + iteration, "grad_norm": 0.75}}
    checksums = [[0, len(entries), "0" * 16]]
    return SnapshotHeader(iteration, iteration, 0, 1, 0, names, [], entries, 21_800_000, meta, checksums)


def layout(count: int) -> list[Entry]:
    """`count` entries named and shaped like a tiny-expert MoE's parameters and Adam state."""
    entries, offset = [], 0
    for i in range(count):
        layer, expert, kind = i // 700, (i // 10) % 64, ("param", "exp_avg", "exp_avg_sq")[i % 3]
        name = f"layers.{layer}.moe.experts.{expert}.w{i % 3 + 1}" + ("" if kind == "param" else f".{kind}")
        entries.append(Entry(f"layers.{layer}.moe.experts.{expert}", name, "master", "float32", [16, 64], offset, 4096))
        offset += 4096
    return entries


def run(commit: Callable[[tuple[bytes, ...]], None], retire: Callable[[], None], body: bytes, entries, n: int) -> float:
    """Median milliseconds of `n` commits (each after a retire), their records built as `in_flight.commit` does."""
    times = []
    for iteration in range(n):
        record = header(entries, iteration)
        prepared = record.encode_without_meta(body)
        retire()
        start = time.perf_counter()
        commit(prepared.with_meta(record.meta).parts)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=5704)
    parser.add_argument("--commits", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args(argv)
    entries = layout(args.entries)
    body = encode_entries(entries)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = make_private_dir(Path(tmp) / "local")
        in_place = CommitFile(directory / "a.json", directory / "a.spare")
        fresh = directory / "b.json"
        print(f"record {len(body) / 1e6:.2f} MB of entries, {args.entries} entries, in {args.dir}")
        ratios = []
        for r in range(args.rounds):
            a = run(in_place.write, in_place.retire, body, entries, args.commits)
            b = run(
                lambda parts: write_json_atomic(fresh, parts),
                lambda: fresh.unlink(missing_ok=True),
                body,
                entries,
                args.commits,
            )
            ratios.append(a / b)
            print(f"round={r} in_place_ms={a:.3f} fresh_ms={b:.3f} ratio={a / b:.3f}", flush=True)
        in_place.close()
    print(
        f"summary in_place/fresh={statistics.median(ratios):.3f} min={min(ratios):.3f} max={max(ratios):.3f} "
        f"rounds={args.rounds}"
    )


if __name__ == "__main__":
    main()
