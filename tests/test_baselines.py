"""Baselines in the same trainer (gemini, checkfreq, moc), failure schedules and ETTR accounting.

Unit tests pin MoC's selection schedule (the paper's 4-layer, 3-expert, EP=3 example), the PLT
closed form under uniform routing, K doubling, the interval policies, the failure schedules and
the ETTR arithmetic. The end-to-end cases launch real processes under torchrun with gloo: Gemini
and CheckFreq recover exactly but roll every rank back and recompute; MoC restores stale experts
and loses tokens.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from baselines.intervals import IntervalPolicy, checkfreq_interval, oracle_interval, periodic_ettr
from baselines.moc import LostTokens, PartialExpertSelector, adaptive_k, moc_selection
from benchmarks.ettr import main as ettr_main
from benchmarks.ettr_moc import charged, first_k, routed_per_iteration, stage_bytes
from benchmarks.ettr_runs import Reference, bracket, lost_time, parse_run, summarize
from moevement.failures import FaultPlan, FaultSpecError, poisson_events
from moevement.operators import Operator
from moevement.recovery.report import RecoveryReport
from moevement.storage.sealed import seal
from tests.helpers import DEBUG_CONFIG, accounting, base_args, final_line, recoveries, run_cli, step_losses, steps
from trainer.config import ConfigError, expected_mtbf_iters, load_config
from trainer.event_writer import append_event
from trainer.records.accounting import RunAccounting
from trainer.records.accounting_line import AccountingLine
from trainer.records.event_lines import StepLine

BASE = [*base_args(steps=14), "--parallelism.pp", "2"]


# ---- MoC: selection, lost tokens, K doubling ----------------------------------------------------------


def test_moc_selection_paper_example_4_layers_3_experts_ep3():
    """K=1: layer j starts one EP rank further on; every (layer, expert) is saved once per 3 checkpoints."""
    schedule = [moc_selection(3 * 0 + c, 4, 3, 3, 1) for c in range(3)]  # cursor advances by K=1
    assert schedule == [[[0], [1], [2], [0]], [[1], [2], [0], [1]], [[2], [0], [1], [2]]]
    for layer in range(4):
        assert sorted(schedule[c][layer][0] for c in range(3)) == [0, 1, 2]
    for checkpoint in schedule:  # expert e lives on EP rank e: the save work differs by at most one expert
        load = [sum(chosen == [rank] for chosen in checkpoint) for rank in range(3)]
        assert max(load) - min(load) <= 1


def _moe_ops(n_experts: int) -> list[Operator]:
    return [
        Operator("layers.1", "block", 1),
        Operator("layers.1.moe.router", "router", 1),
        *[Operator(f"layers.1.moe.experts.{e}", "expert", 1, e) for e in range(n_experts)],
    ]


def test_selector_keeps_non_expert_operators_and_doubles_k_up_to_all():
    selector = PartialExpertSelector(_moe_ops(8), moe_layers=[1], n_experts=8, ep=1, k=3)
    first = selector.next_checkpoint()
    assert first == ["layers.1", "layers.1.moe.router", *[f"layers.1.moe.experts.{e}" for e in (0, 1, 2)]]
    assert selector.next_checkpoint()[2:] == [f"layers.1.moe.experts.{e}" for e in (3, 4, 5)]
    selector.double()
    assert selector.k == 6
    selector.double()
    assert selector.k == 8 and len(selector.next_checkpoint()) == 10


def test_plt_closed_form_under_uniform_routing():
    """E experts, K per checkpoint, every I iterations, tau tokens per expert per iteration, a failure
    right at the n-th checkpoint after the first: PLT = (E/K - 1) / (2 n)."""
    n_experts, k, interval, tau, n = 8, 2, 3, 5.0, 6
    selector = PartialExpertSelector(_moe_ops(n_experts), [1], n_experts, 1, k)
    tracker, saved_at = LostTokens(), {}
    rollback_to = 1 + n * interval
    for t in range(1, rollback_to):
        if (t - 1) % interval == 0:
            saved_at.update({name: t for name in selector.next_checkpoint()})
        tracker.observe(t, {f"layers.1.moe.experts.{e}": tau for e in range(n_experts)})
    saved_at.update({name: rollback_to for name in selector.next_checkpoint()})  # the checkpoint of t_c
    lost, processed = tracker.account(rollback_to, saved_at)
    assert processed == n_experts * tau * (rollback_to - 1)
    assert lost / processed == pytest.approx((n_experts / k - 1) / (2 * n))


# ---- intervals ---------------------------------------------------------------------------------------


def test_interval_policies():
    fixed = IntervalPolicy("gemini", "7", 0.0, lambda: [])
    assert fixed.choose(1e9, 1e6, 1.0) == 7
    capped = IntervalPolicy("checkfreq", "auto", 0.0, lambda: [])
    assert capped.choose(3e6, 1e6, 1.0) == checkfreq_interval(2.0, 0.0, 1.0) == 67  # stall 2 s: k >= 2/0.03
    capped.observe_stall(0.5)  # a measured stall overrides the estimate
    assert capped.choose(3e6, 1e6, 1.0) == 17
    oracle = IntervalPolicy("gemini", "auto", 100.0, lambda: [])
    k = oracle.choose(3e6, 1e6, 1.0)
    best = max(range(1, 200), key=lambda j: periodic_ettr(j, 2.0, 1.0, 0.0, 100.0))
    assert k == best == oracle_interval(2.0, 1.0, 0.0, 100.0)
    oracle.scheduled(10, k)
    assert not oracle.due(10 + k - 1) and oracle.due(10 + k)
    oracle.rolled_back(12)
    assert oracle.next_due == 12 + k
    every = IntervalPolicy("moc", "auto", 0.0, lambda: [])  # MoC-System's own: every iteration, whatever it costs
    assert every.mode() == "fixed" and every.choose(3e9, 1e6, 1.0) == 1


def test_moc_adaptive_k_is_the_most_experts_whose_snapshot_the_iteration_hides():
    # 1 s to overlap at 100 B/s: 40 B of non-expert state leave 60 B; 32 experts of 10 B each: 6 fit
    assert adaptive_k(40.0, 320.0, 32, 100.0, 1.0) == 6
    assert adaptive_k(40.0, 320.0, 32, 100.0, 0.99) == 5
    assert adaptive_k(200.0, 320.0, 32, 100.0, 1.0) == 1  # not even one fits: MoC-System's least, 1
    assert adaptive_k(40.0, 320.0, 32, 1e6, 1.0) == 32 and adaptive_k(40.0, 320.0, 32, 0.0, 1.0) == 32


def test_ettr_benchmark_sizes_moc_by_its_adaptive_configuration_and_charges_its_lost_tokens():
    """bench_moe at pp=2 with a cap under which a dense snapshot of a stage takes 3 iterations: K_pec is the
    smallest over the stages of what one iteration hides; PLT counts every routed assignment of every
    iteration run, and a lost token costs the run's own time per routed token."""
    from benchmarks.ettr_runs import RunTotals

    cfg = load_config("train_configs/bench_moe.toml", [])
    stages = stage_bytes(cfg, 2)
    dense = sum(a + b for a, b in stages) / 2  # bytes of an average stage: what the benchmark's cap is set by
    rate = dense / 3.0  # bytes per second, T = 1 s
    expected = min(adaptive_k(other, experts, 32, rate, 1.0) for other, experts in stages)
    assert 1 < expected < 32 and first_k(cfg, 2, rate * 8 / 1e9, 1.0) == expected
    assert routed_per_iteration(cfg) == 8 * 256 * 4 * 7  # batch x seq tokens, top-4, 7 MoE layers
    totals = RunTotals(100.0, 10, 90.0, 5.0, 5.0, 1, 2, lost_tokens=0.05 * 12 * 1000)
    assert charged(totals, 0.8, 1000) == pytest.approx({"plt": 0.05, "ettr_charged": 0.8 / 1.05})


