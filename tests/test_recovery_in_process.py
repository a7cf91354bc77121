"""`moevement/recovery/localized.py:Recovery` driven directly, on the tiny MoE of `test_conversion`, operator by
operator: a rank's localized recovery from its peer's replicas (two real processes over gloo: the
replicas, the scalar log and the slowest-rank figures are collectives) and a whole-job restart from host
memory (one process). Every replayed iteration t starts from exactly the fault-free state_t, so a
broken step names its operator and iteration instead of a final digest (the end-to-end runs under
torchrun are in `test_recovery.py`).

Training: W = 3 from iteration 3 on (windows 3-5, 6-8, 9-11); FAILED = 11 strikes with window 9 in flight,
so the rollback target is the persisted window 6-8.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from moevement.failures import FaultEvent
from moevement.recovery.localized import Recovery
from moevement.recovery.report import RecoveryFigures, RecoveryReport, RecoveryWork
from moevement.recovery.restart import find_restart_checkpoint
from moevement.storage import word_checksum
from moevement.storage.host_memory import read_header
from moevement.storage.snapshot import FORMAT, SnapshotHeader, read_entries
from moevement.topology import Topology
from tests.tiny_moe import (
    FAILED,
    Run,
    conversion_of,
    differences,
    frozen_by_iteration,
    recording_hooks,
    tiny_engine,
    train_run,
)


def recorded(said: list) -> list:
    """What `Recovery` said through its line callable: the events as their records (JSON), lines as text."""
    return [out if isinstance(out, str) else out.record() for out in said]


def _fail_rank0_of_two(rank: int, root: str, init: str) -> None:
    """Ranks 0 and 1 are one stage's data-parallel pair (same node, each holding the other's replicas) and
    train alike; before iteration FAILED rank 0 loses everything and both recover. Each writes what it saw
    to `<root>/rank<r>.json`."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    base = Path(root)
    topology = Topology(rank, [0, 0], [0, 1], [0, 0], [[0]])
    run = train_run(base / f"rank{rank:05d}", FAILED - 1, topology=topology, rank_dirs=lambda r: base / f"rank{r:05d}")
    try:
        seen: dict[int, list[str]] = {}
        lines: list = []
        hooks = recording_hooks(run, frozen_by_iteration(run.engine), seen)
        recovery = Recovery(run.engine, None, topology, 1, conversion_of(run, hooks, topology), lines.append)
        recovery.recover(FAILED, [FaultEvent(FAILED, (0,))])
        seen[FAILED] = differences(run.engine.ops, run.optimizer, run.states[FAILED], set())
        report = {"seen": seen, "lines": recorded(lines), "figures": dataclasses.asdict(recovery.figures)}
        (base / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        run.engine.close()
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_failed_rank_recovers_from_its_peers_replicas_exact_operator_by_operator(tmp_path):
    """Rank 0's operators, optimizer state and host copies are wiped; it fetches window 6-8 from rank 1's
    replicas and the scalar log from rank 1, and its stage's group (both ranks) converts 6..8 and catches
    up 9..10. At the start of every replayed iteration both ranks hold exactly state_t, operator by
    operator; at the end, state_11. Rank 0 prints the line and every rank's role; both keep its figures."""
    mp.spawn(_fail_rank0_of_two, args=(str(tmp_path), f"file://{tmp_path / 'rendezvous'}"), nprocs=2)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        assert sorted(map(int, report["seen"])) == list(range(6, FAILED + 1)), rank
        assert {t: diffs for t, diffs in report["seen"].items() if diffs} == {}, rank  # {t: ["operator: tensor"]}
        figures = RecoveryFigures(**{**report["figures"], "ranks": tuple(report["figures"]["ranks"])})
        assert (figures.step, figures.ranks, figures.scope_ranks, figures.replayed) == (FAILED, (0,), 2, 5), rank
    line, *work = reports[0]["lines"]
    report, work = RecoveryReport.from_record(line), [RecoveryWork.from_record(w) for w in work]
    assert (report.step, report.ranks, report.scope, report.rollback_to, report.replayed) == (11, (0,), (0,), 6, 5)
    assert report.detect == 0.0 and reports[1]["figures"]["replays"] == 5  # injected: known at once; 5 replayed
    assert (work[0].rank, work[0].role, work[0].snapshots_from) == (0, "failed", "rank1"), work
    assert (work[1].rank, work[1].role) == (1, "rolled-back"), work
    [own] = reports[1]["lines"]  # its own seconds
    own = RecoveryReport.from_record(own)
    assert (own.step, own.ranks, own.scope, own.rollback_to, own.replayed) == (11, (0,), (0,), 6, 5)


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("needs its own one-rank process group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-copy", "gpu-path"])
def test_a_whole_job_restart_converts_the_persisted_window_exact_operator_by_operator(tmp_path, one_rank_group, staged):
    """The job dies after iteration 10 with its host memory intact; the restarted process (a fresh model
    and optimizer) finds window 6-8 and `Recovery.restart` converts it: at the start of 6, 7 and 8 every
    operator is exactly state_t, at the end state_9, and training goes on with iteration 9. Alike whether
    the snapshots were copied by the copy thread (XXH3) or issued as on a GPU (device checksums)."""
    rank_dir = tmp_path / "job" / "rank00000"
    died = train_run(rank_dir, FAILED - 1, staged=staged)
    died.engine.close()  # keep_host_state: what the dead process committed stays in its directory
    lines: list = []
    found = find_restart_checkpoint(tmp_path / "job", None, lambda header, source: None, lines.append)
    assert found is not None and (found.window_start, found.window_size, found.last_iteration) == (6, 3, 10)
    assert {header.checksum_format for header, _ in found.snapshots} == {word_checksum.FORMAT if staged else FORMAT}
    model, optimizer, engine = tiny_engine(rank_dir)
    restarted = Run(model, optimizer, engine, died.states, died.initial)
    seen: dict[int, list[str]] = {}
    frozen = {found.window_start + i: set(header.frozen) for i, (header, _) in enumerate(found.snapshots)}
    topology = Topology.single()
    conversion = conversion_of(restarted, recording_hooks(restarted, frozen, seen), topology)
    recovery = Recovery(engine, None, topology, 1, conversion, lines.append)
    assert recovery.restart(found) == 9
    seen[9] = differences(engine.ops, optimizer, died.states[9], set())
    assert sorted(seen) == [6, 7, 8, 9] and {t: diffs for t, diffs in seen.items() if diffs} == {}
    report = lines[-1]
    assert (report.step, report.ranks, report.scope, report.rollback_to, report.replayed) == (11, (0,), (0,), 6, 3)
    assert report.snapshots_from == ("rank0: local shared memory",), report
    # a whole-job restart: no clock saw the fault (no `detect`); its replay runs iterations 6..8 again
    assert report.detect is None
    assert recovery.figures == RecoveryFigures(11, (0,), 1, 6, recovery.figures.seconds, detect=0.0, replays=3)
    engine.adopt(found.window_index, found.snapshots)  # as `resume` does: rewritten with copy_entries (XXH3)
    for slot in range(3):
        adopted = engine.buffers.buffer(found.window_index % 2, slot)
        header = SnapshotHeader.from_json(read_header(adopted.path))
        assert header.checksum_format == FORMAT and read_entries(adopted.data, header)  # every checksum verified
    engine.close()
