"""The one model on a run measured on this machine: the ETTR benchmark's `predicted_ettr` column, our own Table 4
and our own Figure 13.

`python -m benchmarks.ettr` writes `<out>/ettr.csv`, one row per strategy and seed, with what it measured
(`COLUMNS`): the strategy's ETTR and overhead, and the run's own costs. Each row gets two numbers:

- `predict`: the trainer's mechanism of a failure on the run's measured costs. Measured: T (the mean of the
  two references bracketing the strategy), the useful time (those references' wall time for the same
  iterations), the overhead (first executions against T), the warm-up (start-up beyond the references'),
  each failure's restart (detection to training going on, its fetch apart) and fetch seconds, the seconds
  of one replayed (MoEvement) or recomputed (baselines) iteration, and the window W or interval k in effect
  at the failures. Predicted: how many iterations a failure costs, in expectation over where it strikes
  (`expected_replay`): MoEvement rolls the failed stage back to the start of the newest complete window
  and replays W conversion iterations and the catch-up to the failed iteration, W to 2W - 1 iterations,
  (3W - 1) / 2 on average (a rolling window, every iteration completing one: W); a baseline rolls every
  stage back to its newest checkpoint, taken every k iterations, and recomputes (k + 1) / 2; a real death
  also loses the iteration it interrupts (T / 2 on average; an in-place wipe strikes at an iteration
  boundary and loses none). A benchmark injects a fixed number of failures, so the failure law is
  `simulator.run.scheduled_ettr` (wall = useful (1 + o) + F R, the warm-up beside it).
  A row that left a cost unrecorded (a record transcribed from docs/benchmarks.md) falls back on the
  model (`model_replay_iteration_s`, `baseline_interval`): W from Algorithm 1 at the cap on equal
  operators, Gemini's k from the oracle at the run's MTBF, MoC's k of 1, a replayed iteration of one
  stage's share of T without the bubble (T after a global rollback; frozen operators skipping their weight
  gradient in the conversion), a recomputed one of T; `unrecorded` names what it left empty.
  Figure 13's steps are `benchmarks.ettr` variants of moevement (`ablation_of`).
- `replayed`: the same failure law on the run's measured overhead and loss per failure (it checks the law
  and the accounting, not the mechanism; `simulator.calibration` is the same on `profile.json`).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, fields
from pathlib import Path

from moevement.checkpoint.schedule import find_window_size
from simulator.frozen import Ablation, frozen_fractions
from simulator.mechanisms import Cost, moevement_recovery_s, overlapped_stall_s
from simulator.oracle import oracle_interval
from simulator.run import scheduled_ettr
from simulator.setting import Operator

# The committed measurements `--paper-tables` reads unless `--measured CSV` names newer ones: the ETTR
# benchmark's strategies (our own Table 4) and Figure 13's four steps as its variants (our own Figure 13).
RECORDED_CSV = Path(__file__).with_name("measurements") / "bench_moe_fbc45b1.csv"
RECORDED_ABLATION_CSV = Path(__file__).with_name("measurements") / "ablation_bench_moe_8c3d74d.csv"
OPERATORS = 64  # Algorithm 1 on equal operators: the window depends on the byte ratio only
INTERRUPTED = {"kill": 0.5, "wipe": 0.0}  # of an iteration, what a failure interrupts on average


@dataclass(frozen=True)
class MeasuredRun:
    """One strategy's row of ettr.csv (seconds are totals over the run)."""

    run: str  # which invocation (a label: seed, pp)
    strategy: str
    ettr: float
    failures: int
    iterations: int
    reference_s: float  # T: the bracketing fault-free references' mean iteration time
    mtbf_iters: float
    pp: int
    micro_batches: int
    dense_snapshot_iters: float  # the cap: a dense snapshot of a stage takes this many iterations
    restart_s: float = 0.0  # detection, relaunch and resume (recovery lines less their fetch/convert/catch-up)
    fetch_s: float = 0.0
    replay_s: float = 0.0  # seconds of the replayed (convert + catch-up) or recomputed iterations
    replayed: int = 0  # iterations replayed (MoEvement) or recomputed (the baselines)
    recovery_per_failure_s: float = 0.0  # measured loss per failure (recovery + recomputation); required
    warmup_s: float = 0.0  # the first iterations beyond the references' own: the failure-independent loss
    expert_share: float = 0.0  # routed experts' share of the parameters (MoC)
    experts: int = 1  # routed experts per MoE layer
    moc_experts: int = 1  # MoC's first K
    overhead: float = 0.0  # measured (first executions against T)
    useful_s: float = 0.0  # the references' wall time for these iterations (0: iterations x T)
    window: float = 0.0  # MoEvement's W at the failures, their mean (0: not recorded)
    interval: float = 0.0  # a baseline's checkpoint interval k at the failures, their mean (0: not recorded)
    rolling: int = 0  # 1: every iteration completes a window of the last W (a failure replays W)
    fault_mode: str = "kill"  # kill: real deaths at a random phase | wipe: in place, at an iteration boundary
    missing: tuple[str, ...] = ()  # costs the row left empty

    @property
    def useful(self) -> float:
        """Seconds the fault-free references need for the same iterations."""
        return self.useful_s or self.iterations * self.reference_s


