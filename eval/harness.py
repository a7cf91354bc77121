"""Score a checkpoint saved by train.py on lm-eval tasks.

    python -m eval.harness --checkpoint DIR [--tasks piqa_local,hellaswag_local] [--limit N]
        [--hellaswag-file FILE] [--piqa-dir DIR] [--batch-size B] [--output FILE]
        [--config TOML] [--tokenizer SPEC] [--device cpu]
    torchrun --nproc_per_node N -m eval.harness --checkpoint DIR ...   # documents split across ranks (gloo)

The tasks are the lm-eval task files of ``eval/lm_eval_tasks/`` (what ``lm_eval --include_path
eval/lm_eval_tasks`` loads), over local data only. Prints one line per task, ``task=<t> acc=<x>
acc_norm=<x> n=<items>``, and writes lm-eval's results JSON to ``--output`` (default: a new folder
``outputs/eval/<checkpoint name>/<UTC timestamp>/eval_results.json`` under the current directory; never
inside the checkpoint, which ``--checkpoint.save_final`` refuses to overwrite once it holds anything
else). A bad checkpoint or task name is one line ``error: ...`` on
stderr and exit status 2; a task whose data is missing is one such line, the other tasks still run
and print, and the exit status is 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Progress bars only on an interactive terminal: lm-eval's own bars (building requests) read this when tqdm
# is first imported, which is below.
if not sys.stderr.isatty():
    os.environ.setdefault("TQDM_DISABLE", "1")
# Every task's data is local: no hub look-ups (read when datasets and huggingface_hub are first imported).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eval.errors import EvalError  # noqa: E402
from eval.tasks import TASKS, parse_task_names  # noqa: E402
from trainer.atomic_write import write_atomically  # noqa: E402

RESULTS_FILE = "eval_results.json"
EVAL_OUTPUTS = Path("outputs") / "eval"  # the default --output's root, under the current directory


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m eval.harness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", required=True, help="directory written by train.py --checkpoint.save_final")
    p.add_argument(
        "--tasks", default="piqa_local", help=f"comma-separated, from: {', '.join(TASKS)} (default: piqa_local)"
    )
    p.add_argument("--limit", type=int, default=None, help="score only the first N items of each task")
    p.add_argument(
        "--hellaswag-file",
        default=None,
        help="hellaswag_local's JSONL in the original HellaSwag format (default: $MOEVEMENT_HELLASWAG_FILE)",
    )
    p.add_argument(
        "--piqa-dir",
        default=None,
        help="piqa_local's directory with valid.jsonl + valid-labels.lst "
        "(default: $MOEVEMENT_PIQA_DIR, else ../shared/data/piqa)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="windows per forward pass (default: 32)")
    p.add_argument(
        "--output",
        default=None,
        help=f"results JSON (default: {EVAL_OUTPUTS}/<checkpoint name>/<UTC timestamp>/{RESULTS_FILE} under the "
        "current directory, never inside the checkpoint)",
    )
    p.add_argument("--config", default=None, help="training TOML: checks the model shape, picks data.tokenizer")
    p.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer.json (default: config, else byte)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    return p.parse_args(argv)


def _check_args(args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1:
        raise EvalError(f"--batch-size must be >= 1, got {args.batch_size}")
    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():  # fail before importing lm-eval and reading task data
        raise EvalError(
            f"checkpoint {args.checkpoint!r}: " + ("not a directory" if checkpoint.exists() else "no such directory")
        )


def _init_distributed() -> tuple[int, int]:
    """(rank, world size); a gloo group when launched by torchrun with several processes."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shutdown_distributed(finished: bool) -> None:
    """Tear the group down; after a finished evaluation, only once every rank is done with it
    (a rank that destroys its gloo group while a peer still talks to it can abort)."""
    import torch.distributed as dist

    from parallelisms import collectives

    if dist.is_initialized():
        if finished:
            collectives.barrier()
        dist.destroy_process_group()


def task_line(task: str, results: dict[str, Any]) -> str:
    """``task=<t> acc=<x> acc_norm=<x> n=<int>`` from lm-eval's results dict."""
    metrics = results["results"][task]
    n = results.get("n-samples", {}).get(task, {}).get("effective")
    return f"task={task} acc={metrics['acc,none']:.4f} acc_norm={metrics['acc_norm,none']:.4f} n={n}"


