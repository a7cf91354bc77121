"""The one model on a run measured on this machine: the ETTR benchmark's `simulator` column, our own Table 4
and our own Figure 13.

`python -m benchmarks.ettr` writes `<out>/ettr.csv`, one row per strategy, with what it measured (`COLUMNS`):
the strategy's ETTR and overhead, and the primitives the model needs. Each row gets two numbers:

- `predict`: the mechanisms `simulator.model` runs (`simulator.mechanisms`: the stall of a copy overlapped
  with an iteration, the oracle interval, Algorithm 1's window, MoEvement's and the periodic baselines'
  loss per failure), fed with the run's measured primitives where the paper's model has stated hardware
  and fitted constants: T (the mean of the two references bracketing the strategy), the snapshot cap (a
  dense snapshot of a stage takes `dense_snapshot_iters` iterations), each failure's restart and fetch
  seconds (they replace `restart_s`, `rejoin_s` and the bulk-read bandwidth, which describe the paper's
  cluster), the measured warm-up (the failure-independent loss). Predicted, not measured: the overhead
  (W from Algorithm 1 at the cap, so MoEvement never stalls; Gemini's dense copy at the cap, every k
  iterations from the oracle at the run's MTBF; MoC's copy of its non-expert state and first K), each
  failure's replayed or recomputed iterations (their expected number, not the drawn one) and their
  seconds (MoEvement's: one stage's share of T without the bubble, or T after a global rollback, frozen
  operators skipping 1/3; the recorded `replay_s` and `replayed` are not read).
  Figure 13's steps are `benchmarks.ettr` variants of moevement (`ablation_of`). A benchmark
  injects a fixed number of failures, so the failure law is `simulator.run.scheduled_ettr`. CheckFreq is
  not predicted: its persist bandwidth to storage is not measured.
- `replayed`: the same failure law on the run's measured overhead and loss per failure (it checks the
  law and the accounting, not the mechanisms; `simulator.calibration` is the same on `profile.json`).

A row may leave a primitive empty (a record transcribed from docs/benchmarks.md that did not split it);
an empty column counts as 0 and `missing` names it.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, fields
from pathlib import Path

from moevement.checkpoint.schedule import find_window_size
from simulator.frozen import Ablation, frozen_fractions
from simulator.mechanisms import (
    MOC_REPLAY_ITERATIONS,
    Cost,
    moevement_recovery_s,
    overlapped_stall_s,
    periodic_recovery_s,
)
from simulator.oracle import oracle_interval
from simulator.run import scheduled_ettr
from simulator.setting import Operator

# The committed measurements `--paper-tables` reads unless `--measured CSV` names newer ones: the ETTR
# benchmark's strategies (our own Table 4) and Figure 13's four steps as its variants (our own Figure 13).
RECORDED_CSV = Path(__file__).with_name("measurements") / "bench_moe_fbc45b1.csv"
RECORDED_ABLATION_CSV = Path(__file__).with_name("measurements") / "ablation_bench_moe_8c3d74d.csv"
OPERATORS = 64  # Algorithm 1 on equal operators: the window depends on the byte ratio only


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
    replay_s: float = 0.0  # MoEvement: convert + catch-up (recorded; the model predicts it)
    replayed: int = 0  # iterations replayed (MoEvement) or recomputed (the baselines): recorded, predicted
    recovery_per_failure_s: float = 0.0  # measured loss per failure (recovery + recomputation); required
    warmup_s: float = 0.0  # the first iterations beyond T: the failure-independent loss
    expert_share: float = 0.0  # routed experts' share of the parameters (MoC)
    experts: int = 1  # routed experts per MoE layer
    moc_experts: int = 1  # MoC's first K
    overhead: float = 0.0  # measured (first executions against T); only `replayed` reads it
    missing: tuple[str, ...] = ()  # primitives the row left empty

    @property
    def useful_s(self) -> float:
        return self.iterations * self.reference_s


COLUMNS = [f.name for f in fields(MeasuredRun) if f.name != "missing"]
PRIMITIVES = ("restart_s", "fetch_s", "warmup_s")  # what `predict` reads of a row beyond T and the run


def from_row(row: dict, run: str = "") -> MeasuredRun:
    """A `MeasuredRun` from one ettr.csv row (strings or numbers; ValueError naming a missing column)."""
    types, values, missing = {f.name: f.type for f in fields(MeasuredRun)}, {}, []
    optional = (*PRIMITIVES, "replay_s", "replayed", "expert_share", "experts", "moc_experts", "overhead")
    for name in COLUMNS:
        raw = row.get(name)
        if name == "run":
            values[name] = str(raw or run)
        elif (raw is None or raw == "") and name not in optional:
            raise ValueError(f"measured run: missing column {name!r}")
        elif raw is None or raw == "":
            missing += [name] if name in PRIMITIVES else []
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


def moevement_measured_cost(r: MeasuredRun, ablation: Ablation) -> Cost:
    """MoEvement's mechanism (`simulator.mechanisms.moevement_recovery_s`) on a measured run: W from Algorithm 1
    at the cap on equal operators (no popularity is measured, so the order changes nothing), the measured
    restart and fetch, conversion and catch-up iterations of one stage's share of T (localized) or of T
    (global rollback), frozen operators skipping their weight gradient unless ablated."""
    t, n = r.reference_s, max(1, r.failures)
    w, per_slot = _window(r.dense_snapshot_iters)
    ops = [Operator(12.0, 2.0, 1.0)] * OPERATORS
    slots = [range(i * per_slot, min(OPERATORS, (i + 1) * per_slot)) for i in range(w)]
    frozen = frozen_fractions(ops, slots) if ablation.skip_bweight else [0.0] * w
    replay = stage_iteration_s(r) if ablation.localized else t
    recovery = moevement_recovery_s(r.restart_s / n, r.fetch_s / n, frozen, replay, t)
    return Cost(r.strategy, 0.0, recovery, window=w)


def stage_iteration_s(r: MeasuredRun) -> float:
    """One stage's share of an iteration without the bubble (`simulator.setting.Setting.stage_iteration_s`)."""
    return r.reference_s * r.micro_batches / (r.micro_batches + r.pp - 1)