# ---- failure schedules -------------------------------------------------------------------------------


def test_poisson_schedule_is_deterministic_and_fires_once():
    events = poisson_events(10, seed=3, world=4, last_step=200)
    assert events == poisson_events(10, seed=3, world=4, last_step=200)
    assert events != poisson_events(10, seed=4, world=4, last_step=200)
    assert 10 <= len(events) <= 35 and all(1 <= e.step <= 200 and 0 <= e.ranks[0] < 4 for e in events)
    plan = FaultPlan(mtbf_iters=10, seed=3, world=4, last_step=200)
    first = events[0].step
    assert plan.at(first) == [events[0]]
    assert plan.at(first) == []  # a rolled-back run reaching the iteration again meets no failure


def test_trace_file(tmp_path: Path):
    trace = tmp_path / "trace.csv"
    trace.write_text("iteration,rank\n5,1\n9,0\n")
    plan = FaultPlan(trace=str(trace), world=2, last_step=20)
    assert [(e.step, e.ranks) for e in plan.events] == [(5, (1,)), (9, (0,))]
    timed = tmp_path / "timed.csv"
    timed.write_text("time_s,rank\n2.5,1\n")
    plan = FaultPlan(trace=str(timed), world=2, last_step=20)
    assert plan.at(3, elapsed_s=1.0) == [] and [e.ranks for e in plan.at(4, elapsed_s=2.6)] == [(1,)]
    bad = tmp_path / "bad.csv"
    bad.write_text("iteration,rank\nfive,1\n")
    with pytest.raises(FaultSpecError, match="fault.trace.*line 2"):
        FaultPlan(trace=str(bad), world=2, last_step=20)


