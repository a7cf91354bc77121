"""A node lost for good (`parallelism.elastic`, parallelisms/elastic.py): the job keeps training on the nodes
that remain and grows back when the node returns, in the layout the world allows, and ends with the state
of the reference that stops, saves and relaunches each layout from that checkpoint."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from benchmarks.emulated_nodes import GROWABLE, Output, free_port, start_node
from parallelisms.distributed import store_round
from parallelisms.elastic import ElasticError, elastic_layout, fitting_worlds
from parallelisms.mesh import ParallelismConfig
from tests.helpers import (
    CHILD_ENV,
    accounting,
    after,
    base_args,
    final_line,
    run_cli,
    run_events,
    step_losses,
    steps,
    survivors,
)
from trainer.checkpoint.identity import RunIdentity
from trainer.config import Config, ConfigError, fit_world, load_config
from trainer.records.event_lines import ElasticLayout, StepLine

CONFIGURED = ["--parallelism.pp", "2", "--parallelism.dp", "2", "--parallelism.elastic"]


def elastic_args(pp: int = 2, steps: int = 40) -> list[str]:
    """`steps` iterations of an elastic job configured at `pp` stages and dp = 2, a dense checkpoint every 4."""
    configured = ["--parallelism.pp", str(pp), "--parallelism.dp", "2", "--parallelism.elastic"]
    return [*base_args(steps), *configured, "--checkpoint.dense_interval", "4", "--job.name", "elastic"]


ELASTIC = elastic_args()
# A window re-laid with W > 1 replays W - 1 iterations in the new layout with weights the old one computed: the
# reduction order moves the losses of the first iterations after it by about 1e-6 of their value; a tensor
# re-laid wrong or a slot left out moves them by orders more (the last slot left out: 5e-2). Later, Adam and
# the router amplify any difference of bits, by about 100x in 20 iterations here, to whole percents of the
# weights over a hundred: only the first iterations after a re-lay tell.
RELAID_LOSS_RTOL = 1e-4
RELAID_CHECKED = 5


@pytest.mark.parametrize(
    ("world", "dp", "micro_batches"),
    [(8, 4, 2), (4, 2, 4), (2, 1, 8)],
)
def test_the_rule_keeps_the_pipeline_and_the_rows_of_a_micro_batch(world, dp, micro_batches):
    layout = elastic_layout(ParallelismConfig(pp=2, dp=2), micro_batches=4, world=world)
    assert (layout.parallelism.pp, layout.parallelism.dp, layout.micro_batches) == (2, dp, micro_batches)


@pytest.mark.parametrize(
    ("configured", "world", "why"),
    [
        (ParallelismConfig(pp=2, dp=2), 3, "cannot hold parallelism.pp = 2"),
        (ParallelismConfig(pp=1, dp=4, ep=4), 2, "parallelism.ep = 4 does not divide"),
        (ParallelismConfig(pp=1, dp=2), 3, "cannot split the 4 micro-batch shares"),
        (ParallelismConfig(pp=2, dp=2), 8, "fewer than the pipeline's 2 stages"),
    ],
)
def test_a_world_no_layout_fits_is_refused_with_why(configured, world, why):
    with pytest.raises(ElasticError, match=why):
        elastic_layout(configured, micro_batches=2, world=world)


def test_the_worlds_a_job_can_shrink_to_are_those_a_layout_fits():
    """pp=2, dp=4, 2 micro-batches: 8 shares per iteration, which 3 data-parallel ranks cannot split."""
    fits = fitting_worlds(ParallelismConfig(pp=2, dp=4), micro_batches=2)
    assert [(world, fit.parallelism.dp, fit.micro_batches) for world, fit in fits] == [(2, 1, 8), (4, 2, 4), (8, 4, 2)]


def _elastic_config(*extra: str) -> Config:
    return load_config("train_configs/debug_moe.toml", [*CONFIGURED, "--checkpoint.dense_interval", "4", *extra])


def test_a_fitted_config_names_its_checkpoints_as_the_configured_one_does():
    configured = _elastic_config()
    fitted = fit_world(configured, 2)
    assert (fitted.parallelism.dp, fitted.training.micro_batches) == (1, 4)
    assert configured.parallelism.dp == 2  # the configured layout is left as it was
    assert RunIdentity.of_dense(fitted).mismatch(RunIdentity.of_dense(configured).to_json()) == []
    other_rows = fit_world(_elastic_config("--training.micro_batches", "4"), 4)
    assert RunIdentity.of_dense(other_rows).mismatch(RunIdentity.of_dense(configured).to_json())


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["--checkpoint.dense_interval", "0"], "parallelism.elastic"),
        (["--checkpoint.strategy", "gemini", "--checkpoint.persist_dir", "/tmp/x"], "checkpoint.persist_dir"),
        (["--checkpoint.load_step", "0"], "checkpoint.load_step"),
    ],
)
def test_an_elastic_job_needs_dense_checkpoints_to_resume_from(extra, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        _elastic_config(*extra)


def test_an_elastic_moevement_job_may_persist_windows_it_re_lays_from():
    cfg = _elastic_config("--checkpoint.strategy", "moevement", "--checkpoint.persist_dir", "/tmp/x")
    assert cfg.checkpoint.persist_dir == "/tmp/x"


def test_a_round_is_named_alike_on_nodes_that_count_different_restarts(monkeypatch):
    """Where every torchrun round's workers get a store of their own, a node that came back (0 restarts)
    and one that stayed (1 restart) meet on the same keys; on the agent's shared store, restarts name rounds."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    names = set()
    for restarts in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restarts)
        names.add(store_round())
    assert len(names) == 1
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert store_round() == "attempt1"


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 1])
def test_a_death_in_an_elastic_moevement_job_is_replaced_in_place(tmp_path, killed):
    """Within a torchrun round nothing changes: a SIGKILLed worker's standby takes its place (no torchrun
    restart is allowed), only its stage replays, and the run ends with the fault-free digest. Every round has
    a store of its own, as a job that grows back needs, kept by rank 0's shell: rank 0's death leaves it."""
    layout = [*base_args(16), "--parallelism.pp", "2", "--parallelism.elastic", "--checkpoint.dense_interval", "4"]
    moevement = ["--checkpoint.strategy", "moevement", "--checkpoint.window", "3"]
    out = run_cli(
        *layout,
        *moevement,
        *("--checkpoint.host_dir", str(tmp_path / "shm"), "--fault.kill", f"9:{killed}:backward"),
        *("--job.output_dir", str(tmp_path / "killed")),
        nproc=2,
        torchrun=("--max-restarts=0",),
        env=GROWABLE,
    ).stdout
    assert "restart=replaced" in out, out
    reference = run_cli(*layout, "--job.output_dir", str(tmp_path / "reference"), nproc=2).stdout
    assert final_line(out) == final_line(reference)


