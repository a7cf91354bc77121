"""A death after the job has finished (trainer/lifecycle/job_end.py, docs/design/lifecycle/job-end.md).

Real torchrun jobs (pp=2, a rank shell per slot, no torchrun restart allowed) in which a worker SIGKILLs itself
at the end of the run: each exits 0 within seconds of the death, prints the fault-free `final` line once, and
leaves the complete checkpoint it was asked for. The generation watch and the shell's `finished` report are
tested in one process (a real TCPStore) and with the rank shell's own protocol."""

from __future__ import annotations

import datetime
import os
import re
import socket
import threading
import time

import pytest
import torch.distributed as dist

from parallelisms import distributed
from tests.helpers import BASE, MOEVEMENT, PP2, baseline, run_cli, run_events, run_shell, survivors
from trainer.lifecycle import job_end, node_presence, rank_shell, store_keeper
from trainer.records.event_lines import FinalLine

LAST = 12  # BASE's training.steps
KILLED = re.compile(r"^fault: rank (\d) killed \(SIGKILL\) in the (\w+) phase of step \d+ at unix=(\S+)$", re.M)


def end_run(tmp_path, kill: str, *extra: str) -> tuple[str, float]:
    """A pp=2 run killed by `--fault.kill kill`; its output and the seconds from the death to the job's exit."""
    proc = run_cli(
        *BASE,
        *PP2,
        *MOEVEMENT,
        *("--checkpoint.host_dir", str(tmp_path / "shm")),
        *("--fault.timeout_s", "120"),  # a generation that never forms would be waited for 240 s
        *("--fault.kill", kill),
        *extra,
        nproc=2,
        torchrun=("--max-restarts=0",),
    )
    ended = time.time()
    out = proc.stdout
    killed = KILLED.search(out)
    assert killed, out
    return out, ended - float(killed[3])


def finals(out: str) -> list[FinalLine]:
    """The `final` lines a run recorded."""
    return [e for e in run_events(out) if isinstance(e, FinalLine)]


def assert_finished_once(out: str) -> None:
    """One `final` line, the fault-free run's."""
    assert finals(out) == finals(baseline(PP2, 2)), out


@pytest.mark.slow
def test_a_death_before_the_job_records_its_end_is_replaced_and_the_replacement_gives_up(tmp_path):
    """Rank 1 dies right after the accounting line, before it knows the job finished: its shell replaces it,
    and the replacement, waiting for a generation nobody else will join, sees the job's end and exits 0."""
    out, seconds = end_run(tmp_path, f"{LAST}:1:accounting")
    assert_finished_once(out)
    assert re.search(r"^shell: rank 1: trainer pid \d+ died .* replaces it in generation 1 ", out, re.M), out
    assert re.search(rf"^rank 1 pid \d+: generation 1 will not form: the job finished at step {LAST}; ", out, re.M)
    assert seconds < 30, f"{seconds:.1f} s from the death to the job's exit"


def test_a_death_after_the_job_finished_is_not_replaced(tmp_path):
    """Guarantee: A finished job stays finished (a death after it is nothing to recover).
    Rank 1 dies once it knows the job finished (after rank 0's `final` line): its shell says so and exits 0."""
    out, seconds = end_run(tmp_path, f"{LAST}:1:final")
    assert_finished_once(out)
    pattern = rf"^shell: rank 1: trainer pid \d+ died \(signal SIGKILL\) after the job finished at step {LAST}; "
    assert re.search(pattern, out, re.M) and "replaces it" not in out, out
    assert seconds < 30, f"{seconds:.1f} s from the death to the job's exit"