@pytest.mark.slow
def test_bad_baseline_config_is_one_clear_error():
    proc = run_cli(
        "--config", DEBUG_CONFIG, "--checkpoint.strategy", "gemini", "--checkpoint.interval", "often", check=False
    )
    assert proc.returncode == 2 and "checkpoint.interval" in proc.stderr and "oracle" in proc.stderr
    proc = run_cli("--config", DEBUG_CONFIG, "--fault.mtbf_iters", "10", check=False)
    assert proc.returncode == 2 and "fault.mtbf_iters" in proc.stderr and "moevement" in proc.stderr


def test_gemini_plans_for_the_expected_mtbf_without_injected_poisson_failures():
    """Real deaths (`fault.kill`) leave `fault.mtbf_iters` at 0: `checkpoint.mtbf_iters` tells Gemini's
    oracle the MTBF instead, else it would fall back to CheckFreq's policy."""
    base = ["--checkpoint.strategy", "gemini", "--checkpoint.interval", "oracle"]
    cfg = load_config(DEBUG_CONFIG, [*base, "--checkpoint.mtbf_iters", "100", "--fault.kill", "5:1:forward"])
    assert expected_mtbf_iters(cfg) == 100
    assert IntervalPolicy("gemini", "auto", expected_mtbf_iters(cfg), lambda: []).mode() == "oracle"
    assert expected_mtbf_iters(load_config(DEBUG_CONFIG, ["--fault.mtbf_iters", "50", *base])) == 50
    with pytest.raises(ConfigError, match="checkpoint.interval.*checkpoint.mtbf_iters or fault.mtbf_iters"):
        load_config(DEBUG_CONFIG, base)


# ---- ETTR accounting --------------------------------------------------------------------------------


def test_ettr_accounting_on_a_scripted_run(monkeypatch):
    """4 iterations of 1 s, a failure costing 0.5 s that rolls back 2 iterations (recomputed at 1 s each).
    The wall time ends with the last iteration: gathering the final state afterwards is not training."""
    # start; the ends of iterations 1-3, of the recovery, of iterations 2-4; then the final gathering
    clock = iter([100.0, 101.0, 102.0, 103.0, 104.0, 105.0, 106.0, 107.5, 130.0])
    monkeypatch.setattr("trainer.records.accounting.time.time", lambda: next(clock))
    acct = RunAccounting(first_step=1, tokens_per_step=8)
    for step in (1, 2, 3):
        acct.iteration(step, 1.0)
    acct.recovered(1, 0.5)
    for step in (2, 3, 4):
        acct.iteration(step, 1.0)
    assert acct.elapsed() == 30.0
    summary = acct.summary({"host_mb": 3.0}, lost_tokens=0)
    assert summary.line() == (
        "accounting wall_s=7.500 iterations=4 productive_s=4.000 recompute_s=2.000 recovery_s=0.500 detect_s=0.000 "
        "failures=1 recomputed=2 tokens_per_s=4.267 lost_tokens=0 host_mb=3.0 log_mb=0.0"
    )
    read_back = AccountingLine.from_record(json.loads(json.dumps(summary.record())))  # as events.jsonl holds it
    assert read_back.line() == summary.line() and read_back.tokens_per_s == 4.267
    # benchmarks.ettr reads the records: each iteration's first execution (the reruns of 2 and 3 are not logged)
    timeline = [(1, 1.0, 1.0), (2, 1.0, 2.0), (3, 1.0, 3.0), (4, 1.5, 7.5)]
    steps = [_step(s, 100 / t, w) for s, t, w in timeline]
    run = parse_run([*steps, read_back])
    assert (run.totals.iterations, run.totals.recomputed, run.totals.host_mb) == (4, 2, 3.0)
    # the fault-free reference: its start-up to the end of iteration 3 took 2.5 s, iteration 4 took 1.5 s
    result = summarize(run, Reference(iteration_s=1.0, head_s=2.5, wall_s=4.0, iterations=4), tokens=100)
    assert result["ettr"] == pytest.approx(4 / 7.5)  # the reference's 4 s of wall clock for these 4 iterations
    assert result["overhead"] == pytest.approx(1.5 / 1.0 - 1)  # the first execution of 4, against T
    assert result["recovery_s"] == pytest.approx(2.5) and result["failures"] == 1
    with pytest.raises(ValueError, match="no accounting line"):
        parse_run(steps)