def default_output(checkpoint: str) -> Path:
    """``outputs/eval/<checkpoint name>/<UTC timestamp>/eval_results.json`` under the current directory, in a
    folder made here (suffixed ``-1``, ``-2``, ... when another evaluation of that checkpoint took that second).
    Not in the checkpoint: ``--checkpoint.save_final`` to it would then be refused."""
    parent = EVAL_OUTPUTS / (Path(checkpoint).resolve().name or "checkpoint")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for n in range(1000):
            folder = parent / (stamp if n == 0 else f"{stamp}-{n}")
            try:
                folder.mkdir()
                return folder / RESULTS_FILE
            except FileExistsError:
                continue
    except OSError as e:
        raise EvalError(f"--output: cannot make a results folder under {str(parent)!r}: {e.strerror or e}") from None
    raise EvalError(f"--output: no free results folder for {stamp} under {str(parent)!r}")


def write_results(results: dict[str, Any], path: Path) -> None:
    """The results JSON at ``path`` (`write_atomically`); EvalError if it cannot be."""
    from lm_eval.utils import handle_non_serializable

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    except OSError as e:
        raise EvalError(f"--output: cannot write {str(path)!r}: {e.strerror or e}") from None


def run_tasks(
    lm, tasks: list, limit: int | None, batch_size: int, device: str, log_samples: bool = False
) -> dict[str, Any] | None:
    """lm-eval over our own task objects only (no indexing of lm-eval's bundled tasks)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        limit=limit,
        batch_size=batch_size,
        device=device,
        log_samples=log_samples,
        task_manager=TaskManager(include_defaults=False),
    )


def evaluate(args: argparse.Namespace, rank: int) -> dict[str, Any] | None:
    """Load tasks and checkpoint, run lm-eval on the tasks whose data loaded; the results on rank 0, None
    elsewhere or when no task loaded. A task that did not load is one ``error:`` line (rank 0) and is named
    in ``results["moevement"]["failed_tasks"]``."""
    import datasets

    from eval.model import MoEvementLM
    from eval.tasks import load_tasks

    datasets.disable_progress_bars()
    tasks, errors = load_tasks(parse_task_names(args.tasks), piqa_dir=args.piqa_dir, hellaswag_file=args.hellaswag_file)
    if rank == 0:
        for e in errors.values():
            print(f"error: {e}", file=sys.stderr, flush=True)
    if not tasks:
        return None
    lm = MoEvementLM(
        checkpoint=args.checkpoint,
        config=args.config,
        tokenizer=args.tokenizer,
        batch_size=args.batch_size,
        device=args.device,
    )
    started = time.perf_counter()
    results = run_tasks(lm, list(tasks.values()), args.limit, args.batch_size, args.device)
    wall = time.perf_counter() - started
    if rank != 0 or results is None:
        return None
    items = sum(int(results["n-samples"][t]["effective"]) for t in tasks)
    results["moevement"] = {
        "checkpoint": str(args.checkpoint),
        "eval_wall_s": wall,
        "items": items,
        "items_per_s": items / wall if wall > 0 else None,
        "failed_tasks": sorted(errors),
    }
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    """Rank 0: one line per scored task on stdout, the results JSON, a summary line on stderr."""
    output = Path(args.output) if args.output else default_output(args.checkpoint)
    for task in parse_task_names(args.tasks):
        if task in results["results"]:
            print(task_line(task, results), flush=True)
    write_results(results, output)
    info = results["moevement"]
    print(
        f"eval: {info['items']} items in {info['eval_wall_s']:.1f} s "
        f"({info['items_per_s']:.1f} items/s); results -> {output}",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank, finished = 0, False
    try:
        _check_args(args)
        rank, _ = _init_distributed()
        results = evaluate(args, rank)
        if results is not None:
            report(results, args)
        finished = True
        scored = results is not None and not results["moevement"]["failed_tasks"]
        return 0 if scored or rank != 0 else 2
    except EvalError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        _shutdown_distributed(finished)


if __name__ == "__main__":
    sys.exit(main())