def _reference(tmp_path, segments: list[tuple[int, int]], *extra: str, job: list[str] = ELASTIC) -> list[str]:
    """stdout of each of the reference's runs of `job`: each (processes, last iteration) segment launched from
    the checkpoint the one before saved at its end, in a folder of its own (`extra`: more arguments)."""
    load: list[str] = []
    outs = []
    for i, (nproc, last) in enumerate(segments):
        saved = tmp_path / f"reference-{i}"
        out = run_cli(
            *job,
            *("--job.output_dir", str(tmp_path / f"reference-runs-{i}")),
            *("--training.stop_at", str(last), "--checkpoint.save_final", str(saved), *load, *extra),
            nproc=nproc,
        ).stdout
        outs.append(out)
        load = ["--checkpoint.load", str(saved)]
    return outs


@pytest.mark.parametrize(
    ("strategy", "pp", "last"),
    [
        # the default suite's elastic lose-and-return, one process a node. The shrunk round's one process trains
        # fast: under load it ran some 20 iterations past its first save before node 1 was back; 60 leave room
        pytest.param("none", 1, 60, id="none-pp1"),
        pytest.param("none", 2, 40, id="none", marks=pytest.mark.slow),
        pytest.param("gemini", 2, 40, id="gemini", marks=pytest.mark.slow),
    ],
)
def test_a_node_lost_for_good_shrinks_the_job_and_its_return_grows_it_back(tmp_path, strategy, pp, last):
    """Each of the two nodes runs `pp` processes (one data-parallel replica of the pipeline): node 1 lost for
    good, the job trains on at dp = 1 from the newest dense checkpoint, and grows back to dp = 2 from the
    newest one when node 1 returns, ending with the state of the reference chain. With a checkpoint strategy,
    the rank shells' survivors wait for replacements until node 1 has said nothing for `fault.node_loss_s`
    (5 s, where a join is bounded by 2 x `fault.timeout_s` = 240 s), then torchrun restarts them from the
    newest dense checkpoint (gemini takes none newer here); the reference is the same chain without
    checkpointing. (A newer checkpoint in host memory is re-laid: the test below.)"""
    full, shrunk, job_args = 2 * pp, pp, elastic_args(pp, last)
    output, port, job = Output(), free_port(), f"elastic-{os.getpid()}"
    args = [*job_args, "--job.output_dir", str(tmp_path / "runs"), "--checkpoint.strategy", strategy]
    if strategy != "none":
        args += ["--fault.timeout_s", "120", "--fault.node_loss_s", "5", "--checkpoint.host_dir", str(tmp_path / "shm")]
        args += ["--checkpoint.interval", "1000"]
    second = start_node(1, port, job, pp, args, CHILD_ENV, output)  # waits for the first's store
    first = start_node(0, port, job, pp, args, CHILD_ENV, output)
    _, at = output.wait_for(rf"elastic: {full} processes: pp={pp} dp=2 ")
    at = output.wait_for_record(lambda e: isinstance(e, StepLine) and e.step >= 10)
    second.lose()
    if strategy != "none":
        _, at = output.wait_for(r"restart: generation 1 will not form: node 1 has said nothing", at, timeout_s=60)

    _, at = output.wait_for(rf"elastic: {shrunk} processes: pp={pp} dp=1 ep=1 micro_batches=4 ", at)
    shrunk_from, at = output.wait_for(r"checkpoint: loaded step (\d+) ", at)
    saved, at = output.wait_for(r"checkpoint: saved step (\d+) ", at)  # trained on, on one node
    back = start_node(1, port, job, pp, args, CHILD_ENV, output)
    _, at = output.wait_for(rf"elastic: {full} processes: pp={pp} dp=2 ", at)
    grown, at = output.wait_for(r"checkpoint: loaded step (\d+) ", at)
    assert first.wait(300) == 0 and back.wait(300) == 0, output.text()

    t1, t2 = int(shrunk_from[1]), int(grown[1])
    assert 8 <= t1 <= 10 and t1 < int(saved[1]) <= t2, output.text()
    reference = _reference(tmp_path, [(full, t1), (shrunk, t2), (full, last)], job=job_args)[-1]
    events = run_events(output.text())  # one run folder: rank 0's node continues it in every round
    assert final_line(events) == final_line(reference)
    layouts = [e for e in events if isinstance(e, ElasticLayout)]
    assert [(e.world, e.dp) for e in layouts] == [(full, 2), (shrunk, 1), (full, 2)], events
    # each iteration once (those redone after a shrink or a grow are not logged again): the last round's own
    # are the reference's, which relaunched from the same checkpoint
    assert [line.step for line in steps(events)] == list(range(1, last + 1))
    last_round = step_losses(after(events, layouts[-1]))
    assert last_round and last_round == {s: v for s, v in step_losses(reference).items() if s in last_round}
    if strategy != "none":  # the survivors waited for replacements, said so and gave up on node 1
        assert {(e.what, e.rank) for e in survivors(events)} >= {("rejoins", 0), ("rejoins", 1)}, events
    # the shrink is a failure with its seconds; the grow-back's restart costs seconds but is no failure
    acct = accounting(events)
    assert acct.failures == 1 and acct.recovery_s > 0 and acct.iterations == last, acct


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "window"), [("moevement", 1), ("moevement", 3), ("gemini", 1), ("checkfreq", 1)])
def test_a_lost_and_returned_node_resume_from_windows_re_laid_from_host_memory(tmp_path, strategy, window):
    """MoEvement resumes each round from the newest window in host memory, re-laid into the round's layout,
    not from an older dense checkpoint (none is due); so do gemini and checkfreq from their newest checkpoint
    (taken every iteration here: a window of W = 1 of every operator; gemini's replicated, checkfreq's
    unreplicated but written to disk, where the lost node's parts are read). Each emulated node keeps its host
    memory in a directory of its own (a node is a host and its `checkpoint.host_dir`), and the lost node's
    goes with it: the shrink re-lays the survivors' windows and the replicas they hold of node 1's, the
    grow-back sends node 1's ranks their parts over the network. The reference chain stops before the
    iteration each round trains first (t0 + W - 1). With W = 1 nothing is replayed and the run is the
    reference's bit for bit; with W = 3 the new layout replays two iterations with weights the old one
    computed: the losses after each re-lay stay as close to the reference's as before it (below)."""
    output, port, job, steps = Output(), free_port(), f"relaid-{os.getpid()}", 160
    args = [*ELASTIC, "--job.output_dir", str(tmp_path / "runs"), *("--checkpoint.strategy", strategy)]
    args += ["--checkpoint.window", str(window)] if strategy == "moevement" else ["--checkpoint.interval", "1"]
    args += ["--training.steps", str(steps), "--fault.timeout_s", "120"]
    args += ["--checkpoint.dense_interval", "1000", "--fault.node_loss_s", "5"]
    shm = [tmp_path / "shm0", tmp_path / "shm1"]
    second = start_node(1, port, job, 2, [*args, "--checkpoint.host_dir", str(shm[1])], CHILD_ENV, output)
    first = start_node(0, port, job, 2, [*args, "--checkpoint.host_dir", str(shm[0])], CHILD_ENV, output)
    _, at = output.wait_for(r"elastic: 4 processes: pp=2 dp=2 ")
    at = output.wait_for_record(lambda e: isinstance(e, StepLine) and e.step >= 10)
    second.lose()
    shutil.rmtree(shm[1])
    _, at = output.wait_for(r"restart: generation 1 will not form: node 1 has said nothing", at, timeout_s=60)
    relaid = rf"restart: re-laid window (\d+) \(W={window}\) of dp=%d into dp=%d "
    shrunk, at = output.wait_for(relaid % (2, 1), at, timeout_s=120)
    t1 = int(shrunk[1]) + window - 1  # the first iteration the round trains
    # the iterations compared below ran on 2 ranks
    at = output.wait_for_record(lambda e: isinstance(e, StepLine) and e.step >= t1 + RELAID_CHECKED + 6)
    back = start_node(1, port, job, 2, [*args, "--checkpoint.host_dir", str(shm[1])], CHILD_ENV, output)
    grown, at = output.wait_for(relaid % (1, 2), at)
    assert first.wait(300) == 0 and back.wait(300) == 0, output.text()

    t2 = int(grown[1]) + window - 1
    assert 7 <= t1 <= 11 and t1 + RELAID_CHECKED < t2 < steps - RELAID_CHECKED, output.text()
    references = _reference(tmp_path, [(4, t1 - 1), (2, t2 - 1), (4, steps)], "--training.steps", str(steps))
    elastic = output.text()
    if window == 1:
        assert final_line(elastic) == final_line(references[-1])
        return
    # The shrunk round starts from the reference's state but for the W - 1 replayed iterations: its first
    # iterations agree to RELAID_LOSS_RTOL. The grown round starts from a state that already drifted from the
    # reference's (Adam and the router amplify bits): its re-lay may add no jump to that drift.
    # An iteration redone after a re-lay is not logged again: each round's own start at the first iteration
    # the round before had not reached.
    events = run_events(elastic)
    layouts = [e for e in events if isinstance(e, ElasticLayout)]
    firsts = [min(step_losses(after(events, layout))) for layout in layouts[1:]]
    assert t1 <= firsts[0] and firsts[0] + RELAID_CHECKED <= t2 <= firsts[1], (firsts, t1, t2)
    ours, theirs = step_losses(events), {**step_losses(references[1]), **step_losses(references[2])}
    drift = {t: abs(ours[t] - theirs[t]) / abs(theirs[t]) for t in ours if t in theirs}
    assert all(drift[t] <= RELAID_LOSS_RTOL for t in range(firsts[0], firsts[0] + RELAID_CHECKED)), drift
    before = max(drift[t] for t in range(t2 - 3, t2))
    assert all(drift[t] <= max(RELAID_LOSS_RTOL, 10 * before) for t in range(firsts[1], firsts[1] + 3)), drift