def _step(step: int, tok_per_s: float, wall_s: float) -> StepLine:
    """The `step` record of an iteration that ran at `tok_per_s` and ended `wall_s` into the run."""
    return StepLine(step, (("loss", 1.0), ("tok_per_s", tok_per_s), ("wall_s", wall_s)))


def _totals(wall_s: float, iterations: int, recompute_s: float = 0.0, recovery_s: float = 0.0, failures: int = 0):
    """An `accounting` record of these totals (`recomputed` = the iterations in `recompute_s`, 1 s each)."""
    productive = wall_s - recompute_s - recovery_s
    return AccountingLine(wall_s, iterations, productive, recompute_s, recovery_s, 0.0, failures, round(recompute_s),
                          iterations * 100 / wall_s, 0, 0.0, 0.0)  # fmt: skip


def _run_of(seconds: list[float]) -> list:
    """A fault-free run's records: its iterations took `seconds` (100 tokens each)."""
    walls = [sum(seconds[: i + 1]) for i in range(len(seconds))]
    steps = [_step(i + 1, 100 / t, w) for i, (t, w) in enumerate(zip(seconds, walls))]
    return [*steps, _totals(walls[-1], len(seconds))]


def test_start_up_is_charged_alike_to_every_run_and_its_reference():
    """Useful time is the references' own wall clock, start-up included: a run as slow to start as its
    references loses nothing to it, one slower loses only the difference; a reference of another length
    counts its start-up once and its later pace per iteration."""
    reference = Reference.of(parse_run(_run_of([3.0, 1.0, 1.0, 1.0, 1.0, 1.0])), tokens=100)
    assert (reference.iteration_s, reference.head_s, reference.wall_s) == (1.0, 5.0, 8.0)
    same = parse_run(_run_of([3.0, 1.0, 1.0, 1.0, 1.0, 1.0]))
    assert summarize(same, reference, 100)["ettr"] == pytest.approx(1.0)
    assert lost_time(same, reference, 100, 0.9)["warmup"] == pytest.approx(0.0)
    slow = parse_run(_run_of([5.0, 1.0, 1.0, 1.0, 1.0, 1.0]))
    assert summarize(slow, reference, 100)["ettr"] == pytest.approx(8.0 / 10.0)
    assert lost_time(slow, reference, 100, 0.9)["warmup"] == pytest.approx(2.0)
    assert reference.useful_s(12) == pytest.approx(5.0 + 9 * 1.0)
    later = Reference.of(parse_run(_run_of([3.0, 1.0, 1.0, 1.2, 1.2, 1.2])), tokens=100)
    assert bracket(reference, later) == Reference(1.1, 5.0, 8.3, 6)


