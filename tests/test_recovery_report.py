"""The `recovery step=` and `recovery work` console lines (docs/design/output-lines.md): one formatter for every
strategy, whose bytes are a contract, and the run record's JSON object of each line, which reads back into the same
line."""

from __future__ import annotations

import dataclasses
import json

from benchmarks.ablation import recovery_seconds
from benchmarks.ettr_runs import Run, RunTotals
from moevement.recovery.report import (
    RecoveryFigures,
    RecoveryReport,
    RecoveryWork,
    ShellFault,
    detect_seconds,
    fault_step,
    rank_list,
    stage_ranges,
)
from trainer.records.event_lines import FaultStrike, FinalLine


def read_back(event):
    """`event` as a reader of events.jsonl gets it: its record through JSON, read back."""
    return type(event).from_record(json.loads(json.dumps(event.record())))


def test_localized_recovery_line():
    report = RecoveryReport(10, (1, 3), (0, 1, 2, 5), 7, 3, 1.23456, 0.1, 0.2049, 0.3)
    line = report.line()
    assert line == (
        "recovery step=10 ranks=1+3 scope=0-2,5 rollback_to=7 replayed=3 seconds=1.235 "
        "(fetch=0.100 convert=0.205 catchup=0.300)"
    )
    record = report.record()
    assert (record["kind"], record["step"], record["ranks"], record["scope"]) == ("recovery", 10, [1, 3], [0, 1, 2, 5])
    assert (record["rollback_to"], record["replayed"], record["seconds"]) == (7, 3, 1.235)
    assert (record["fetch"], record["convert"], record["catchup"], record["restart"]) == (0.1, 0.205, 0.3, None)
    assert record["detect"] is None  # no clock saw the fault: the line leaves `detect` out
    assert read_back(report).line() == line


def test_rejoin_line_puts_the_restart_stages_before_fetch():
    report = RecoveryReport(
        step=9,
        ranks=(1,),
        scope=(1,),
        rollback_to=4,
        replayed=5,
        seconds=6.0,
        fetch=0.5,
        convert=3.0,
        catchup=1.0,
        restart_seconds=(("keep", 0.25), ("restart", 0.5), ("setup", 0.75)),
        restart="local",
        detected_by=("rank0: SIGTERM", "rank2: gloo error"),
        detect=2.5004,
    )
    line = report.line()
    assert line == (
        "recovery step=9 ranks=1 scope=1 rollback_to=4 replayed=5 seconds=6.000 (keep=0.250 restart=0.500 "
        'setup=0.750 fetch=0.500 convert=3.000 catchup=1.000) detect=2.500 restart=local detected_by="rank0: '
        'SIGTERM; rank2: gloo error"'
    )
    assert report.parts() == {"keep": 0.25, "restart": 0.5, "setup": 0.75, "fetch": 0.5, "convert": 3.0, "catchup": 1.0}
    record = report.record()
    assert record["restart_seconds"] == {"keep": 0.25, "restart": 0.5, "setup": 0.75}
    assert (record["restart"], record["detected_by"]) == ("local", ["rank0: SIGTERM", "rank2: gloo error"])
    assert record["detect"] == 2.5
    assert read_back(report).line() == line
    later = dataclasses.replace(report, seconds=8.0)
    run = Run([], RunTotals(20.0, 9, 12.0, 0.0, 8.0, 2, 5, 0.0), [report, later], None)
    assert recovery_seconds(run) == (7.0, 3.0, 1.0)


def test_baseline_line_with_no_failed_rank_and_lost_tokens():
    report = RecoveryReport(
        6, (), (0,), 4, 2, 0.5, 0.25, 0.0, strategy="moc", snapshots_from=(), lost_tokens=12.4, plt=0.01, k_pec=2
    )
    report = dataclasses.replace(report, restart="global", detect=0.0)
    line = report.line()
    assert line == (
        "recovery step=6 ranks=none scope=0-0 rollback_to=4 replayed=2 seconds=0.500 "
        '(fetch=0.250 convert=0.000 catchup=0.000) detect=0.000 strategy=moc snapshots_from="" '
        "lost_tokens=12 plt=0.0100 k_pec=2 restart=global"
    )
    record = report.record()
    assert (record["ranks"], record["scope"], record["strategy"], record["snapshots_from"]) == ([], [0], "moc", [])
    assert (record["lost_tokens"], record["plt"], record["k_pec"], record["restart"]) == (12, 0.01, 2, "global")
    assert read_back(report).line() == line


def test_whole_job_restart_line_names_every_ranks_copy():
    copies = ("rank0: local shared memory", "rank1: replica on rank0")
    report = RecoveryReport(9, (0, 1), (0, 1), 6, 3, 2.0, 0.5, 1.5, restart="global", snapshots_from=copies)
    line = report.line()
    assert line == (
        "recovery step=9 ranks=0+1 scope=0-1 rollback_to=6 replayed=3 seconds=2.000 (fetch=0.500 convert=1.500 "
        'catchup=0.000) restart=global snapshots_from="rank0: local shared memory; rank1: replica on rank0"'
    )
    assert read_back(report).line() == line


