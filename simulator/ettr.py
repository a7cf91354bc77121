"""ETTR simulator: checkpointing strategies under failures at scale (the paper's Appendix C study).

    python -m simulator.ettr --preset 671B-16384 --mtbf-min 10 [--strategies ...] [--json]
    python -m simulator.ettr --list | --profile profile.json

Appendix C's text was not at hand; this is a first-principles model with these assumptions.

ETTR = useful time / wall time. Failures every `mtbf` s of wall time, each costing R s (restart +
load + recomputation), checkpointing stretching each iteration by a fraction o:
    ETTR = 1 / (1 + o) * max(0, 1 - R / mtbf).
A finite run (steps iterations of T s, F failures) puts the observed rate F / wall for 1 / mtbf:
wall = steps T (1 + o) + F R, ETTR = steps T / wall = 1 / (1 + o) * (1 - F R / wall).

Iteration, 1F1B: T = sum_s t_s + (M - 1) max_s t_s + t_dp, i.e. (M + S - 1)(t_f + t_b) + t_dp for
S equal stages. t_f = FLOPs / (peak MFU) + 2 all-to-alls (dispatch, combine) per MoE layer, over
NVLink when ep fits in a node, else the NIC; t_b = 2x that compute + 2 all-to-alls; t_dp =
reduce-scatter + all-gather of bf16 gradients over the data-parallel groups. A collective costs
alpha + bytes / bw. Every stage costs what the bottleneck stage (ceil(layers / pp) layers) costs.

Failures strike uniformly inside an iteration: all strategies lose the aborted iteration (T / 2 on
average) and pay `restart_s`; a checkpoint of state_t is usable once iteration t has finished.
- gemini / checkfreq / moc, interval k: global rollback, (k + 1) / 2 completed iterations redone by
  the whole pipeline on average, so R = fixed + (k / 2 + 1) T. Stall per checkpoint max(0, copy - T).
  gemini: k given or ETTR-optimal. checkfreq: smallest k with overhead <= 3%; it also waits when a
  disk persist outlasts k iterations, loads from disk, and its newest checkpoint is durable only
  `persist` s later (that much more lost). moc: every iteration, all non-expert state + K_pec
  experts per MoE layer (round robin; PLT = lost expert updates / all updates).
- moevement, window W from Algorithm 1 (`moevement.checkpoint.schedule.find_window_size`): the failed stage's
  data-parallel group fetches the W snapshots and replays W conversion + (W - 1) / 2 catch-up
  iterations on average (catch-up is uniform on 0..W-1), each M (t_f + t_b) + t_dp (one stage, no
  bubble); during conversion (W - 1) / (2W) of the work is frozen on average and skips its weight
  gradients, 1/3 of its FLOPs. Overhead = max(0, largest snapshot - T) / T.
- none: a failure loses everything, so steady-state ETTR is 0 (1 without failures).
Snapshots go to host memory and to `replicas` peers in the NIC's idle time: bandwidth
min(PCIe, NIC (1 - busy) / replicas); a peer fetch runs at min(PCIe, NIC). Each GPU saves what it
holds (optimizer state not sharded over data parallelism, DeepSpeed PP + EP style): dense = 12
bytes/param (FP32 master + Adam m, v); sparse snapshots add 2 bytes/param of bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from baselines.intervals import checkfreq_interval, checkfreq_overhead, ettr, oracle_interval
from moevement.checkpoint.schedule import find_window_size, snapshot_sizes

STRATEGIES = ("none", "moevement", "gemini", "checkfreq", "moc")
FP32_STATE_BYTES, COMPUTE_BYTES, GRAD_BYTES, ACT_BYTES = 12, 2, 2, 2
GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """DeepSeek-MoE-style transformer: MoE layers of shared + routed SwiGLU experts (3*h*f params)."""

    layers: int
    dense_layers: int
    hidden: int
    dense_ffn: int
    experts: int
    shared_experts: int
    top_k: int
    expert_ffn: int
    vocab: int
    attn_params: int = 0  # per layer; 0 means 4 * hidden^2 (multi-head attention)

    @property
    def attn(self) -> int:
        return self.attn_params or 4 * self.hidden**2

    @property
    def expert(self) -> int:
        return 3 * self.hidden * self.expert_ffn

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def total_params(self) -> int:
        moe = (self.experts + self.shared_experts) * self.expert + self.hidden * self.experts
        return (
            self.layers * self.attn
            + self.dense_layers * 3 * self.hidden * self.dense_ffn
            + self.moe_layers * moe
            + 2 * self.vocab * self.hidden
        )


@dataclass(frozen=True)
class Hardware:
    """Per-GPU rates (bytes/s, FLOP/s) and the restart constant (seconds)."""

    peak_flops: float = 989e12  # H100/H800 dense BF16
    mfu: float = 0.35
    a2a_alpha_s: float = 30e-6
    a2a_bw: float = 40 * GB  # 400 Gb/s InfiniBand per GPU, ~80% achieved
    nvlink_bw: float = 150 * GB  # all-to-all inside one node (ep <= gpus_per_node)
    gpus_per_node: int = 8
    dp_alpha_s: float = 50e-6
    dp_bw: float = 40 * GB
    host_bw: float = 25 * GB  # GPU -> pinned host memory over PCIe, effective
    nic_bw: float = 50 * GB  # what replication / peer fetch may use when the NIC is idle
    disk_bw: float = 1 * GB  # per-GPU share of the node's persistent storage
    restart_s: float = 60.0


@dataclass(frozen=True)
class ClusterShape:
    """gpus = pp * dp; experts are sharded over `ep` (which divides dp) and replicated dp/ep times."""

    gpus: int
    pp: int
    ep: int
    micro_batches: int
    micro_batch_seqs: int = 1
    seq_len: int = 4096
    replicas: int = 2

    @property
    def dp(self) -> int:
        return self.gpus // self.pp


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelShape
    layout: ClusterShape
    hw: Hardware = field(default_factory=Hardware)
    moc_k_pec: int = 0  # experts per MoE layer in each MoC checkpoint; 0 means experts // 8


# Presets for the paper's DeepSeek-MoE scaling runs. Sources / assumptions:
# | preset     | shape                                                     | layout               |
# | 32B-512    | DeepSeekMoE recipe: 36 layers, h=3072, 64+2 experts, f=1408 | pp 4,  ep 8,  M 16 |
# | 67B-*      | DeepSeekMoE recipe: 39 layers, h=4096, 64+2 experts, f=2048 | pp 8,  ep 16, M 16 |
# | 145B-*     | DeepSeekMoE 145B: 62 layers, h=4096, 128+4 experts, top-12, | pp 8,  ep 32, M 16 |
# |            | f=1408 (DeepSeekMoE paper, 144.6B total)                    |                    |
# | 671B-16384 | DeepSeek-V3: 61 layers (3 dense, f=18432), h=7168, 256+1    | pp 16, ep 64, M 16 |
# |            | experts, top-8, f=2048, MLA ~187M/layer, vocab 129280       | (V3's pp/ep)       |
# Sequences of 4096 tokens, one per micro-batch; weak scaling (global batch = dp * M sequences,
# 67M tokens for 671B, close to DeepSeek-V3's 63M). Hardware: `Hardware` defaults (H800-class).
_S32 = ModelShape(36, 1, 3072, 8192, 64, 2, 6, 1408, 102400)
_S67 = ModelShape(39, 1, 4096, 10944, 64, 2, 6, 2048, 102400)
_S145 = ModelShape(62, 1, 4096, 10944, 128, 4, 12, 1408, 102400)
_S671 = ModelShape(61, 3, 7168, 18432, 256, 1, 8, 2048, 129280, attn_params=187_000_000)
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("32B-512", _S32, ClusterShape(512, 4, 8, 16)),
        Preset("67B-1024", _S67, ClusterShape(1024, 8, 16, 16)),
        Preset("67B-2048", _S67, ClusterShape(2048, 8, 16, 16)),
        Preset("145B-4096", _S145, ClusterShape(4096, 8, 32, 16)),
        Preset("145B-8192", _S145, ClusterShape(8192, 8, 32, 16)),
        Preset("671B-16384", _S671, ClusterShape(16384, 16, 64, 16)),
    )
}


# ---- iteration time ------------------------------------------------------------------------------


def collective_s(alpha_s: float, nbytes: float, bandwidth: float) -> float:
    """Affine cost of one collective: alpha + bytes / bandwidth."""
    return alpha_s + nbytes / bandwidth


def pipeline_s(stage_s: Sequence[float], micro_batches: int) -> float:
    """1F1B makespan: fill/drain through every stage + (M - 1) steady steps of the slowest stage.

    `stage_s[i]` is stage i's forward + backward time for one micro-batch; equal stages give
    (M + S - 1) * t.
    """
    return sum(stage_s) + (micro_batches - 1) * max(stage_s)


@dataclass(frozen=True)
class StageModel:
    """One GPU of the bottleneck stage: its operators and per-micro-batch costs (seconds)."""

    operators: tuple[int, ...]  # parameter counts in schedule order: routed experts, then the rest
    expert_params: int
    nonexpert_params: int
    compute_s: float  # forward + backward FLOP time of one micro-batch
    t_f: float  # forward incl. all-to-all
    t_b: float  # backward incl. all-to-all
    dp_s: float  # gradient reduce-scatter + all-gather per iteration
    nic_s: float  # seconds per iteration the NIC carries training traffic
    stages: int
    micro_batches: int

    @property
    def params(self) -> int:
        return self.expert_params + self.nonexpert_params

    @property
    def iteration_s(self) -> float:
        return pipeline_s([self.t_f + self.t_b] * self.stages, self.micro_batches) + self.dp_s

    def replay_s(self, frozen: float = 0.0) -> float:
        """One iteration of one stage without the bubble; `frozen` FLOP fraction skips weight grads."""
        return self.micro_batches * (self.t_f + self.t_b - self.compute_s * frozen / 3) + self.dp_s


def stage_model(preset: Preset) -> StageModel:
    """Bottleneck-stage operators and times from the model shape, layout and hardware."""
    m, lay, hw = preset.model, preset.layout, preset.hw
    n_layers = math.ceil(m.layers / lay.pp)
    n_moe = min(n_layers, math.ceil(m.moe_layers / lay.pp))
    n_dense = n_layers - n_moe
    local_experts = math.ceil(m.experts / lay.ep)
    experts = [m.expert] * (n_moe * local_experts)
    others = [m.attn] * n_layers + [3 * m.hidden * m.dense_ffn] * n_dense
    others += [m.hidden * m.experts] * n_moe + [m.expert] * (n_moe * m.shared_experts)
    tokens = lay.micro_batch_seqs * lay.seq_len
    active = (
        n_layers * m.attn
        + n_dense * 3 * m.hidden * m.dense_ffn
        + n_moe * ((m.top_k + m.shared_experts) * m.expert + m.hidden * m.experts)
    )
    attn_scores = 2 * lay.seq_len * m.hidden * n_layers  # causal QK^T + AV, per token
    fwd_flops = (2 * active + attn_scores) * tokens
    fwd_compute = fwd_flops / (hw.peak_flops * hw.mfu)
    a2a_bytes = tokens * m.top_k * m.hidden * ACT_BYTES * (lay.ep - 1) / lay.ep
    a2a_bw = hw.nvlink_bw if lay.ep <= hw.gpus_per_node else hw.a2a_bw
    a2a = 2 * n_moe * collective_s(hw.a2a_alpha_s, a2a_bytes, a2a_bw)  # dispatch + combine
    edp = lay.dp // lay.ep
    dp_s = 0.0
    for group, params in ((lay.dp, sum(others)), (edp, sum(experts))):
        if group > 1:
            dp_s += 2 * collective_s(hw.dp_alpha_s, (group - 1) / group * params * GRAD_BYTES, hw.dp_bw)
    nic_s = dp_s + (0.0 if lay.ep <= hw.gpus_per_node else 2 * a2a * lay.micro_batches)
    return StageModel(
        tuple(experts + others),
        sum(experts),
        sum(others),
        3 * fwd_compute,
        fwd_compute + a2a,
        2 * fwd_compute + a2a,
        dp_s,
        nic_s,
        lay.pp,
        lay.micro_batches,
    )


# ---- ETTR ----------------------------------------------------------------------------------------

# ---- strategies ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategyResult:
    strategy: str
    ettr: float
    overhead: float
    recovery_s: float
    interval: int | None = None
    window: int | None = None
    plt: float | None = None  # moc: fraction of routed-token expert updates lost


@dataclass(frozen=True)
class Scenario:
    """A preset's derived quantities that every strategy uses."""

    preset: Preset
    stage: StageModel
    iteration_s: float
    snapshot_bw: float
    fetch_bw: float
    dense_bytes: float

    @classmethod
    def of(cls, preset: Preset) -> Scenario:
        st, hw = stage_model(preset), preset.hw
        idle = max(0.0, 1 - st.nic_s / st.iteration_s)
        snap = min(hw.host_bw, hw.nic_bw * idle / max(1, preset.layout.replicas))
        return cls(preset, st, st.iteration_s, snap, min(hw.host_bw, hw.nic_bw), FP32_STATE_BYTES * st.params)

    def stall_s(self, nbytes: float) -> float:
        return max(0.0, nbytes / self.snapshot_bw - self.iteration_s)


