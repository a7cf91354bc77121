"""benchmarks/elastic.py: the costs of a job's restarts read from its stamped lines, and one run of the
elastic policy end to end."""

from __future__ import annotations

import math
import re
import sys
from dataclasses import asdict

import pytest

from benchmarks.elastic import Line, Restart, analyse
from tests.helpers import CHILD_ENV, ROOT, run_bounded
from trainer.lifecycle.survivor_lines import DETECTED, PREEMPTED, REJOINS, SurvivorLine
from trainer.records.event_lines import ElasticLayout, FinalLine, StepLine


def _stamped(*timeline: tuple[float, object]) -> list[Line]:
    """Lines read at the given times: a record's line with the record beside it, or a plain line."""
    return [
        Line(at, item + "\n") if isinstance(item, str) else Line(at, item.line() + "\n", item) for at, item in timeline
    ]


def _steps(first: int, last: int, at: float) -> list[tuple[float, StepLine]]:
    """`step` records of iterations first..last, one a second from `at`."""
    return [(at + i, StepLine(step, (("loss", 1.0), ("wall_s", 0.1)))) for i, step in enumerate(range(first, last + 1))]


FOUR = ElasticLayout(4, 2, 2, 1, 2, 2, 2)
TWO = ElasticLayout(2, 2, 1, 1, 4, 2, 2)


def _failed(rank: int, detected: float) -> SurvivorLine:
    return SurvivorLine(DETECTED, rank, 11, how="a collective failed", kept="no live state", detected_unix=detected)


# 4 ranks to step 10; node 1 lost at 111; 2 ranks from step 8 (9 and 10 redone, not logged again); node 1 back
# at 135; 4 ranks from step 12 (13 and 14 redone)
ELASTIC_RUN = _stamped(
    (100.0, FOUR),
    *_steps(1, 10, 101.0),
    (111.6, _failed(2, 111.5)),
    (111.7, _failed(3, 111.6)),
    (120.0, TWO),
    (121.0, "checkpoint: loaded step 8 from /x/checkpoints/step-8 (loss 1.000000)"),
    *_steps(11, 14, 124.0),
    (140.3, SurvivorLine(PREEMPTED, 0, 15, kept="no live state", detected_unix=140.2, resumes="x")),
    (150.0, FOUR),
    (151.5, "checkpoint: loaded step 12 from /x/checkpoints/step-12 (loss 1.000000)"),
    *_steps(15, 20, 154.0),
    (160.5, FinalLine(20, 0.9, "abc123")),
)


def _costs(restarts: list[Restart]) -> list[dict]:
    return [asdict(r) for r in restarts]


def test_each_restart_is_costed_from_its_cause_to_its_first_new_iteration():
    run = analyse("elastic", tokens=20 * 1024, lines=ELASTIC_RUN, causes=[111.0, 135.0], began=90.0, ended=170.0)
    shrink = {"world": 2, "detect_s": 0.5, "restart_s": 8.5, "load_s": 1.0, "resume_s": 3.0, "down_s": 13.0}
    grow = {"world": 4, "detect_s": 5.2, "restart_s": 9.8, "load_s": 1.5, "resume_s": 2.5, "down_s": 19.0}
    assert _costs(run.restarts) == [
        pytest.approx({**shrink, "lost_iters": 2}),
        pytest.approx({**grow, "lost_iters": 2}),
    ]
    assert (run.shrunk_s, run.wall_s, run.tokens_per_s) == pytest.approx((30.0, 80.0, 256.0))
    assert (run.final_step, run.digest) == (20, "abc123")
    costs = run.costs()
    assert (costs["lost_iters"], costs["down_s"]) == pytest.approx((4, 13.0 + 19.0))


def test_a_survivor_under_a_rank_shell_dates_the_detection_and_its_wait_counts_as_restart():
    """With a checkpoint strategy the survivors first wait for replacements (`fault.node_loss_s`): the wait
    lies between the survivor's detection and the smaller generation."""
    survivor = SurvivorLine(
        REJOINS,
        0,
        11,
        7,
        90.0,
        "a collective failed (Connection reset by peer)",
        "live state of iteration 11 in memory",
        1,
        111.4,
    )
    lines = _stamped(
        (100.0, FOUR),
        *_steps(1, 10, 101.0),
        (111.5, survivor),
        (121.5, "restart: generation 1 will not form: node 1 has said nothing on torchrun's store for 10 s"),
        (125.0, TWO),
        (126.0, "checkpoint: loaded step 8 from /x/checkpoints/step-8 (loss 1.000000)"),
        *_steps(11, 12, 129.0),
    )
    (shrink,) = analyse("elastic", tokens=1, lines=lines, causes=[111.0], began=90.0, ended=131.0).restarts
    assert (shrink.detect_s, shrink.restart_s, shrink.down_s) == pytest.approx((0.4, 13.6, 18.0))