def test_recovery_work_lines():
    failed = RecoveryWork(1, "failed", 8, 8, 3, "rank0", (("load", 0.123), ("forward", 1.0), ("optimizer", 0.004)))
    assert failed.line() == (
        "recovery work rank=1 role=failed forwards=8 backwards=8 threads=3 snapshots_from=rank0 "
        "replay_s=load:0.12,forward:1.00,optimizer:0.00"
    )
    assert failed.record()["replay_s"] == {"load": 0.12, "forward": 1.0, "optimizer": 0.0}
    healthy = RecoveryWork(0, "healthy", 0, 0)
    assert healthy.line() == "recovery work rank=0 role=healthy forwards=0 backwards=0"
    assert healthy.record() == {
        "kind": "recovery_work",
        "rank": 0,
        "role": "healthy",
        "forwards": 0,
        "backwards": 0,
        "threads": 0,
        "snapshots_from": None,
        "replay_s": {},
        "build_s": None,
        "prebuilt": None,
    }
    # after a rejoin: each rank's build of its data, model and optimizer, and what a warm standby had built
    replaced = dataclasses.replace(failed, build_s=0.2849, prebuilt="data+model")
    assert replaced.line() == (
        "recovery work rank=1 role=failed forwards=8 backwards=8 threads=3 snapshots_from=rank0 build_s=0.28 "
        "prebuilt=data+model replay_s=load:0.12,forward:1.00,optimizer:0.00"
    )
    assert (replaced.record()["build_s"], replaced.record()["prebuilt"]) == (0.28, "data+model")
    works = (failed, healthy, replaced)
    assert [read_back(w).line() for w in works] == [w.line() for w in works]


def test_fault_and_final_lines():
    crash = FaultStrike(1, 8)
    assert crash.line() == "fault: rank 1 crashes at step 8"
    kill = FaultStrike(0, 9, "SIGKILL", "backward", 1795649689.5104)
    assert kill.line() == "fault: rank 0 killed (SIGKILL) in the backward phase of step 9 at unix=1795649689.510"
    hang = FaultStrike(2, 9, "SIGSTOP", "backward", 12.0)
    assert hang.line() == "fault: rank 2 stopped (SIGSTOP) in the backward phase of step 9 at unix=12.000"
    assert kill.record() == {
        "kind": "fault",
        "rank": 0,
        "step": 9,
        "how": "SIGKILL",
        "phase": "backward",
        "unix": 1795649689.51,
    }
    final = FinalLine(60, 2.6161334, "b0" * 32)
    assert final.line() == f"final step=60 loss=2.616133 state_digest={'b0' * 32}"
    assert final.record() == {"kind": "final", "step": 60, "loss": 2.616133, "state_digest": "b0" * 32}
    assert [read_back(e).line() for e in (crash, kill, hang, final)] == [e.line() for e in (crash, kill, hang, final)]


def test_detection_is_timed_from_the_earliest_fault_a_shell_saw_and_names_its_iteration():
    faults = [None, ShellFault(100.5, 7), ShellFault(101.0, 6)]
    assert detect_seconds(110.0, faults) == 9.5
    assert fault_step(faults) == 6  # the earliest iteration a death struck in
    assert detect_seconds(110.0, [None, None]) is None  # no clock saw the fault (a torchrun restart)
    assert fault_step([None, ShellFault(100.0)]) is None  # a trainer dead before beginning an iteration
    assert detect_seconds(None, [ShellFault(100.0)]) is None
    assert detect_seconds(99.9, [ShellFault(100.0)]) == 0.0  # clocks a little apart never give a negative time
    report = RecoveryReport(8, (1,), (1,), 5, 3, 2.0, 0.1, 0.2, detect=0.5, fault_step=7, restart="replaced")
    assert " detect=0.500 fault_step=7 restart=replaced" in report.line()
    assert report.record()["fault_step"] == 7 and read_back(report).line() == report.line()


def test_a_recoverys_figures_count_replays_only_where_the_recovery_ran_them():
    """MoEvement's stages replay inside the recovery; a baseline's rollback leaves its iterations to the
    training loop, which counts them itself."""
    moevement = RecoveryReport(10, (1,), (1,), 6, 4, 2.0, 0.1, 0.2, detect=3.0)
    assert (RecoveryFigures.of(moevement, {1}, 1).replays, RecoveryFigures.of(moevement, {1}, 1).detect) == (4, 3.0)
    gemini = RecoveryReport(10, (1,), (0, 1), 6, 4, 2.0, 0.1, 0.0, strategy="gemini", snapshots_from=())
    assert (RecoveryFigures.of(gemini, {1}, 2).replays, RecoveryFigures.of(gemini, {1}, 2).detect) == (0, 0.0)


def test_range_lists():
    assert [stage_ranges(s) for s in ([], [3], [2, 0, 1], [0, 1, 3, 5, 6])] == ["", "3", "0-2", "0-1,3,5-6"]
    assert [rank_list(r) for r in ([], [0], range(4), {7, 2})] == ["", "0", "0+1+2+3", "2+7"]
