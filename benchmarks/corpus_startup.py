"""Start-up of the data pipeline: a prepared, memory-mapped corpus against the in-memory path.

    python -m benchmarks.corpus_startup [--gb 1.0] [--memory-gb 1.0] [--rounds 3] [--dir /tmp]

Writes `--gb` GB of synthetic text (lines of random letters, WikiText-style article headings) into a
temporary directory under `--dir`, prepares it once with `python -m trainer.data.prepare` (byte
tokenizer: one token per byte) and times, in fresh processes as a start or a restart runs it, what
`train.py` pays until its first batch is available: `build_data` plus `local_batch(1)`. Two variants,
interleaved over the rounds:
  prepared    `data.dataset` = the prepared directory (shards memory-mapped)
  in_memory   `data.dataset` = the text file, read, tokenized and packed in memory: the first
              `--memory-gb` GB of the same text; by default all of it when its peak (about 11 bytes of
              memory per byte of text) fits in half of this machine's available memory, else the largest
              prefix that does
Prints the preparation's time, each variant's median and minimum seconds and peak RSS, and the ratio
in_memory/prepared. The temporary directory is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LINE = 100  # bytes per synthetic line, newline included
HEADING_EVERY = 400  # lines per synthetic article
BLOCK_LINES = 1 << 19  # lines generated at once (52 MB)
IN_MEMORY_BYTES_PER_BYTE = 11  # the in-memory path's peak added RSS per byte of text (measured: 10.5)


def affordable_bytes() -> int:
    """Text the in-memory path can read within half of MemAvailable (the machine is shared)."""
    with open("/proc/meminfo") as f:
        avail_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return avail_kb * 1024 // 2 // IN_MEMORY_BYTES_PER_BYTE


def write_text(path: Path, nbytes: int, seed: int = 0) -> None:
    """``nbytes`` (rounded down to whole lines) of lowercase words, one article heading every HEADING_EVERY lines."""
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    heading = np.frombuffer(b" = Article = ".ljust(LINE - 1), dtype=np.uint8)
    lines_left = nbytes // LINE
    with open(path, "wb") as f:
        while lines_left:
            n = min(BLOCK_LINES, lines_left)
            block = alphabet[rng.integers(0, len(alphabet), size=(n, LINE), dtype=np.uint8)]
            block[::HEADING_EVERY, : LINE - 1] = heading
            block[:, -1] = ord("\n")
            f.write(block.tobytes())
            lines_left -= n


def copy_prefix(src: Path, dst: Path, nbytes: int) -> None:
    with open(src, "rb") as f, open(dst, "wb") as g:
        while nbytes:
            chunk = f.read(min(nbytes, 1 << 24))
            g.write(chunk)
            nbytes -= len(chunk)


def child(dataset: str) -> None:
    """One start-up: build the data and take the first batch; prints seconds and peak RSS as JSON."""
    from trainer.data.batches import build_data
    from trainer.data.corpus import DataConfig

    cfg = DataConfig(dataset=dataset, train_split="train", val_split="")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    _, train, _ = build_data(cfg, seq_len=1024, global_batch_size=8, micro_batches=1, seed=0)
    inputs, _ = train.local_batch(1, 0, 1)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "seconds": seconds,
                "tokens": train.num_tokens,
                "peak_rss_mb": peak / 1024,
                "added_rss_mb": (peak - rss_before) / 1024,
                "first": int(inputs[0, 0]),
            }
        )
    )


def run_child(dataset: Path) -> dict | None:
    """One start-up's figures; None when the kernel killed it (out of memory on a shared machine)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.corpus_startup", "--child", str(dataset)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode == -signal.SIGKILL:
        return None
    if proc.returncode:
        raise RuntimeError(f"start-up on {dataset} failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prepare(text_dir: Path, out: Path) -> float:
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "trainer.data.prepare", "--data.dataset", str(text_dir), "--out", str(out)]
    cmd += ["--data.train_split", "train", "--data.val_split", ""]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    return time.perf_counter() - started


def interleaved(variants: dict[str, Path], rounds: int) -> dict[str, list[dict]]:
    """Each variant's start-ups, alternating which goes first."""
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
            result = run_child(variants[name])
            if result is None:
                print(f"round={r} variant={name} killed by SIGKILL (out of memory?)", flush=True)
                continue
            runs[name].append(result)
            print(f"round={r} variant={name} seconds={result['seconds']:.4f}", flush=True)
    return runs


def report(runs: dict[str, list[dict]]) -> None:
    medians, tokens = {}, {}
    for name, rs in runs.items():
        secs = [x["seconds"] for x in rs]
        medians[name], tokens[name] = statistics.median(secs), rs[0]["tokens"]
        print(
            f"variant={name} tokens={tokens[name]} startup_s={medians[name]:.4f} min={min(secs):.4f} runs={len(rs)} "
            f"peak_rss_mb={max(x['peak_rss_mb'] for x in rs):.0f} added_rss_mb={max(x['added_rss_mb'] for x in rs):.0f}"
        )
    line = f"ratio in_memory/prepared={medians['in_memory'] / medians['prepared']:.1f}"
    if tokens["in_memory"] != tokens["prepared"]:
        scaled = medians["in_memory"] * tokens["prepared"] / tokens["in_memory"]
        line += f" (in_memory on {tokens['in_memory']} tokens; scaled linearly to {tokens['prepared']}: "
        line += f"{scaled / medians['prepared']:.1f})"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="GB of text (= tokens) prepared")
    parser.add_argument("--memory-gb", type=float, help="GB of the same text the in-memory path reads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    nbytes = int(args.gb * 1e9)
    memory_bytes = int(args.memory_gb * 1e9) if args.memory_gb else min(nbytes, affordable_bytes())
    if memory_bytes < nbytes:
        print(f"in_memory reads the first {memory_bytes / 1e9:.2f} GB of the text")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the temporary directory goes on a kill too
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="corpus-startup-") as tmp:
        full, part = Path(tmp) / "full", Path(tmp) / "part"
        full.mkdir()
        write_text(full / "train.txt", nbytes)
        if memory_bytes < nbytes:  # the first memory_bytes of the same text, cut at a line
            part.mkdir()
            copy_prefix(full / "train.txt", part / "train.txt", memory_bytes // LINE * LINE)
        prep_s = prepare(full, Path(tmp) / "prepared")
        print(f"prepare gb={nbytes / 1e9:.2f} seconds={prep_s:.1f} mb_per_s={nbytes / 1e6 / prep_s:.1f}", flush=True)
        variants = {"prepared": Path(tmp) / "prepared", "in_memory": part if memory_bytes < nbytes else full}
        runs = interleaved(variants, args.rounds)
    if not all(runs.values()):
        sys.exit("no start-up of some variant completed")
    report(runs)


if __name__ == "__main__":
    main()