def test_lost_time_splits_the_wall_beyond_the_references_into_its_causes():
    """Iterations 1-5 first executed in 3, 1, 1.5, 1.5, 1.5 s against a reference of 1 s iterations that
    took 3 s to the end of iteration 3; a real death's recovery line of 6 s (4.5 of it fetch, convert and
    catch-up), 0.5 s more before training went on, 2 s of recomputation, and 0.25 s the reference does not
    have (the interrupted iteration)."""
    timeline = [(1, 3, 3.0), (2, 1, 4.0), (3, 1.5, 5.5), (4, 1.5, 15.75), (5, 1.5, 17.25)]
    steps = [_step(s, 100 / t, w) for s, t, w in timeline]
    recovery = RecoveryReport(
        step=4,
        ranks=(0,),
        scope=(0,),
        rollback_to=2,
        replayed=2,
        seconds=6.0,
        restart_seconds=(("keep", 0.25), ("restart", 0.5), ("setup", 0.75)),
        fetch=0.5,
        convert=3.0,
        catchup=1.0,
        restart="local",
        detected_by=("rank1: ...",),
    )
    totals = _totals(17.25, 5, recompute_s=2.0, recovery_s=6.5, failures=1)
    reference = Reference(iteration_s=1.0, head_s=3.0, wall_s=5.0, iterations=5)
    lost = lost_time(parse_run([*steps, recovery, totals]), reference, tokens=100, target_ettr=0.5)
    assert lost == pytest.approx(
        {
            "lost": 12.25,
            "restart": 1.5,  # the line's seconds that are not fetch, convert or catch-up
            "fetch": 0.5,
            "convert": 3.0,
            "catchup": 1.0,
            "resume": 0.5,
            "recompute": 2.0,
            "warmup": 2.5,  # the end of iteration 3 at 5.5 s, the reference's at 3 s
            "slower": 1.0,  # iterations 4 and 5: 3 s against 2 x T
            "other": 0.25,
            "short": 7.25,  # ETTR 0.5 needs a wall of 10 s
        }
    )
    assert sum(v for k, v in lost.items() if k not in ("lost", "short")) == pytest.approx(lost["lost"])


def test_accounting_is_carried_across_a_torchrun_restart(tmp_path, monkeypatch, capsys):
    """A stopping worker keeps its accounting; the next generation of the same run goes on with it and
    counts the time from the stop as recovery. Another run's record, or a malformed one, is not carried."""
    path = tmp_path / "accounting-rank00000.json"
    first = RunAccounting(first_step=1, tokens_per_step=8, path=path)
    first.started_unix = 1000.0
    for step in (1, 2, 3):
        first.iteration(step, 1.0)
    first.keep({"run_id": "r", "attempt": 0}, stopped_unix=1004.0)
    monkeypatch.setattr("trainer.records.accounting.time.time", lambda: 1010.0)
    second = RunAccounting(first_step=3, tokens_per_step=8, path=path)  # resumed at 3 after a rollback
    second.carry_on({"run_id": "r", "attempt": 1})
    assert (second.first_step, second.high_water, second.productive_s) == (1, 3, 3.0)
    assert (second.failures, second.recovery_s, second.elapsed()) == (1, 6.0, 10.0)
    second.iteration(3, 1.0)
    assert second.recompute_s == 1.0 and path.exists()  # kept until the run finishes
    second.keep({"run_id": "r", "attempt": 1}, stopped_unix=1012.0)  # a node joins: torchrun counts no restart
    third = RunAccounting(first_step=3, tokens_per_step=8, path=path)
    third.carry_on({"run_id": "r", "attempt": 1})
    # the join's restart costs its seconds (none here: the clock stands still) but is no failure
    assert (third.first_step, third.failures, third.recomputed) == (1, 1, 1)
    for name, note in (
        ({"run_id": "other", "attempt": 1}, "of another run"),
        (
            {"run_id": "r", "attempt": 0},
            None,
        ),
    ):
        fresh = RunAccounting(first_step=1, tokens_per_step=8, path=path)
        fresh.carry_on(name)
        assert fresh.failures == 0 and fresh.high_water == 0
        if note:
            assert note in capsys.readouterr().out
    assert not path.exists()  # a first attempt removes an earlier launch's record
    malformed = b'{"run_id": "r", "attempt": 0, "accounting": {"high_water": "3"}}'
    path.write_bytes(seal(malformed))
    RunAccounting(1, 8, path).carry_on({"run_id": "r", "attempt": 1})
    assert "malformed" in capsys.readouterr().out
    path.write_bytes(malformed)  # not sealed: not a record this program wrote
    RunAccounting(1, 8, path).carry_on({"run_id": "r", "attempt": 1})
    assert "not a sealed record" in capsys.readouterr().out
    second.drop()
    assert not path.exists()