def _moevement(sc: Scenario, mtbf_s: float, interval: int | None) -> StrategyResult:
    st, t = sc.stage, sc.iteration_s
    fp32 = [FP32_STATE_BYTES * p for p in st.operators]
    comp = [COMPUTE_BYTES * p for p in st.operators]
    window, o_active = find_window_size(fp32, comp, t, sc.snapshot_bw)
    n = len(fp32)
    slots = [range(i * o_active, min(n, (i + 1) * o_active)) for i in range(window)]
    sizes = snapshot_sizes(slots, fp32, comp)
    overhead = sc.stall_s(max(sizes)) / t
    replay = window * st.replay_s((window - 1) / (2 * window)) + (window - 1) / 2 * st.replay_s()
    recovery = sc.preset.hw.restart_s + sum(sizes) / sc.fetch_bw + replay + t / 2
    return StrategyResult("moevement", ettr(overhead, recovery, mtbf_s), overhead, recovery, window=window)


def _gemini(sc: Scenario, mtbf_s: float, interval: int | None) -> StrategyResult:
    t, stall = sc.iteration_s, sc.stall_s(sc.dense_bytes)
    fixed = sc.preset.hw.restart_s + sc.dense_bytes / sc.fetch_bw
    k = interval or oracle_interval(stall, t, fixed, mtbf_s)
    overhead, recovery = stall / (k * t), fixed + (k / 2 + 1) * t
    return StrategyResult("gemini", ettr(overhead, recovery, mtbf_s), overhead, recovery, interval=k)