@pytest.mark.slow
def test_a_whole_job_lost_relaunches_on_fewer_ranks_from_a_window_re_laid_from_persist_dir(tmp_path):
    """The job dies with every node's host memory (rank 1 SIGKILLed, no replacement, torchrun gives up; the
    host directory removed). Relaunched on two ranks with an empty host directory, MoEvement re-lays the
    newest window every old rank wrote to persist_dir into dp = 1 (no dense checkpoint is due) and ends with
    the digest of the reference that stops before that window's iteration and relaunches on two ranks."""
    args = [*ELASTIC, *("--checkpoint.strategy", "moevement", "--checkpoint.window", "1")]
    args += ["--checkpoint.dense_interval", "1000", "--checkpoint.persist_dir", str(tmp_path / "disk")]
    args += ["--job.name", f"lost-{os.getpid()}"]
    died = run_cli(
        *args,
        *("--job.output_dir", str(tmp_path / "runs-0"), "--checkpoint.host_dir", str(tmp_path / "shm0")),
        *("--fault.kill", "12:1", "--fault.max_replacements", "0"),
        nproc=4,
        check=False,
        torchrun=("--max-restarts", "0"),
    )
    assert died.returncode != 0, died.stdout
    shutil.rmtree(tmp_path / "shm0")
    relaunched = run_cli(
        *args, *("--job.output_dir", str(tmp_path / "runs-1"), "--checkpoint.host_dir", str(tmp_path / "shm1")), nproc=2
    ).stdout
    relaid = re.search(r"restart: re-laid window (\d+) \(W=1\) of dp=2 into dp=1 from persist_dir", relaunched)
    assert relaid is not None, relaunched
    t1 = int(relaid[1])
    assert 6 <= t1 <= 12, relaunched
    references = _reference(tmp_path, [(4, t1 - 1), (2, 40)])
    assert final_line(relaunched) == final_line(references[-1])
