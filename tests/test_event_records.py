"""The run record's events (trainer/records/event_log.py) in this process: each kind reads back into its printed
line byte for byte, the newest logged iteration is read from the file's end, and the metrics logger logs each
iteration once (a rollback's rerun is not logged again; a later rank 0 logs, late, what its predecessor could
not). Real deaths: tests/test_run_record.py and tests/test_real_deaths.py."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moevement.recovery.report import RecoveryReport, RecoveryWork
from tests.helpers import DEBUG_CONFIG, ROOT, run_events, steps
from trainer import event_writer
from trainer.checkpoint import events
from trainer.config import load_config
from trainer.lifecycle.shell_lines import FROZEN, REPLACED, SHELL_SILENT, ShellLine
from trainer.lifecycle.survivor_lines import DETECTED, PREEMPTED, REJOINS, START_FAILED, SurvivorLine
from trainer.records import event_log
from trainer.records.accounting_line import AccountingLine
from trainer.records.event_lines import ElasticLayout, FaultStrike, FinalLine, StepLine, ValidationLine, format_value
from trainer.records.metrics import MetricsLogger

EVENTS = [
    StepLine(3, (("loss", 5.123456789), ("lr", 0.00099961), ("window", 3), ("tflops", 1.5e-05), ("wall_s", 2.0))),
    StepLine(4, (("loss", 5.0), ("aux_loss", 0.01), ("lr", 0.001), ("grad_norm", 1.0)), late=True),
    ValidationLine(4, 4.2345678),
    ElasticLayout(2, 2, 1, 1, 4, 2, 2),
    FaultStrike(1, 9, "SIGKILL", "backward", 1796649424.6912),
    SurvivorLine(REJOINS, 0, 9, 77, 1796649394.1571, "a collective failed", "live state of iteration 9", 1, 5.0),
    SurvivorLine(START_FAILED, 1, pid=78, generation=2),
    SurvivorLine(DETECTED, 0, 9, how="a collective failed", kept="no live state", detected_unix=7.25),
    SurvivorLine(PREEMPTED, 2, 5, kept="nothing new to keep", resumes="a relaunch starts over"),
    ShellLine(REPLACED, "1", 100, "signal SIGKILL", 101, 1, 4, 1, 12.5),
    ShellLine(FROZEN, "1", 100, "frozen", silent_s=10.04, bound_s=10.0, bound_key="fault.heartbeat_timeout_s"),
    ShellLine(SHELL_SILENT, "1", 99, "stopped", silent_s=31.0, bound_s=30.0, bound_key="fault.timeout_s", by=100),
    RecoveryReport(7, (0,), (0,), 3, 4, 6.1354, 0.04, 4.0, 0.9, restart="replaced", detected_by=("rank1: x",)),
    RecoveryWork(1, "healthy", 0, 0),
    AccountingLine(4.5, 6, 3.0, 0.5, 1.0, 0.25, 1, 2, 2048.0, 0, 1.0, 0.5),
    events.CheckpointLoaded(10, "ck/step-10", 4.5123456),
    events.CheckpointLoaded(0, "hf", float("nan"), imported="deepseek-ai/x"),
    events.CheckpointOtherConfig("ck/step-10", ("training.lr (saved 0.003, this run 0.001)",)),
    events.FreshStart("ck"),
    events.FreshStart("ck", (10, 20)),
    events.CheckpointFallback(20, "ck/step-20", "model-00000.safetensors: sha256 differs"),
    events.CheckpointSaved(20, "ck/step-20", 0.25),
    events.CheckpointNotSaved(30, "ck/step-30", "No space left on device"),
    events.CheckpointPruned(10, "ck/step-10", 2),
    events.CheckpointNotPruned("ck/step-10", 2, "holds notes.txt"),
    events.FinalCheckpointSaved(12, "final"),
    FinalLine(12, 4.05695, "ab" * 32),
]


def test_every_kind_reads_back_into_its_printed_line(tmp_path):
    for event in EVENTS:
        event_writer.append_event(tmp_path, event)
    lines = (tmp_path / event_writer.EVENTS).read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == [event.KIND for event in EVENTS]
    assert [event.line() for event in event_log.read_events(tmp_path)] == [event.line() for event in EVENTS]
    assert set(event_log.KINDS) == {event.KIND for event in EVENTS}


def test_a_step_line_keeps_its_format_and_a_printed_number_prints_the_same():
    line = EVENTS[0]
    assert line.line() == "step=3 loss=5.123457 lr=9.996e-04 window=3 tflops=1.500e-05 wall_s=2.000000"
    assert EVENTS[1].line().endswith(" grad_norm=1.000000 (logged late: the rank that logs it died first)")
    # 0.00099996 prints as 1.000e-03 in %.3e, which reads back as 0.001: printed with 6 decimals instead
    for value in (0.00099996, 0.00099994, 1e-3, 0.0, -2.5e-7, 123.4567891):
        assert format_value(float(format_value(value))) == format_value(value), value
    assert format_value(0.00099996) == "0.001000" and format_value(0.00099994) == "9.999e-04"


def test_the_newest_step_is_read_from_the_end_of_a_long_file(tmp_path):
    assert event_log.last_step(tmp_path) == 0  # no file yet
    fields = tuple((f"field_{i}", float(i)) for i in range(40))  # about 1 KB a record: 200 KB in all
    for step in range(1, 201):
        event_writer.append_event(tmp_path, StepLine(step, fields))
    for _ in range(100):  # more than one read of the file's end after the last step
        event_writer.append_event(tmp_path, RecoveryWork(1, "failed", 4, 4, 2, "rank0", (("forward", 1.0),) * 60))
    assert event_log.last_step(tmp_path) == 200


@pytest.fixture
def recording(tmp_path):
    """This process records its events in `tmp_path` for the duration."""
    event_writer.record_events_in(tmp_path)
    yield tmp_path
    event_writer.record_events_in(None)


def logger(folder, continued: bool) -> MetricsLogger:
    cfg = load_config(str(ROOT / DEBUG_CONFIG), ["--metrics.log_every", "2", "--metrics.tensorboard_every", "100"])
    return MetricsLogger(cfg, rank=0, stage=0, run_dir=folder, continued=continued)


def log_steps(metrics: MetricsLogger, iterations: list[int]) -> None:
    for step in iterations:
        scalars = {"loss": 5.0 - step / 10, "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0}
        metrics.step(step, scalars, {}, {}, elapsed_s=0.5, wall_s=float(step))


def test_each_iteration_is_logged_once_and_a_later_rank_0_logs_what_its_predecessor_could_not(recording, capsys):
    """Guarantee: every iteration logged exactly once, whoever dies (a real death's run, recorded as printed:
    tests/test_real_deaths.py::test_sigkill_in_backward_is_replaced_in_place).
    Iterations 1-5, a rollback to 3 (3-5 run again: not logged again), 6; then a later generation's rank 0
    that continues the folder (`continued`) finds 6 logged, and after its recovery (iterations done up to 8)
    logs 7 and 8 late, from the strategy's scalar log; 9 on, as usual. Every `metrics.log_every` (2) line is
    printed once; TensorBoard has one `train/loss` point per iteration."""
    first = logger(recording, continued=False)
    first.start(1)
    log_steps(first, [1, 2, 3, 4, 5, 3, 4, 5, 6])
    first.close()
    second = logger(recording, continued=True)
    assert second.logged == 6
    second.start(9)
    kept = {t: {"loss": 5.0 - t / 10, "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0, "clip_coef": 1.0} for t in (7, 8)}
    second.catch_up(8, lambda first_step: {t: v for t, v in kept.items() if t >= first_step})
    log_steps(second, [9, 10])
    second.close()
    recorded = steps(recording)
    assert [(line.step, line.late) for line in recorded] == [(t, t in (7, 8)) for t in range(1, 11)]
    assert [dict(line.fields)["loss"] for line in recorded] == pytest.approx([5.0 - t / 10 for t in range(1, 11)])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step=")]
    assert printed == [line.line() for line in recorded if line.step % 2 == 0]
    tensorboard = EventAccumulator(str(recording))
    tensorboard.Reload()
    assert [e.step for e in tensorboard.Scalars("train/loss")] == list(range(1, 11))


def test_iterations_whose_scalars_are_not_kept_are_named_once(recording, capsys):
    first = logger(recording, continued=False)
    first.start(1)
    log_steps(first, [1, 2])
    first.close()
    second = logger(recording, continued=True)
    second.start(5)
    second.catch_up(4, lambda first_step: {})
    assert "log: iterations 3-4 were done but never logged (no scalars kept)" in capsys.readouterr().out
    assert [line.step for line in steps(recording)] == [1, 2] and run_events(recording)[-1].step == 2
