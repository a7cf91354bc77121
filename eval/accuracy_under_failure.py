"""Model quality under failures: does recovery change what the model learns? (Figure 12 / Table 5.)

    python -m eval.accuracy_under_failure --config train_configs/debug_moe.toml --steps N --fail-every K \
        [--pp 2] [--val-every V] [--strategies none,moevement,gemini,moc] [--fault-mode kill|wipe] \
        [--limit L] [--out outputs/accuracy] [--section.key value ...]

Trains the fault-free reference (`none`) and each strategy under torchrun with `--pp` pipeline
stages and the same failures: iterations K, 2K, ... < N, alternating ranks (K fails the last
rank, 2K the one before, ...). `--fault-mode kill` (the default): the rank SIGKILLs itself in the
backward pass of that iteration and torchrun restarts the job (`--fault.kill`); `wipe`: it loses its
state in place at the iteration boundary (`--fault.at`). Every run logs the validation loss every V iterations (default
K // 2) and saves its final dense checkpoint to `<out>/<strategy>/checkpoint`, which is scored on
PIQA in this process with the `eval` harness (`--limit` items, default all 1,838). It measures
whether a strategy's recovery leaves the training trajectory intact: MoEvement, Gemini and
CheckFreq restore the exact state (same final `state_digest`, same validation losses, same PIQA
per-item log-likelihoods as fault-free); MoC restores stale experts and loses tokens.

Writes `<out>/accuracy.md` (the table), `<out>/accuracy.json`, `<out>/val_loss.png`, and per
strategy `train.log`, `eval_results.json` and `piqa_loglikelihoods.json`; prints the table and
    strategy=<s> val_loss=<x> piqa_acc=<x> piqa_acc_norm=<x> digest_equal=<true|false>
Extra `--section.key value` arguments go to every training run (e.g. `--checkpoint.interval 2`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # PIQA is local: nothing may download
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eval.errors import EvalError  # noqa: E402
from trainer.config import ConfigError, load_config  # noqa: E402
from trainer.records.accounting_line import AccountingLine  # noqa: E402
from trainer.records.event_lines import FinalLine, ValidationLine  # noqa: E402
from trainer.records.event_log import run_events  # noqa: E402
from trainer.strategy_registry import STRATEGIES  # noqa: E402

OWNED = {
    "training.steps": "--steps",
    "training.val_every": "--val-every",
    "parallelism.pp": "--pp",
    "checkpoint.strategy": "--strategies",
    "checkpoint.save_final": "--out",
    "fault.at": "--fail-every",
    "fault.kill": "--fail-every",
    "checkpoint.host_dir": "(a temporary directory per run)",
    "checkpoint.persist_dir": "(one per run)",
}
QUIET = ["--metrics.tensorboard", "false", "--metrics.log_every", "1", "--metrics.progress", "false"]


class RunError(RuntimeError):
    """A bad argument or a failed run: printed as one ``error: ...`` line, exit status 2."""


def fault_schedule(steps: int, every: int, world: int) -> list[tuple[int, int]]:
    """``(iteration, rank)`` failures at every ``every``-th iteration before ``steps``, alternating
    ranks from the last: iteration K fails rank world-1, 2K rank world-2, ..., wrapping around."""
    if every < 1 or world < 1:
        raise RunError(f"--fail-every and the world size must be >= 1, got {every} and {world}")
    return [(t, (world - i) % world) for i, t in enumerate(range(every, steps, every), start=1)]


def fault_flag(schedule: list[tuple[int, int]]) -> str:
    """The ``--fault.at`` value of a schedule, e.g. ``5:1,10:0``."""
    return ",".join(f"{t}:{r}" for t, r in schedule)


def fault_flags(schedule: list[tuple[int, int]], mode: str) -> list[str]:
    """The training flags of a schedule: in-place wipes (``wipe``) or deaths in the backward pass (``kill``)."""
    if mode == "wipe":
        return ["--fault.at", fault_flag(schedule)]
    return ["--fault.kill", ",".join(f"{t}:{r}:backward" for t, r in schedule)]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m eval.accuracy_under_failure",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--config", required=True, help="training TOML")
    p.add_argument("--steps", type=int, required=True, help="iterations of every run")
    p.add_argument("--fail-every", type=int, required=True, help="a failure every K iterations (K, 2K, ... < steps)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default: 2)")
    p.add_argument("--val-every", type=int, default=0, help="validation interval (default: fail-every // 2)")
    p.add_argument("--strategies", default="none,moevement,gemini,moc", help="comma-separated; none always runs")
    p.add_argument("--fault-mode", choices=("kill", "wipe"), default="kill", help="real deaths (default) or wipes")
    p.add_argument("--limit", type=int, default=None, help="PIQA items (default: all 1,838)")
    p.add_argument("--out", default="outputs/accuracy", help="output directory (default: outputs/accuracy)")
    args, extra = p.parse_known_args(argv)
    args.val_every = args.val_every or max(1, args.fail_every // 2)
    return args, extra


def check_args(args: argparse.Namespace, extra: list[str]) -> tuple[list[str], list[tuple[int, int]]]:
    """Strategies (``none`` first) and the failure schedule; the config is validated with the faults."""
    strategies = ["none"] + [s for s in dict.fromkeys(args.strategies.split(",")) if s and s != "none"]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise RunError(f"--strategies: unknown {', '.join(bad)} (allowed: {', '.join(STRATEGIES)})")
    if args.steps < 2 or args.val_every < 1 or (args.limit is not None and args.limit < 1):
        raise RunError("--steps must be >= 2, --val-every and --limit >= 1")
    for arg in extra:
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if key in OWNED:
            raise RunError(f"--{key} is set by this tool: use {OWNED[key]}")
    try:
        cfg = load_config(args.config, [*extra, "--parallelism.pp", str(args.pp), "--training.steps", str(args.steps)])
        args.world = cfg.parallelism.pp * cfg.parallelism.dp
        schedule = fault_schedule(args.steps, args.fail_every, args.world)
        if not schedule:
            raise RunError(f"--fail-every {args.fail_every} leaves no failure before --steps {args.steps}")
        load_config(
            args.config,
            [
                *extra,
                "--parallelism.pp",
                str(args.pp),
                "--training.steps",
                str(args.steps),
                "--checkpoint.strategy",
                "moevement",
                *fault_flags(schedule, args.fault_mode),
            ],
        )
    except ConfigError as e:
        raise RunError(str(e)) from None
    return strategies, schedule


def train(args: argparse.Namespace, strategy: str, extra: list[str], schedule: list, run_dir: Path) -> str:
    """One torchrun training run; its stdout (the whole log also goes to ``run_dir/train.log``)."""
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    shm = tempfile.mkdtemp(prefix="moev-acc-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.world}",
        f"--max-restarts={len(schedule) if args.fault_mode == 'kill' and strategy != 'none' else 0}",
        "train.py",
        "--config",
        str(Path(args.config).resolve()),
        *QUIET,
        *extra,
        "--parallelism.pp",
        str(args.pp),
        "--training.steps",
        str(args.steps),
        "--training.val_every",
        str(args.val_every),
        "--checkpoint.strategy",
        strategy,
        "--checkpoint.save_final",
        str(run_dir / "checkpoint"),
        "--job.output_dir",
        str(run_dir),  # the run's record: <run_dir>/<job.name>/<timestamp>/
    ]
    if strategy != "none":
        cmd += ["--checkpoint.host_dir", f"{shm}/host", "--checkpoint.persist_dir", f"{shm}/disk"]
        cmd += fault_flags(schedule, args.fault_mode)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    (run_dir / "train.log").write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    if proc.returncode != 0:
        tail = proc.stderr[proc.stderr.find("Traceback") :] if "Traceback" in proc.stderr else proc.stderr
        raise RunError(
            f"{strategy} run failed (exit {proc.returncode}; log {run_dir / 'train.log'}):\n"
            f"{proc.stdout[-1500:]}{tail[-2500:]}"
        )
    return proc.stdout


def parse_training(stdout: str, strategy: str) -> dict:
    """Final loss and digest, validation losses (the last record per step: after any rollback) and the
    accounting, from the run's records (the run folder its `run: <dir>` line names)."""
    events = run_events(stdout)
    finals = [e for e in events if isinstance(e, FinalLine)]
    acct = [e for e in events if isinstance(e, AccountingLine)]
    if not finals or not acct:
        raise RunError(f"{strategy}: no 'final' or 'accounting' record of the training run")
    val = {e.step: e.val_loss for e in events if isinstance(e, ValidationLine)}
    if not val:
        raise RunError(f"{strategy}: no validation line (does the config have a validation split?)")
    return {
        "final_step": finals[-1].step,
        "train_loss": finals[-1].loss,
        "digest": finals[-1].state_digest,
        "val": val,
        "failures": acct[-1].failures,
        "lost_tokens": acct[-1].lost_tokens,
    }