COLUMNS = [f.name for f in fields(MeasuredRun) if f.name != "missing"]
REQUIRED = ("strategy", "ettr", "failures", "iterations", "reference_s", "mtbf_iters", "pp", "micro_batches")
REQUIRED += ("dense_snapshot_iters", "recovery_per_failure_s")
RECORDED_COSTS = ("restart_s", "fetch_s", "warmup_s", "replay_s", "replayed", "window", "interval")


def from_row(row: dict, run: str = "") -> MeasuredRun:
    """A `MeasuredRun` from one ettr.csv row (strings or numbers; ValueError naming a missing column)."""
    types, values, missing = {f.name: f.type for f in fields(MeasuredRun)}, {}, []
    for name in COLUMNS:
        raw = row.get(name)
        if name == "run":
            values[name] = str(raw or run)
        elif (raw is None or raw == "") and name in REQUIRED:
            raise ValueError(f"measured run: missing column {name!r}")
        elif raw is None or raw == "":
            missing += [name] if name in RECORDED_COSTS else []
        else:
            kind = types[name]
            values[name] = str(raw) if kind == "str" else (int(float(raw)) if kind == "int" else float(raw))
    return MeasuredRun(**values, missing=tuple(missing))


def read_csv(path: str | Path) -> list[MeasuredRun]:
    """Every strategy row of an ettr.csv but the `none` reference (ValueError naming a missing column)."""
    with open(path, newline="") as f:
        return [from_row(row, Path(path).stem) for row in csv.DictReader(f) if row.get("strategy") != "none"]


def window_at_cap(dense_snapshot_iters: float) -> int:
    """Algorithm 1 (the trainer's `find_window_size`) on equal operators when a dense (12 B/param) snapshot
    takes `dense_snapshot_iters` iterations at the cap."""
    return _window(dense_snapshot_iters)[0]


def _window(dense_snapshot_iters: float) -> tuple[int, int]:
    fp32, compute = [12.0] * OPERATORS, [2.0] * OPERATORS
    return find_window_size(fp32, compute, 1.0, sum(fp32) / dense_snapshot_iters)


def ablation_of(strategy: str) -> tuple[str, Ablation]:
    """The strategy of a benchmark variant (`moevement@fault.scope=global@...`, `benchmarks.variants`) and the
    Figure 13 techniques it keeps: `fault.scope=global` drops upstream logging (every stage rolls back after a
    global restart), `fault.frozen_weight_grad=true` drops skipping frozen weight gradients,
    `checkpoint.ordering=fixed` drops popularity order."""
    base, *settings = strategy.split("@")
    flags = dict(setting.partition("=")[::2] for setting in settings)
    return base, Ablation(
        skip_bweight=flags.get("fault.frozen_weight_grad", "false") != "true",
        reorder=flags.get("checkpoint.ordering", "count") != "fixed",
        localized=flags.get("fault.scope", "local") != "global",
    )


def expected_replay(strategy: str, period: float, rolling: bool = False) -> float:
    """Iterations a failure replays or recomputes under the trainer's mechanism, in expectation over where it
    strikes: MoEvement (`period` W) from the newest complete window's start, (3W - 1) / 2 (a rolling window:
    W); a baseline (`period` k) from its newest checkpoint, (k + 1) / 2."""
    if strategy == "moevement":
        return period if rolling else (3 * period - 1) / 2
    return (period + 1) / 2