def test_ettr_benchmark_rejects_variants_of_the_fault_free_reference(tmp_path):
    with pytest.raises(SystemExit, match="none@training.cpu_reuse_memory=false: `none` is the fault-free"):
        ettr_main(
            ["--strategies", "none,none@training.cpu_reuse_memory=false,moevement", "--out", str(tmp_path / "out")]
        )
    assert not (tmp_path / "out").exists()  # nothing written on bad input


# ---- end to end ----------------------------------------------------------------------------------------

_reference: list[str] = []


def reference() -> str:
    if not _reference:
        _reference.append(run_cli(*BASE, nproc=2).stdout)
    return _reference[0]


def baseline_run(tmp_path: Path, strategy: str, *extra: str) -> str:
    return run_cli(
        *BASE,
        "--checkpoint.strategy",
        strategy,
        "--checkpoint.host_dir",
        str(tmp_path / "shm"),
        "--checkpoint.persist_dir",
        str(tmp_path / "disk"),
        *extra,
        nproc=2,
    ).stdout


def baseline_recoveries(out: str) -> list[RecoveryReport]:
    """The recovery lines of an interval baseline (`strategy=<s> snapshots_from=...`) a run recorded."""
    return [r for r in recoveries(out) if r.strategy is not None]


def test_overhead_benchmark_measures_after_the_first_window_of_changing_windows():
    """Windows follow the profile and may change size; steady state starts after the first one
    and the second one's first iteration."""
    from benchmarks.overhead import common_start, steady_ms, steady_start, whole_windows

    sizes = {t: 0 for t in (1, 2)} | {t: 7 for t in range(3, 10)} | {t: 13 for t in range(10, 17)}
    records = {t: {"window": float(w), "ckpt_mb": float(t)} for t, w in sizes.items()}
    assert steady_start(records, 2) == 11
    assert [r["ckpt_mb"] for r in whole_windows(records, 2)] == list(range(3, 10))  # 10-22 is incomplete
    fault_free = {t: {"window": 0.0, "tok_per_s": 1000.0 * t} for t in range(1, 17)}
    assert steady_start(fault_free, 2) == 4 and whole_windows(fault_free, 2) == []
    # both are measured over the iterations steady in each: 11-16, not 4-16 for the run without windows
    assert common_start([fault_free, records], 2) == 11
    assert steady_ms(fault_free, 2, tokens=1000, start=11) == pytest.approx([1e3 / t for t in range(11, 17)])


@pytest.mark.slow
def test_gemini_poisson_failures_roll_every_rank_back_and_recompute_exactly(tmp_path):
    plan = FaultPlan(mtbf_iters=4, seed=6, world=2, last_step=14)
    assert len(plan.events) >= 3
    out = baseline_run(tmp_path, "gemini", "--checkpoint.interval", "3", "--fault.mtbf_iters", "4", "--fault.seed", "6")
    found = baseline_recoveries(out)
    assert [r.step for r in found] == [e.step for e in plan.events]
    for r in found:
        assert r.scope == (0, 1) and r.strategy == "gemini"  # global: both stages roll back
        assert r.rollback_to <= r.step and r.replayed == r.step - r.rollback_to
        if r.rollback_to > 1:
            [rank] = r.ranks
            assert r.snapshots_from == (f"rank{rank}: replica on rank{1 - rank}",)
    acct = accounting(out)
    assert acct.failures == len(plan.events)
    assert acct.recomputed == sum(r.replayed for r in found) > 0  # run again by the loop, none replayed
    assert step_losses(out) == step_losses(reference())
    assert final_line(out) == final_line(reference())


