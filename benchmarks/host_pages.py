"""What a snapshot buffer costs to map: fresh shared-memory pages against pages an earlier process left.

    python -m benchmarks.host_pages [--mb 500] [--rounds 5] [--dir /dev/shm]

Four variants of `HostBuffer.ensure` for one buffer of `--mb` megabytes, interleaved over the rounds:
  fresh     a new file: the kernel allocates and zeroes every page (what a first window pays)
  reuse     the file an earlier process left, mapped with MAP_POPULATE (what `HostBuffer.ensure` does now)
  touch     the same file mapped lazily and touched page by page (what it did before: one fault per page)
  watched   that file after a warm standby's watch mapped it (`PrefaultWatch`, untimed): what a replacement's
            checkpointer pays for a buffer the dead trainer left
Prints each variant's median and minimum wall seconds and CPU seconds, and the ratios to `fresh`.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moevement.storage.host_memory import HostBuffer
from moevement.storage.prefault_watch import PrefaultWatch
from moevement.storage.private_files import make_private_dir


def fresh(directory: Path, nbytes: int) -> None:
    path = directory / "fresh"
    path.with_suffix(".bin").unlink(missing_ok=True)
    HostBuffer(path).ensure(nbytes)


def reuse(directory: Path, nbytes: int) -> None:
    HostBuffer(directory / "kept").ensure(nbytes)


def touch(directory: Path, nbytes: int) -> None:
    fd = os.open(directory / "kept.bin", os.O_RDWR)
    try:
        data = torch.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), dtype=torch.uint8)
    finally:
        os.close(fd)
    data.zero_()


def watched(directory: Path, nbytes: int) -> None:
    HostBuffer(directory / "standby" / "kept").ensure(nbytes)


def watch(directory: Path) -> None:
    """A standby's watch of `directory / "standby"` (its own copy of the earlier process's buffer), one look."""
    standby = PrefaultWatch(directory / "standby", "normal", every_s=3600)
    while standby.looks == 0:
        time.sleep(0.001)
    standby.stop()


VARIANTS = {"fresh": fresh, "reuse": reuse, "touch": touch, "watched": watched}
UNTIMED = {"watched": watch}  # what happens before the variant, off its clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = parser.parse_args()
    nbytes = args.mb << 20
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = make_private_dir(Path(tmp) / "pages")
        for name in ("kept", "standby/kept"):  # the earlier process's buffer
            make_private_dir(directory / Path(name).parent)
            HostBuffer(directory / name).ensure(nbytes)
        wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
        cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, variant in VARIANTS.items():
                if name in UNTIMED:
                    UNTIMED[name](directory)
                started, cpu_started = time.perf_counter(), time.process_time()
                variant(directory, nbytes)
                wall[name].append(time.perf_counter() - started)
                cpu[name].append(time.process_time() - cpu_started)
    base = statistics.median(wall["fresh"])
    for name in VARIANTS:
        median = statistics.median(wall[name])
        print(
            f"variant={name} mb={args.mb} wall_s={median:.4f} min={min(wall[name]):.4f} "
            f"cpu_s={statistics.median(cpu[name]):.4f} ratio_to_fresh={median / base:.3f}"
        )


if __name__ == "__main__":
    main()