def model_replay_iteration_s(r: MeasuredRun, ablation: Ablation, window: int) -> float:
    """The model of one replayed iteration where the run recorded none: the trainer's failed stage replays
    alone from its neighbours' logs, one stage's share of T without the pipeline bubble, T M / (M + S - 1)
    (every stage after a global rollback: T); frozen operators (equal operators in Algorithm 1's slots at
    the cap) skip 1/3 in the conversion unless ablated."""
    stage = r.reference_s * r.micro_batches / (r.micro_batches + r.pp - 1)
    t = stage if ablation.localized else r.reference_s
    _, per_slot = _window(r.dense_snapshot_iters)
    ops = [Operator(12.0, 2.0, 1.0)] * OPERATORS
    slots = [range(i * per_slot, min(OPERATORS, (i + 1) * per_slot)) for i in range(window)]
    frozen = frozen_fractions(ops, slots) if ablation.skip_bweight else [0.0] * window
    replay = moevement_recovery_s(0.0, 0.0, frozen, t, t) - t / 2  # conversion + catch-up alone
    return replay / expected_replay("moevement", window)


def unrecorded(r: MeasuredRun) -> list[str]:
    """The costs `predicted_cost` reads that `r` left empty (and so took from the model)."""
    other = "interval" if ablation_of(r.strategy)[0] == "moevement" else "window"
    return [name for name in r.missing if name != other]


def replay_iteration_s(r: MeasuredRun) -> float | None:
    """Measured seconds of one replayed or recomputed iteration (None: the row recorded none)."""
    return r.replay_s / r.replayed if r.replayed > 0 and "replay_s" not in r.missing else None


def baseline_interval(r: MeasuredRun, strategy: str) -> float | None:
    """A baseline's interval k: measured, else its policy's (Gemini's oracle on the copy at the cap, MoC's
    every iteration; None for CheckFreq, whose persist to storage is not measured)."""
    if r.interval > 0:
        return r.interval
    if strategy == "gemini":
        t, n = r.reference_s, max(1, r.failures)
        stall = overlapped_stall_s(r.dense_snapshot_iters * t, t)
        return oracle_interval(stall, t, (r.restart_s + r.fetch_s) / n, r.mtbf_iters * t)
    return 1 if strategy == "moc" else None


def predicted_cost(r: MeasuredRun) -> Cost | None:
    """The cost of `r`'s strategy per failure under the trainer's mechanism, on the run's measured costs
    (None: a strategy the model does not know, or CheckFreq without a recorded interval)."""
    t, n = r.reference_s, max(1, r.failures)
    fixed = (r.restart_s + r.fetch_s) / n + INTERRUPTED.get(r.fault_mode, 0.5) * t
    strategy, ablation = ablation_of(r.strategy)
    if strategy == "moevement":
        window = r.window or window_at_cap(r.dense_snapshot_iters)
        per_iteration = replay_iteration_s(r) or model_replay_iteration_s(r, ablation, round(window))
        replays = expected_replay(strategy, window, bool(r.rolling))
        cost = Cost(strategy, r.overhead, fixed + replays * per_iteration, window=round(window))
    elif strategy in ("gemini", "checkfreq", "moc") and (k := baseline_interval(r, strategy)) is not None:
        per_iteration = replay_iteration_s(r) or t
        cost = Cost(strategy, r.overhead, fixed + expected_replay(strategy, k) * per_iteration, interval=round(k))
    else:
        return None
    return _with_warmup(cost, r)


def _with_warmup(cost: Cost, r: MeasuredRun) -> Cost:
    """The measured warm-up as the failure-independent loss: (1 - z) useful / wall = useful / (wall + warm-up)
    (a negative warm-up is the references' drift, not a gain: 0)."""
    wall, warmup = r.useful * (1 + cost.overhead) + r.failures * cost.recovery_s, max(0.0, r.warmup_s)
    z = warmup / (wall + warmup) if wall + warmup > 0 else 0.0
    return Cost(cost.strategy, cost.overhead, cost.recovery_s, cost.interval, cost.window, cost.stall_s, z)


def predict(r: MeasuredRun) -> float | None:
    """The model's ETTR of `r` (None where `predicted_cost` has none)."""
    cost = predicted_cost(r)
    return None if cost is None else scheduled_ettr(cost, r.failures, r.useful)


def replayed(r: MeasuredRun) -> float:
    """The failure law on the measured overhead and loss per failure."""
    cost = Cost(r.strategy, r.overhead, r.recovery_per_failure_s)
    return scheduled_ettr(cost, r.failures, r.useful)