def score_piqa(checkpoint: Path, config: str, limit: int | None, out_dir: Path) -> dict:
    """PIQA acc / acc_norm of a checkpoint (eval harness pieces, in process) and per-item log-likelihoods."""
    import datasets

    from eval.harness import run_tasks, write_results
    from eval.model import MoEvementLM
    from eval.tasks import load_tasks

    datasets.disable_progress_bars()
    tasks, errors = load_tasks(["piqa_local"])
    if errors:
        raise errors["piqa_local"]
    lm = MoEvementLM(checkpoint=str(checkpoint), config=config, batch_size=32)
    results = run_tasks(lm, [tasks["piqa_local"]], limit, 32, "cpu", log_samples=True)
    samples = sorted(results.pop("samples")["piqa_local"], key=lambda s: s["doc_id"])
    lls = [[float(ll) for ll, _ in s["filtered_resps"]] for s in samples]
    write_results(results, out_dir / "eval_results.json")
    (out_dir / "piqa_loglikelihoods.json").write_text(json.dumps(lls))
    metrics = results["results"]["piqa_local"]
    return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"], "items": len(lls), "lls": lls}


def markdown_table(rows: dict[str, dict], val_step: int) -> str:
    head = [
        "strategy",
        "failures",
        "final train loss",
        f"val loss (step {val_step})",
        "PIQA acc",
        "PIQA acc_norm",
        "digest = fault-free",
        "PIQA log-likelihoods = fault-free",
        "lost tokens",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s, r in rows.items():
        cells = [
            s,
            r["failures"],
            f"{r['train_loss']:.6f}",
            f"{r['val'][val_step]:.6f}",
            f"{r['acc']:.4f}",
            f"{r['acc_norm']:.4f}",
            "yes" if r["digest_equal"] else "no",
            "yes" if r["lls_differ"] == 0 else f"no ({r['lls_differ']}/{r['items']} items differ)",
            r["lost_tokens"],
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def plot(path: Path, rows: dict[str, dict], schedule: list[tuple[int, int]]) -> None:
    """Validation loss vs iteration (top) and its difference from fault-free (bottom); failures dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simulator.colours import colour

    fig, (ax, diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[2, 1])
    ref = rows["none"]["val"]
    for i, (s, r) in enumerate(rows.items()):
        steps = sorted(r["val"])
        style = {"lw": 2.5, "alpha": 0.5} if s == "none" else {"ls": "--", "marker": "ox+s^"[i % 5], "ms": 5}
        style["color"] = colour(s)
        ax.plot(steps, [r["val"][t] for t in steps], label=s, **style)
        diff.plot(steps, [r["val"][t] - ref[t] for t in steps], label=s, **style)
    for n, (t, rank) in enumerate(schedule):
        for a in (ax, diff):
            a.axvline(t, color="grey", ls=":", lw=1, label="failure" if n == 0 and a is ax else None)
        ax.annotate(
            f"rank {rank}",
            (t, 1),
            xycoords=("data", "axes fraction"),
            xytext=(2, -2),
            textcoords="offset points",
            fontsize=7,
            ha="left",
            va="top",
        )
    ax.set(ylabel="validation loss", title="Validation loss under failures")
    diff.set(xlabel="iteration", ylabel="minus fault-free")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_all(args: argparse.Namespace, extra: list[str], strategies: list[str], schedule) -> dict[str, dict]:
    out, faults, rows = Path(args.out), fault_flag(schedule), {}
    for i, s in enumerate(strategies, start=1):
        tag = f"[{i}/{len(strategies)}] {s}"
        print(
            f"{tag}: training {args.steps} iterations, pp={args.pp}"
            + ("" if s == "none" else f", failures {faults} ({args.fault_mode})")
            + " ...",
            flush=True,
        )
        started = time.perf_counter()
        r = parse_training(train(args, s, extra, schedule, out / s), s)
        print(
            f"{tag}: trained in {time.perf_counter() - started:.1f} s (loss={r['train_loss']:.6f}, "
            f"failures={r['failures']}); scoring PIQA ...",
            flush=True,
        )
        started = time.perf_counter()
        r.update(score_piqa(out / s / "checkpoint", args.config, args.limit, out / s))
        print(
            f"{tag}: PIQA {r['items']} items in {time.perf_counter() - started:.1f} s "
            f"(acc={r['acc']:.4f} acc_norm={r['acc_norm']:.4f})",
            flush=True,
        )
        ref = rows.get("none", r)
        r["digest_equal"] = r["digest"] == ref["digest"]
        r["lls_differ"] = sum(a != b for a, b in zip(r["lls"], ref["lls"]))
        rows[s] = r
    return rows


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        strategies, schedule = check_args(args, extra)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = run_all(args, extra, strategies, schedule)
    except (RunError, EvalError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    val_step = max(rows["none"]["val"])
    table = markdown_table(rows, val_step)
    (out / "accuracy.md").write_text(
        f"Failures (iteration:rank, {args.fault_mode}): {fault_flag(schedule)}; {args.steps} iterations, "
        f"pp={args.pp}, config {args.config}, extra {' '.join(extra) or '-'}\n\n{table}"
    )
    summary = {s: {k: v for k, v in r.items() if k != "lls"} for s, r in rows.items()}
    (out / "accuracy.json").write_text(json.dumps({"schedule": schedule, "rows": summary}, indent=1))
    plot(out / "val_loss.png", rows, schedule)
    print(table, end="")
    for s, r in rows.items():
        print(
            f"strategy={s} val_loss={r['val'][val_step]:.6f} piqa_acc={r['acc']:.4f} "
            f"piqa_acc_norm={r['acc_norm']:.4f} digest_equal={str(r['digest_equal']).lower()}"
        )
    print(f"wrote {out / 'accuracy.md'}, {out / 'accuracy.json'}, {out / 'val_loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