@pytest.mark.slow
def test_checkfreq_recovers_from_disk_exactly(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("iteration,rank\n9,0\n")
    out = baseline_run(tmp_path, "checkfreq", "--checkpoint.interval", "4", "--fault.trace", str(trace))
    [r] = baseline_recoveries(out)
    assert (r.step, r.ranks, r.scope, r.rollback_to, r.strategy) == (9, (0,), (0, 1), 7, "checkfreq")
    assert "; ".join(r.snapshots_from).startswith("rank0: disk ") and (tmp_path / "disk").is_dir()
    assert final_line(out) == final_line(reference())


@pytest.mark.slow
def test_moc_restores_stale_experts_and_loses_tokens(tmp_path):
    """MoC checkpoints every iteration (its own interval), K_pec = 2 of 8 experts: a failure at 10 rolls back
    to the checkpoint of 9 with stale experts, loses tokens (PLT over every routed assignment so far, as the
    ETTR benchmark counts them) and doubles K_pec; a rerun under the same failure is the same run."""
    args = ("--checkpoint.moc_experts", "2", "--fault.at", "10:1")
    for run in ("first", "again"):
        (tmp_path / run).mkdir()
    out = baseline_run(tmp_path / "first", "moc", *args)
    [r] = baseline_recoveries(out)
    assert (r.step, r.scope, r.rollback_to, r.strategy) == (10, (0, 1), 9, "moc")
    routed = routed_per_iteration(load_config(DEBUG_CONFIG, BASE[2:]))  # 4 layers: 3 of them MoE
    assert r.lost_tokens > 0 and r.plt == pytest.approx(r.lost_tokens / (9 * routed), rel=1e-3)
    assert r.k_pec == 4  # PLT above 3.75%: K doubles
    assert accounting(out).lost_tokens == r.lost_tokens
    losses, ref = step_losses(out), step_losses(reference())
    assert [line.step for line in steps(out)] == list(range(1, 15))  # each once: the rerun of 9 is not logged
    assert all(losses[t] == ref[t] for t in range(1, 10))  # identical until the stale restore at 9
    assert losses[10] != ref[10]  # iteration 9 ran again on stale experts: what follows differs
    assert final_line(out)[2] != final_line(reference())[2]
    again = baseline_run(tmp_path / "again", "moc", *args)
    [r2] = baseline_recoveries(again)
    assert (r2.rollback_to, r2.lost_tokens, r2.plt, r2.k_pec) == (r.rollback_to, r.lost_tokens, r.plt, r.k_pec)
    assert final_line(again) == final_line(out)


def _six_iterations(folder, seconds: float, tokens: int) -> str:
    """The stdout of a fault-free run of 6 iterations of `seconds` each, its records written in `folder`."""
    folder.mkdir()
    for event in [*(_step(s, tokens / seconds, s * seconds) for s in range(1, 7)), _totals(6 * seconds, 6)]:
        append_event(folder, event)
    return f"run: {folder}\n"


def test_ettr_benchmark_brackets_each_strategy_with_fault_free_references(tmp_path, monkeypatch, capsys):
    """`none` runs before, between and after the strategies; each strategy's overhead and ETTR are taken
    against the mean of the two references adjacent to it, so a machine that drifts over the invocation
    does not show as checkpointing cost."""
    import benchmarks.ettr as ettr

    tokens = 8 * 256  # bench_moe's batch_size x seq_len
    reference_s = iter([1.0, 1.2, 1.4])
    launched = []

    def fake_launch(config, spec, steps, pp, flags, threads, restarts=0):
        launched.append(spec)
        seconds = next(reference_s) if spec == "none" else 1.21
        return _six_iterations(tmp_path / f"run-{len(launched)}", seconds, tokens)

    monkeypatch.setattr(ettr, "launch", fake_launch)
    argv = ["--strategies", "none,moevement,gemini", "--fault-mode", "wipe", "--seeds", "1", "--steps", "6"]
    ettr.main([*argv, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert launched == ["none", "moevement", "none", "gemini", "none"]
    overhead = dict(re.findall(r"^seed=1 strategy=(\w+) ettr=\S+ overhead=(\S+)", out, re.M))
    assert float(overhead["moevement"]) == pytest.approx(1.21 / 1.1 - 1, abs=1e-4)  # against (1.0 + 1.2) / 2
    assert float(overhead["gemini"]) == pytest.approx(1.21 / 1.3 - 1, abs=1e-4)  # against (1.2 + 1.4) / 2
    assert "references=3 none iteration_s=1.200 min=1.000 max=1.400 spread=0.3333" in out
    # ETTR: the bracketing references' wall clock for the 6 iterations (start-up included), (6.0 + 7.2) / 2
    ettr_of = dict(re.findall(r"^seed=1 strategy=(\w+) ettr=(\S+)", out, re.M))
    assert float(ettr_of["moevement"]) == pytest.approx(6.6 / 7.26, abs=1e-4)
    # gemini: (7.2 + 8.4) / 2 over 7.26 s; the median and range of its one seed
    assert re.search(r"^strategy=gemini seeds=1 ettr median=1\.0744 range=1\.0744-1\.0744 predicted_ettr", out, re.M)


def test_an_ettr_invocation_that_stopped_is_resumed_where_it_stopped(tmp_path, monkeypatch, capsys):
    """`--resume`, same arguments, same `--out`, same commit: the runs an invocation finished before it was
    stopped are read back from their logs, only the rest are launched, and the table (ettr.csv) is the one an
    uninterrupted invocation writes. Another invocation's folder, other code or uncommitted changes are
    refused."""
    import benchmarks.ettr as ettr
    import benchmarks.ettr_resume as ettr_resume

    tokens, launched, stopped = 8 * 256, [], []
    reference_s = {"whole": iter([1.0, 1.2, 1.4]), "parts": iter([1.0, 1.2, 1.4])}

    def fake_launch(config, spec, steps, pp, flags, threads, restarts=0):
        invocation = "whole" if ettr_args[-1][1].endswith("whole") else "parts"
        if invocation == "parts" and not stopped and spec == "gemini":
            stopped.append(spec)
            raise SystemExit("stopped")  # the first sitting ends before gemini's run
        launched.append(spec)
        seconds = next(reference_s[invocation]) if spec == "none" else 1.21
        return _six_iterations(tmp_path / f"{invocation}-run-{len(list(tmp_path.glob('*-run-*')))}", seconds, tokens)

    monkeypatch.setattr(ettr, "launch", fake_launch)
    monkeypatch.setattr(ettr_resume, "code_version", lambda: "abc")
    argv = ["--strategies", "none,moevement,gemini", "--fault-mode", "wipe", "--seeds", "1", "--steps", "6"]
    ettr_args = [["--out", str(tmp_path / "whole")]]
    ettr.main([*argv, *ettr_args[-1]])
    ettr_args.append(["--out", str(tmp_path / "parts")])
    with pytest.raises(SystemExit, match="stopped"):
        ettr.main([*argv, *ettr_args[-1]])
    launched.clear()
    ettr.main([*argv, *ettr_args[-1], "--resume"])
    assert launched == ["gemini", "none"], launched
    assert "reused " in capsys.readouterr().out
    whole, parts = ((tmp_path / name / "ettr.csv").read_text() for name in ("whole", "parts"))
    assert parts == whole
    with pytest.raises(SystemExit, match="holds the runs of another invocation"):
        ettr.main([*argv[:-1], "7", *ettr_args[-1], "--resume"])
    for code in ("def", "abc+dirty"):
        monkeypatch.setattr(ettr_resume, "code_version", lambda code=code: code)
        with pytest.raises(SystemExit, match="were made by abc, this checkout is " + re.escape(code)):
            ettr.main([*argv, *ettr_args[-1], "--resume"])
    monkeypatch.setattr(ettr_resume, "code_version", lambda: "abc")
    first = (tmp_path / "parts" / "none-0.log").read_text().split("run: ")[1].strip()
    shutil.rmtree(first)
    with pytest.raises(SystemExit, match="none-0.log: the run's record folder is gone"):
        ettr.main([*argv, *ettr_args[-1], "--resume"])


def test_ettr_benchmark_draws_seeds_whose_failures_match_the_nominal_mtbf(capsys):
    """`--seeds auto`: the first seeds whose Poisson draw holds steps / MTBF failures, so the realized MTBF is
    the nominal one; a given list is taken as is, its pooled realized MTBF flagged when 20% off."""
    from benchmarks.ettr import choose_seeds, parse_args, print_schedule

    args, _ = parse_args(["--steps", "300", "--mtbf-iters", "100"])
    seeds = choose_seeds(args)
    assert len(seeds) == 3 and all(len(poisson_events(100, s, 2, 300)) == 3 for s in seeds)
    assert all(len(poisson_events(100, s, 2, 300)) != 3 for s in range(1, seeds[-1]) if s not in seeds)
    print_schedule(args, seeds)
    out = capsys.readouterr().out
    assert "pooled failures=9 iterations=900 realized_mtbf_iters=100.0 nominal_mtbf_iters=100\n" in out
    args, _ = parse_args(["--steps", "300", "--mtbf-iters", "100", "--seeds", "2"])  # seed 2 draws no failure
    print_schedule(args, choose_seeds(args))
    assert "realized_mtbf_iters=inf nominal_mtbf_iters=100 (MORE THAN 20% OFF" in capsys.readouterr().out