def predicted_cost(r: MeasuredRun) -> Cost | None:
    """The model's cost of `r`'s strategy from its primitives (None: CheckFreq, whose persist is not measured)."""
    t, n = r.reference_s, max(1, r.failures)
    restart, fetch = r.restart_s / n, r.fetch_s / n
    dense_s = r.dense_snapshot_iters * t
    strategy, ablation = ablation_of(r.strategy)
    if strategy == "moevement":
        cost = moevement_measured_cost(r, ablation)
    elif strategy == "gemini":
        stall, fixed = overlapped_stall_s(dense_s, t), restart + fetch
        k = oracle_interval(stall, t, fixed, r.mtbf_iters * t)
        cost = Cost("gemini", stall / (k * t), periodic_recovery_s(fixed, k, t), interval=k, stall_s=stall)
    elif strategy == "moc":
        share = 1 - r.expert_share + r.expert_share * r.moc_experts / max(1, r.experts)
        stall = overlapped_stall_s(dense_s * share, t)
        cost = Cost("moc", stall / t, restart + fetch + MOC_REPLAY_ITERATIONS * t, interval=1, stall_s=stall)
    else:
        return None
    return _with_warmup(cost, r)


def _with_warmup(cost: Cost, r: MeasuredRun) -> Cost:
    """The measured warm-up as the failure-independent loss: (1 - z) useful / wall = useful / (wall + warm-up)
    (a negative warm-up is the references' drift, not a gain: 0)."""
    wall, warmup = r.useful_s * (1 + cost.overhead) + r.failures * cost.recovery_s, max(0.0, r.warmup_s)
    z = warmup / (wall + warmup) if wall + warmup > 0 else 0.0
    return Cost(cost.strategy, cost.overhead, cost.recovery_s, cost.interval, cost.window, cost.stall_s, z)


def predict(r: MeasuredRun) -> float | None:
    """The model's ETTR of `r` (None where `predicted_cost` has none)."""
    cost = predicted_cost(r)
    return None if cost is None else scheduled_ettr(cost, r.failures, r.useful_s)


def replayed(r: MeasuredRun) -> float:
    """The failure law on the measured overhead and loss per failure."""
    cost = Cost(r.strategy, r.overhead, r.recovery_per_failure_s)
    return scheduled_ettr(cost, r.failures, r.useful_s)