def test_a_window_re_laid_from_host_memory_is_what_a_moevement_generation_resumes_from():
    """The dense checkpoint loaded first is older: the re-laid window (t0 = 9, W = 3: the state after iteration 10)
    is the state the generation resumes from, and its line ends the load."""
    lines = _stamped(
        (100.0, FOUR),
        *_steps(1, 12, 101.0),
        (113.6, _failed(2, 113.5)),
        (120.0, TWO),
        (121.0, "checkpoint: loaded step 8 from /x/checkpoints/step-8 (loss 1.000000)"),
        (122.5, "restart: re-laid window 9 (W=3) of dp=2 into dp=1 from host memory"),
        *_steps(13, 14, 126.0),
    )
    (shrink,) = analyse("elastic", tokens=1, lines=lines, causes=[113.0], began=90.0, ended=130.0).restarts
    assert (shrink.load_s, shrink.resume_s, shrink.lost_iters) == pytest.approx((2.5, 3.5, 2))


def test_a_job_that_waited_for_its_node_restarts_once_and_never_shrinks():
    lines = _stamped(
        (100.0, FOUR),
        *_steps(1, 10, 101.0),
        (111.6, _failed(2, 111.5)),
        (140.0, FOUR),
        (141.0, "checkpoint: loaded step 8 from /x/checkpoints/step-8 (loss 1.000000)"),
        *_steps(11, 20, 144.0),
    )
    run = analyse("wait", tokens=1, lines=lines, causes=[111.0, 135.0], began=90.0, ended=160.0)
    waited = {"world": 4, "detect_s": 0.5, "restart_s": 28.5, "load_s": 1.0, "resume_s": 3.0, "down_s": 33.0}
    assert _costs(run.restarts) == [
        pytest.approx({**waited, "lost_iters": 2})
    ]  # the cause of its detection: the loss, not the return
    assert run.shrunk_s == 0.0
    assert (run.final_step, run.digest) == (0, "none")  # no final line


def test_a_generation_started_after_the_last_iteration_counts_from_its_cause_and_runs_none():
    """The node came back while the workers were leaving after the final line: torchrun restarted them."""
    final = [line for line in ELASTIC_RUN if line.at <= 140.0]  # to step 14 on 2 ranks: the last iteration
    lines = [*final, *_stamped((140.5, FinalLine(14, 1.0, "abc")), (150.0, FOUR))]
    lines += _stamped((151.0, "checkpoint: loaded step 14 from /x/checkpoints/step-14 (loss 1.000000)"))
    run = analyse("elastic", tokens=14, lines=lines, causes=[111.0, 135.0], began=90.0, ended=152.0)
    after = run.restarts[1]
    assert (after.world, after.restart_s, after.load_s, after.lost_iters) == (4, 15.0, 1.0, 0)
    assert math.isnan(after.detect_s) and math.isnan(after.resume_s) and math.isnan(after.down_s)
    costs = run.costs()  # summed where measured
    assert (costs["restart_s"], costs["down_s"], run.shrunk_s) == pytest.approx((23.5, 13.0, 30.0))


@pytest.mark.slow
def test_the_benchmark_prints_the_elastic_policy_s_throughput():
    cmd = [sys.executable, "-m", "benchmarks.elastic", "--steps", "16", "--repair-s", "5", "--policies", "elastic"]
    proc = run_bounded(cmd, cwd=ROOT, env=CHILD_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = re.search(r"^policy=elastic tokens_per_s=([\d.]+) .* state_digest=\w+$", proc.stdout, re.M)
    assert line and float(line[1]) > 0, proc.stdout
    assert re.search(r"^event round=1 policy=elastic world=\d ", proc.stdout, re.M), proc.stdout
    assert re.search(r"^round=1 policy=elastic .* final_step=16 ", proc.stdout, re.M), proc.stdout