def _checkfreq(sc: Scenario, mtbf_s: float, interval: int | None) -> StrategyResult:
    t, stall = sc.iteration_s, sc.stall_s(sc.dense_bytes)
    persist = load = sc.dense_bytes / sc.preset.hw.disk_bw  # write and read back at disk speed
    k = interval or checkfreq_interval(stall, persist, t)
    overhead = checkfreq_overhead(k, stall, persist, t)
    durable_lag = min(persist, k * t)  # the newest checkpoint is not on disk yet
    recovery = sc.preset.hw.restart_s + load + (k / 2 + 1) * t + durable_lag
    return StrategyResult("checkfreq", ettr(overhead, recovery, mtbf_s), overhead, recovery, interval=k)


def _moc(sc: Scenario, mtbf_s: float, interval: int | None) -> StrategyResult:
    st, t, m = sc.stage, sc.iteration_s, sc.preset.model
    k_pec = min(m.experts, sc.preset.moc_k_pec or max(1, m.experts // 8))
    k = interval or 1
    nbytes = FP32_STATE_BYTES * (st.nonexpert_params + st.expert_params * k_pec / m.experts)
    overhead = sc.stall_s(nbytes) / (k * t)
    recovery = sc.preset.hw.restart_s + sc.dense_bytes / sc.fetch_bw + (k / 2 + 1) * t
    stale = (m.experts / k_pec - 1) / 2 * k  # extra iterations of expert updates lost per failure
    plt = 0.0 if math.isinf(mtbf_s) else min(1.0, stale * t * (1 + overhead) / mtbf_s)
    return StrategyResult("moc", ettr(overhead, recovery, mtbf_s), overhead, recovery, interval=k, plt=plt)


def _none(sc: Scenario, mtbf_s: float, interval: int | None) -> StrategyResult:
    return StrategyResult("none", 1.0 if math.isinf(mtbf_s) else 0.0, 0.0, math.inf)


_EVALUATORS = {"none": _none, "moevement": _moevement, "gemini": _gemini, "checkfreq": _checkfreq, "moc": _moc}


def simulate(
    preset: Preset, mtbf_s: float, strategies: Sequence[str] = STRATEGIES, interval: int | None = None
) -> list[StrategyResult]:
    """One result per strategy; `interval` fixes gemini/checkfreq/moc's k (default: their policy)."""
    sc = Scenario.of(preset)
    return [_EVALUATORS[s](sc, mtbf_s, interval) for s in strategies]


# ---- calibration against a measured run ----------------------------------------------------------


@dataclass(frozen=True)
class MeasuredStrategy:
    overhead: float  # measured checkpoint overhead, fraction of the fault-free iteration
    recovery_s: float  # mean seconds lost per failure (recovery + recomputation)
    failures: int


@dataclass(frozen=True)
class MeasuredProfile:
    """A benchmark run on this machine: {"iteration_s", "mtbf_s", "steps", "strategies": {name: {...}}}.

    `iteration_s` is the fault-free iteration time of `none`; each strategy has `overhead`,
    `recovery_s` and `failures` (see `MeasuredStrategy`).
    """

    iteration_s: float
    mtbf_s: float
    steps: int
    strategies: dict[str, MeasuredStrategy]

    @classmethod
    def from_json(cls, data: str | dict[str, Any]) -> MeasuredProfile:
        d = json.loads(data) if isinstance(data, str) else data
        try:
            strategies = {
                name: MeasuredStrategy(float(s["overhead"]), float(s["recovery_s"]), int(s["failures"]))
                for name, s in d["strategies"].items()
            }
            return cls(float(d["iteration_s"]), float(d["mtbf_s"]), int(d["steps"]), strategies)
        except KeyError as err:
            raise ValueError(f"profile: missing key {err}") from None

    def finite_ettr(self, name: str) -> float:
        """ETTR over the measured run: 1/(1+o) * (1 - F R / wall), wall = steps T (1+o) + F R."""
        s = self.strategies[name]
        wall = self.steps * self.iteration_s * (1 + s.overhead) + s.failures * s.recovery_s
        return (1 - s.failures * s.recovery_s / wall) / (1 + s.overhead) if wall > 0 else 0.0

    def steady_ettr(self, name: str) -> float:
        """The MTBF-based steady-state ETTR with the measured overhead and recovery cost."""
        s = self.strategies[name]
        return ettr(s.overhead, s.recovery_s, self.mtbf_s)


def predict_from_profile(profile: dict[str, Any] | MeasuredProfile) -> dict[str, float]:
    """Finite-run ETTR per strategy of a measured profile (see `MeasuredProfile.finite_ettr`)."""
    p = profile if isinstance(profile, MeasuredProfile) else MeasuredProfile.from_json(profile)
    return {name: p.finite_ettr(name) for name in p.strategies}


# ---- CLI -----------------------------------------------------------------------------------------


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, (int, str)) else f"{value:.4f}"


def _finite(value: Any) -> Any:
    """JSON has no infinity: an unbounded value (none's recovery) becomes null."""
    return None if isinstance(value, float) and math.isinf(value) else value


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m simulator.ettr", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", help="scaling-run preset (see --list)")
    ap.add_argument("--mtbf-min", type=float, help="mean time between failures, minutes (inf: none)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    ap.add_argument("--interval", type=int, help="fix gemini/checkfreq/moc checkpoint interval k")
    ap.add_argument("--host-gbs", type=float, help="override GPU->host snapshot bandwidth, GB/s")
    ap.add_argument("--restart-s", type=float, help="override the restart constant, seconds")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    ap.add_argument("--list", action="store_true", help="list the presets")
    ap.add_argument("--profile", help="measured profile JSON: print predicted ETTR per strategy")
    return ap.parse_args(argv)


def _run_profile(path: str, as_json: bool) -> None:
    try:
        with open(path) as f:
            profile = MeasuredProfile.from_json(f.read())
    except (OSError, ValueError, TypeError, AttributeError) as err:
        _fail(f"--profile {path}: {err}")
    predicted = predict_from_profile(profile)
    if as_json:
        print(
            json.dumps({s: {"predicted_ettr": e, "steady_ettr": profile.steady_ettr(s)} for s, e in predicted.items()})
        )
        return
    for s, e in predicted.items():
        print(f"strategy={s} predicted_ettr={e:.4f} steady_ettr={profile.steady_ettr(s):.4f}")


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    if args.list:
        for p in PRESETS.values():
            print(
                f"{p.name} gpus={p.layout.gpus} params_b={p.model.total_params() / 1e9:.1f} "
                f"pp={p.layout.pp} ep={p.layout.ep} dp={p.layout.dp}"
            )
        return
    if args.profile:
        return _run_profile(args.profile, args.json)
    if args.preset not in PRESETS:
        _fail(f"--preset: unknown {args.preset!r} (allowed: {', '.join(PRESETS)})")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        _fail(f"--strategies: unknown {','.join(bad) or '(empty)'} (allowed: {', '.join(STRATEGIES)})")
    if args.mtbf_min is None or not args.mtbf_min > 0:
        _fail("--mtbf-min: needs a positive number of minutes (or inf)")
    if args.interval is not None and args.interval < 1:
        _fail("--interval: needs an integer >= 1")
    preset = PRESETS[args.preset]
    hw = preset.hw
    if args.host_gbs is not None:
        if not args.host_gbs > 0:
            _fail("--host-gbs: needs a positive number of GB/s")
        hw = replace(hw, host_bw=args.host_gbs * GB)
    if args.restart_s is not None:
        hw = replace(hw, restart_s=args.restart_s)
    preset = replace(preset, hw=hw)
    _report(preset, args.mtbf_min * 60, strategies, args.interval, args.json)


def _report(preset: Preset, mtbf_s: float, strategies: Sequence[str], interval: int | None, as_json: bool) -> None:
    sc = Scenario.of(preset)
    results = simulate(preset, mtbf_s, strategies, interval)
    head = {
        "preset": preset.name,
        "gpus": preset.layout.gpus,
        "params_b": preset.model.total_params() / 1e9,
        "pp": preset.layout.pp,
        "ep": preset.layout.ep,
        "dp": preset.layout.dp,
        "iter_s": sc.iteration_s,
        "snapshot_gbs": sc.snapshot_bw / GB,
        "dense_gb_per_gpu": sc.dense_bytes / GB,
        "mtbf_min": mtbf_s / 60,
    }
    if as_json:
        rows = {r.strategy: {k: _finite(v) for k, v in asdict(r).items()} for r in results}
        print(json.dumps({**head, "strategies": rows}))
        return
    print(" ".join(f"{k}={_fmt(v)}" for k, v in head.items()))
    for r in results:
        print(
            f"strategy={r.strategy} ettr={_fmt(r.ettr)} overhead={_fmt(r.overhead)} "
            f"recovery_s={_fmt(r.recovery_s)} interval={_fmt(r.interval)} window={_fmt(r.window)} "
            f"plt={_fmt(r.plt)}"
        )


if __name__ == "__main__":
    main()