@pytest.mark.slow
def test_a_death_as_save_final_starts_keeps_the_survivors_state(tmp_path):
    """Rank 1 dies as `checkpoint.save_final` starts, before anything is published: rank 0's collective
    fails as in an iteration, it keeps `state_13` in memory and the standby replaces rank 1; the next
    generation saves again, and the one checkpoint loads to the fault-free digest."""
    target = tmp_path / "final"
    out, _ = end_run(tmp_path, f"{LAST}:1:save", "--checkpoint.save_final", str(target))
    assert_finished_once(out)
    assert [(e.rank, e.kept) for e in survivors(out)] == [(0, "live state of iteration 13 in memory")], out
    assert re.search(r"^shell: rank 1: trainer pid \d+ died .* replaces it in generation 1 ", out, re.M), out
    assert out.count(f"saved checkpoint step={LAST} dir={target}") == 1 and "Traceback" not in out, out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".final")] == []  # no temporary left
    loaded = run_cli(*BASE, "--checkpoint.load", str(target)).stdout
    assert finals(loaded) == finals(out), loaded


@pytest.mark.slow
def test_a_death_during_save_final_after_publication_leaves_the_checkpoint(tmp_path):
    """Rank 0 dies right after publishing `checkpoint.save_final`, before telling rank 1: rank 1's wait fails,
    it sees the job's end and exits 0; rank 0's shell replaces nobody; the checkpoint loads to the same digest."""
    target = tmp_path / "final"
    out, seconds = end_run(tmp_path, f"{LAST}:0:saved", "--checkpoint.save_final", str(target))
    assert_finished_once(out)
    assert re.search(rf"^rank 1 pid \d+: a peer died after the job finished at step {LAST}; ", out, re.M), out
    assert re.search(rf"^shell: rank 0: trainer pid \d+ died .* after the job finished at step {LAST}; ", out, re.M)
    assert "replaces it" not in out and seconds < 30, (seconds, out)
    loaded = run_cli(*BASE, "--checkpoint.load", str(target)).stdout  # training.steps = the saved step
    assert finals(loaded) == finals(out), loaded


def test_a_shell_whose_trainer_finished_replaces_nobody(tmp_path):
    """A trainer that said `finished <step>` and then died: the shell exits 0 and activates no standby."""
    code, records, out = run_shell(tmp_path, ["finished-die"], max_replacements=4)
    assert code == 0 and not any("activated" in r for r in records), out
    assert "died (signal SIGKILL) after the job finished at step 7; nothing to recover" in out, out


@pytest.fixture
def store(monkeypatch):
    """A real TCPStore on a free local port, as torchrun's agent hosts it, and this process as rank 1 of 3."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10))
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    return master


def test_the_generation_watch_gives_up_only_when_the_generation_cannot_form(store):
    watch = job_end.GenerationWatch(generation=2)
    watch()  # nobody left, the job goes on: keep waiting
    job_end.record_left(store, 0, LAST)
    watch()  # rank 2 may still join
    job_end.record_left(store, 2, LAST)
    with pytest.raises(job_end.PeersLeft, match="generation 2 will not form: every other rank has left"):
        watch()
    job_end.record_finished(store, LAST)
    with pytest.raises(job_end.JobFinished, match=f"the job finished at step {LAST}; nothing to recover"):
        watch()
    assert job_end.finished_step(store) == LAST and job_end.await_finished(store, 1.0) == LAST


def test_a_torchrun_restart_after_the_jobs_end_trains_nothing_again(store, monkeypatch):
    """A worker (or a stopped rank shell its child killed) ended after the `final` line and torchrun restarted
    every worker: each rank of the new attempt finds attempt 0's record of the end and exits with success."""
    job_end.check_not_finished_earlier(store)  # attempt 0: nothing earlier
    job_end.record_finished(store, LAST)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    with pytest.raises(job_end.JobFinished, match=f"finished at step {LAST} in attempt 0 of this torchrun run"):
        job_end.check_not_finished_earlier(store)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # each round's own store holds no earlier round
    job_end.check_not_finished_earlier(store)


def test_a_node_whose_beat_stops_for_node_loss_s_is_lost_and_the_generation_given_up(store):
    """Rank 1 of 3 nodes watches node 2 only (ring order); the lapse counts from the last beat it saw."""
    now = [0.0]
    nodes = node_presence.NodeWatch(generation=3, node_loss_s=10.0, node=1, nodes=3, clock=lambda: now[0])
    watch = job_end.GenerationWatch(generation=3, nodes=nodes)
    watch()  # the first reading
    now[0] = 9.0
    store.add(node_presence.beat_key(2), 1)
    watch()  # it moved: silent since 9 s
    store.add(node_presence.beat_key(0), 1)  # a node nobody here watches
    now[0] = 18.5
    watch()  # silent 9.5 s
    now[0] = 19.0
    with pytest.raises(job_end.GenerationCannotForm, match=r"generation 3 will not form: node 2 has said nothing"):
        watch()
    alone = node_presence.NodeWatch(generation=3, node_loss_s=10.0, node=0, nodes=1, clock=lambda: 1e9)
    alone(store)
    alone(store)  # one node: nothing to watch


def test_a_shell_trainer_beats_for_its_node_once_a_second(store, monkeypatch):
    monkeypatch.setenv(rank_shell.ROLE, "trainer")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    stop = node_presence.start_node_beat()
    try:
        time.sleep(2.5)
        beats = store.add(node_presence.beat_key(1), 0)
    finally:
        stop.set()
    assert 2 <= beats <= 4, beats
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert node_presence.start_node_beat() is None  # one node: nobody to tell


def test_a_rank_leaving_its_generation_keeps_the_store_it_hosts(store):
    """`sever_connections` on rank 0 of a job whose rounds have stores of their own (hosted by rank 0): the
    store's connections stay, on the server's end too; any other connection is shut."""
    client = distributed.torchrun_store_client(5)
    with socket.create_server(("127.0.0.1", 0)) as listening:
        peer = socket.create_connection(listening.getsockname())
        accepted, _ = listening.accept()
        with peer, accepted:
            assert distributed.sever_connections() >= 2  # both ends of the peer connection
            assert accepted.recv(1) == b"" and peer.recv(1) == b""
    client.set("after", "1")
    assert store.get("after") == b"1"


def test_rank_0s_shell_keeps_the_store_of_a_round_that_has_its_own(monkeypatch):
    """The keeper serves MASTER_PORT while its shell lives; the shell's children are told to connect to it,
    and still name the round as a store of its own does."""
    own = {"RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_PORT": "1"}
    assert store_keeper.wanted(own)
    assert not store_keeper.wanted({**own, "RANK": "1"})
    assert not store_keeper.wanted({**own, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert store_keeper.KEPT == distributed.KEPT_STORE
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **own, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    keeper = store_keeper.start_if_needed(env, None)
    try:
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        client.set("kept", "yes")
        assert client.get("kept") == b"yes"
    finally:
        keeper.terminate()
        assert keeper.wait(30) == 0
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert not distributed.workers_share_agent_store() and distributed.store_round() == "round"


def test_a_watched_join_stops_waiting_when_the_watch_raises():
    """`_on_a_thread`: a join that would block for good ends as soon as the watch raises."""
    release, calls = threading.Event(), []

    def watch():
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise job_end.PeersLeft(1)

    started = time.monotonic()
    with pytest.raises(job_end.PeersLeft):
        distributed._on_a_thread(lambda: release.wait(60), watch)
    release.set()
    assert len(calls) == 2 and time.monotonic() - started < 5


def test_an_error_of_a_c10d_operator_is_a_communication_failure():
    """A functional collective's error is raised by torch's operator dispatch (`torch/_ops.py`), as the wait
    inside DTensor's `full_tensor` raises a dead peer's reset connection: classified by the operator that
    raised it, never by the message. Another operator's error is not a communication failure."""
    import torch

    from trainer.lifecycle.peer_failure import communication_failure

    with pytest.raises(RuntimeError) as c10d:
        torch.ops._c10d_functional.all_reduce(torch.zeros(2), "sum", "no-such-group")
    with pytest.raises(RuntimeError) as aten:
        torch.ops.aten.mm(torch.zeros(2, 3), torch.zeros(2, 3))
    assert communication_failure(c10d.value) and not communication_failure(aten.value)
