"""Real deaths (docs/design/lifecycle/README.md): a worker process dies (SIGKILL, or an exit) under torchrun. Its rank
shell replaces it in place by a warm standby while the survivors keep their state in memory and stay alive (the
default); with `--fault.max_replacements 0` (and whenever the shell gives up) torchrun restarts every process
and the survivors keep their live state in shared memory (`fallback=True`). Either way only the dead ranks'
stages replay.

Every case is compared with the fault-free run of its layout, as recorded: every iteration is logged once,
with the fault-free run's loss, the final `state_digest` is equal, and the healthy stages' `recovery work`
lines show no forward or backward. The interval baselines roll every rank back to their own newest
checkpoint instead and recompute (gemini and checkfreq exactly; MoC, by design, not)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from benchmarks.emulated_nodes import free_port
from moevement.failures import TRAINING_PHASES
from moevement.recovery.report import RecoveryReport
from tests.helpers import (
    BASE,
    CHILD_ENV,
    DEMO_KINDS,
    INTERLEAVED,
    MOEVEMENT,
    PP2,
    PP2_BF16_CLIPPED,
    PP2_DP2_EP2_BF16,
    PP4,
    ROOT,
    RUN_OUTPUTS,
    accounting,
    after,
    assert_each_step_once,
    assert_recorded_as_printed,
    baseline,
    communicate_bounded,
    faults,
    final_line,
    recoveries,
    recovery_work,
    run_cli,
    run_events,
    start_session,
    step_losses,
    steps,
    survivors,
    validations,
)
from trainer.lifecycle.shell_lines import REPLACED, ShellLine
from trainer.lifecycle.survivor_lines import DETECTED, PREEMPTED, REJOINS

RESTART_STAGES = (["keep", "restart", "setup"], ["keep", "join", "rebuild"])  # torchrun's restart, in place


def rejoins(events: list) -> list[RecoveryReport]:
    """The recovery lines among a run's `events` of a rejoin after a real death: restarted locally or replaced
    in place, with the restart's stages and the survivors' detection."""
    return [
        e
        for e in events
        if isinstance(e, RecoveryReport)
        and e.restart in ("local", "replaced")
        and [stage for stage, _ in e.restart_seconds] in RESTART_STAGES
        and e.detected_by is not None
    ]


def baseline_restarts(out: str) -> list[RecoveryReport]:
    """An interval baseline's recovery lines after torchrun's restart: both stages rolled back, none converted."""
    found = [r for r in recoveries(out) if r.strategy is not None and r.restart == "global"]
    assert all(r.scope == (0, 1) and r.convert == r.catchup == 0.0 for r in found), found
    return found


FALLBACK = ("--fault.max_replacements", "0")  # no rank shell: torchrun restarts every worker


def death_run(tmp_path, layout: list[str], nproc: int, *fault: str, restarts: int = 0, fallback: bool = False) -> str:
    """A run with real deaths: replaced in place (`restarts`: torchrun restarts allowed), or, with `fallback`,
    by torchrun's restart of every worker (one per death unless `restarts` says more)."""
    restarts = max(restarts, fault_count(fault)) if fallback else restarts
    return run_cli(
        *BASE,
        *layout,
        *MOEVEMENT,
        "--checkpoint.host_dir",
        str(tmp_path / "shm"),
        *("--fault.timeout_s", "120"),  # a hung collective fails inside the test's time, saying where
        *fault,
        *(FALLBACK if fallback else ()),
        nproc=nproc,
        torchrun=(f"--max-restarts={restarts}",),
    ).stdout


def fault_count(fault: tuple[str, ...]) -> int:
    """The deaths `--fault.kill` / `--fault.crash` arguments ask for."""
    values = [fault[i + 1] for i, arg in enumerate(fault[:-1]) if arg in ("--fault.kill", "--fault.crash")]
    return sum(len(v.split(",")) for v in values)


def assert_local_and_exact(
    out: str, reference: str, dead: tuple[int, ...], scope: tuple[int, ...]
) -> list[RecoveryReport]:
    """The recoveries are local (dead ranks `dead`, stages `scope` of the first), healthy stages re-execute
    nothing, and every iteration is logged once with the fault-free run's loss."""
    events = run_events(out)
    found = rejoins(events)
    assert found and (found[0].ranks, found[0].scope) == (dead, scope), out
    work = recovery_work(out)
    healthy = [(w.forwards, w.backwards) for w in work if w.role == "healthy"]
    assert healthy and all(fb == (0, 0) for fb in healthy), work
    last = len(events) - 1 - events[::-1].index(found[-1])
    assert final_line(events[last:]) == final_line(reference)
    assert step_losses(after(events, found[-1])), out  # trained on after the last recovery
    assert_each_step_once(events, reference)
    return found


def test_sigkill_in_backward_is_replaced_in_place(tmp_path):
    """Guarantee: Bit-exact recovery (a real SIGKILL, replaced in place; bf16, clipping); the records are the truth.
    The README's demo (`make train`) on 4 layers in bf16 with clipping active (max_grad_norm 0.5): pp=2, rank 1
    SIGKILLs itself in the backward pass of step 9.
    Its rank shell starts the warm standby as rank 1; rank 0's process lives on with its state in memory (no
    torchrun restart: `--max-restarts 0`) and replays nothing; the run ends with the fault-free digest. Every
    line of a recorded kind it printed, from any process, is in its `events.jsonl`. The standby had built rank
    1's data and stages before its activation, and the run still ends with the fault-free digest."""
    reference = baseline(PP2_BF16_CLIPPED, 2)
    assert all(line.value("grad_norm") > 0.5 for line in steps(reference))  # every step clipped
    out = death_run(tmp_path, [*PP2_BF16_CLIPPED, "--training.val_every", "4"], 2, "--fault.kill", "9:1:backward")
    events = assert_recorded_as_printed(out)
    assert {e.KIND for e in events} >= DEMO_KINDS | {"validation"}, out
    [killed] = faults(out)  # rank 1 recorded its own line (on rank 0's host)
    [survivor] = survivors(out)
    assert (killed.rank, killed.step, killed.how, killed.phase) == (1, 9, "SIGKILL", "backward"), out
    assert (survivor.what, survivor.rank, survivor.step, survivor.generation) == (REJOINS, 0, 9, 1), out
    assert survivor.kept == "live state of iteration 9 in memory" and survivor.since_unix < killed.unix, out
    [shell] = [e for e in run_events(out) if isinstance(e, ShellLine)]  # rank 0 is the process that ran before
    assert (shell.what, shell.rank, shell.how, shell.generation) == (REPLACED, "1", "signal SIGKILL", 1), out
    [found] = assert_local_and_exact(out, reference, (1,), (1,))
    assert (found.step, found.fault_step, found.restart) == (9, 9, "replaced"), out  # the shell saw it begin 9
    # the standby had built rank 1's data and stages before its activation (`fault.standby_prebuild`)
    roles = {w.role: w for w in recovery_work(out)}
    assert roles["failed"].prebuilt == "data+model" and roles["healthy"].prebuilt is None, roles
    assert roles["failed"].build_s is not None and roles["healthy"].build_s is not None, roles
    # the shell saw the death: its replacement dates the fault, and rank 0 detected it at once
    assert found.detect is not None and 0 <= found.detect < 5, found
    acct = accounting(out)
    assert (acct.iterations, acct.failures) == (final_line(out)[0], 1), acct  # carried across the generations
    assert acct.recomputed == found.replayed > 0, acct  # stage 1's replay counts as iterations run again
    assert acct.recovery_s >= found.seconds + found.detect - 0.002 and acct.detect_s == found.detect, acct


@pytest.mark.slow
def test_a_standby_that_builds_after_its_activation_ends_alike(tmp_path):
    """The A/B baseline of the warm standby: it prepares as soon as it starts, prebuilds nothing and builds
    rank 1 after its activation; its threads sleep as soon as they wait (`passive`). The same digest."""
    no_prebuild = ("--fault.standby_prebuild", "false", "--fault.standby_prepare", "at_once")
    out = death_run(
        tmp_path, PP2, 2, "--fault.kill", "9:1:backward", *no_prebuild, "--training.omp_wait_policy", "passive"
    )
    assert_local_and_exact(out, baseline(PP2, 2), (1,), (1,))
    assert all(w.prebuilt is None for w in recovery_work(out)), out


def test_sigkill_with_torchrun_restarting_every_worker(tmp_path):
    """Guarantee: Bit-exact recovery (a real SIGKILL, torchrun's restart of every worker).
    The fallback (`fault.max_replacements = 0`: no rank shell): torchrun restarts every process; rank 0
    keeps its state in shared memory across the restart and replays nothing."""
    out = death_run(tmp_path, PP2, 2, "--fault.kill", "9:1:backward", fallback=True)
    assert [(f.rank, f.step, f.phase) for f in faults(out)] == [(1, 9, "backward")], out
    [kept] = survivors(out)
    assert (kept.what in (DETECTED, PREEMPTED), kept.rank, kept.step) == (True, 0, 9), out
    assert kept.kept.startswith("live state of iteration 9, "), out
    [found] = assert_local_and_exact(out, baseline(PP2, 2), (1,), (1,))
    assert found.step == 9
    assert re.search(
        r"^restart timeline rank=0: exec=\S+ python=\S+ imports=\S+ process_group=\S+ mesh=\S+ model=\S+ "
        r"strategy=\S+ restored=\S+$",
        out,
        re.M,
    ), out
    acct = accounting(out)
    assert (acct.iterations, acct.failures) == (final_line(out)[0], 1), acct  # carried across the restart
    assert acct.recovery_s >= found.seconds and acct.wall_s > acct.recovery_s, acct
    assert found.detect is None and acct.recomputed == found.replayed, (found, acct)  # no clock saw the death


@pytest.mark.slow
def test_a_replacement_on_another_node_fetches_its_snapshots_over_the_network(tmp_path):
    """Two nodes (two torchrun agents, each with its own shared-memory directory): the replacement of the dead
    rank finds no copy of its snapshots on its node and receives them from its replica holder on the other
    node, verified; only its stage replays and the result is the fault-free run's."""
    port = free_port()

    def agent(node: int) -> subprocess.Popen:
        rdzv = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", *rdzv]
        cmd += ["--max-restarts", "1", "train.py", *BASE, *PP2, *MOEVEMENT, "--fault.kill", "9:1:backward"]
        cmd += ["--checkpoint.host_dir", str(tmp_path / f"node{node}"), "--job.output_dir", str(RUN_OUTPUTS)]
        cmd += ["--fault.timeout_s", "120"]
        return start_session(cmd, ROOT, CHILD_ENV, stderr=subprocess.STDOUT)

    agents = [agent(0), agent(1)]
    outs = [communicate_bounded(a)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(outs)
    (out,) = [o for o in outs if rejoins(run_events(o))]  # rank 0's agent prints the recovery and the steps
    [found] = assert_local_and_exact(out, baseline(PP2, 2), (1,), (1,))
    assert found.step == 9
    work = [(w.rank, w.role, w.snapshots_from) for w in recovery_work(out)]
    assert (1, "failed", "rank0:network") in work, out


@pytest.mark.slow
def test_real_crash_recovers_locally(tmp_path):
    """`--fault.crash` makes rank 1 (stage 0, with rank 0) exit at the start of step 8; its standby replaces
    it; ranks 2 and 3 (stage 1) keep their state and serve logs while stage 0 replays."""
    reference = baseline(PP2_DP2_EP2_BF16, 4)
    out = death_run(tmp_path, PP2_DP2_EP2_BF16, 4, "--fault.crash", "8:1")
    assert "fault: rank 1 crashes at step 8" in out
    assert_local_and_exact(out, reference, (1,), (0,))
    roles = {w.rank: w.role for w in recovery_work(out)}
    assert roles == {0: "rolled-back", 1: "failed", 2: "healthy", 3: "healthy"}


@pytest.mark.slow
def test_second_death_right_after_a_rejoin_recovers_locally(tmp_path):
    """pp=2: rank 1 dies at 9; the next generation rejoins at 9 and keeps the window it replayed from as its
    persisted checkpoint; rank 1 dies again at 10, before the job persisted a window of its own: the second
    replacement still replays only stage 1, from that window."""
    out = death_run(tmp_path, PP2, 2, "--fault.kill", "9:1:backward,10:1:forward")
    found = assert_local_and_exact(out, baseline(PP2, 2), (1,), (1,))
    assert [(r.step, r.ranks, r.scope) for r in found] == [(9, (1,), (1,)), (10, (1,), (1,))]
    assert found[0].rollback_to == found[1].rollback_to  # the same rollback point


@pytest.mark.slow
def test_death_during_a_rejoin_keeps_the_survivors_state(tmp_path):
    """pp=2: rank 1 dies at 9, then its replacement dies while it replays its stage (iteration 7); rank 0,
    which was only serving logs, goes on to generation 2 with the live state it kept at the first death,
    and stage 1 still replays alone."""
    out = death_run(tmp_path, PP2, 2, "--fault.kill", "9:1:backward,7:1:replay")
    assert "fault: rank 1 killed (SIGKILL) in the replay phase of step 7" in out
    [found] = assert_local_and_exact(out, baseline(PP2, 2), (1,), (1,))
    assert found.step == 9


@pytest.mark.slow
def test_death_in_the_last_iteration_keeps_the_final_state(tmp_path):
    """pp=2: rank 1 dies in the optimizer step of the last iteration (12); rank 0 finishes it and keeps its
    final state while the job gathers it; the next generation replays stage 1 up to 13, has nothing left to
    train, and prints the fault-free run's final line (the loss of 12 comes from the scalar log)."""
    out = death_run(tmp_path, PP2, 2, "--fault.kill", "12:1:optimizer")
    assert [(r.step, r.ranks, r.scope) for r in rejoins(run_events(out))] == [(13, (1,), (1,))], out
    assert final_line(out) == final_line(baseline(PP2, 2))


@pytest.mark.slow
def test_a_death_during_the_final_digest_keeps_the_survivors_state(tmp_path):
    """pp2/dp2/ep2: rank 3 dies as the final state digest starts; its data-parallel peer's wait inside
    DTensor's `full_tensor` fails (a c10d operator's error, classified as a peer's death): every survivor
    keeps `state_13` in memory, nobody prints a traceback, and the next generation ends with the fault-free
    digest."""
    out = death_run(tmp_path, PP2_DP2_EP2_BF16, 4, "--fault.kill", "12:3:digest")
    assert "Traceback" not in out and [(f.rank, f.step, f.phase) for f in faults(out)] == [(3, 12, "digest")], out
    kept = {(r.rank, r.kept) for r in survivors(out) if r.what == REJOINS}
    assert kept == {(rank, "live state of iteration 13 in memory") for rank in (0, 1, 2)}, out
    assert [(r.step, r.ranks, r.scope) for r in rejoins(run_events(out))] == [(13, (3,), (1,))], out
    assert final_line(out) == final_line(baseline(PP2_DP2_EP2_BF16, 4))


@pytest.mark.slow
@pytest.mark.parametrize("phase", TRAINING_PHASES)
def test_pp2_dp2_ep2_bf16_sigkill_in_each_phase(tmp_path, phase):
    """A death before the gradient-norm all-reduce (forward, backward, clip, during the snapshot copy) leaves
    every survivor at state_T; one after it (optimizer step, replication of T's snapshot) lets them finish
    T: either way the stage of rank 2 alone replays, bit-exact, from the stage and expert shard its standby
    prebuilt."""
    out = death_run(tmp_path, PP2_DP2_EP2_BF16, 4, "--fault.kill", f"8:2:{phase}")
    assert [(f.rank, f.step, f.phase) for f in faults(out)] == [(2, 8, phase)], out
    [found] = assert_local_and_exact(out, baseline(PP2_DP2_EP2_BF16, 4), (2,), (1,))
    assert [w.prebuilt for w in recovery_work(out) if w.role == "failed"] == ["data+model"], out
    assert found.step == (9 if phase in ("optimizer", "replication") else 8)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "dead", "scope"),
    [
        (("--fault.kill", "8:2:backward"), (2,), (2,)),  # a middle stage
        # two deaths at once (both at the start of the iteration: a death inside it stops the others
        # before they reach a later phase): non-adjacent stages, then adjacent ones
        (("--fault.crash", "8:0,8:2"), (0, 2), (0, 2)),
        # (rank 2 holds rank 1's replicas: a replica holder dies with the rank it backs up)
        (("--fault.crash", "8:1,8:2"), (1, 2), (1, 2)),
        (("--fault.kill", "2:1:backward"), (1,), (1,)),  # inside the first window: the initial state
    ],
)
def test_pp4_real_deaths(tmp_path, fault, dead, scope):
    assert_local_and_exact(death_run(tmp_path, PP4, 4, *fault), baseline(PP4, 4), dead, scope)


FULL_AC = ["--training.activation_checkpoint", "full"]
COMPILED = ["--training.compile", "true", *FULL_AC]


@pytest.mark.parametrize(
    ("layout", "nproc", "kill", "dead"),
    [
        pytest.param(PP2, 2, "9:1:backward", (1,), id="pp2", marks=pytest.mark.slow),  # about 40 s
        pytest.param(PP2_DP2_EP2_BF16, 4, "8:2:backward", (2,), id="pp2_dp2_ep2_bf16", marks=pytest.mark.slow),
    ],
)
def test_sigkill_under_activation_checkpointing_ends_with_the_digest_of_the_run_without(
    tmp_path, layout, nproc, kill, dead
):
    """Guarantee: Bit-exact recovery with activation checkpointing (parallelisms/activation_checkpoint.py).
    Every block recomputes its forward in backward (`--training.activation_checkpoint full`): in training, in
    the dead stage's replay (frozen operators skip their weight gradients) and, with expert parallelism, with the
    all-to-all and FSDP2 inside the recomputation. A rank SIGKILLed in backward is replaced in place, its stage
    alone replays, and the run ends with the digest of the fault-free run without checkpointing."""
    out = death_run(tmp_path, [*layout, *FULL_AC], nproc, "--fault.kill", kill)
    [found] = assert_local_and_exact(out, baseline(layout, nproc), dead, (1,))
    assert found.restart == "replaced", out


@pytest.mark.slow
def test_sigkill_with_compiled_blocks_ends_with_the_digest_of_the_compiled_fault_free_run(tmp_path):
    """Compiled blocks (`--training.compile`, parallelisms/compile.py) may differ from eager ones in the last
    bits, so the reference is the fault-free compiled run: the replacement compiles its parts again (and once
    more without weight gradients for the replay's frozen operators) and the run ends with that run's digest."""
    layout = [*PP2, *COMPILED]
    out = death_run(tmp_path, layout, 2, "--fault.kill", "9:1:backward", "--fault.timeout_s", "300")
    [found] = assert_local_and_exact(out, baseline(layout, 2), (1,), (1,))
    assert found.restart == "replaced", out


@pytest.mark.slow
def test_interleaved_1f1b_and_two_deaths_in_a_row(tmp_path):
    """Interleaved1F1B (pipeline rank 1 runs stages 1 and 3); rank 1 dies at 6, then rank 0 at 15 (after
    the job persisted a window of its own), each replaced in place."""
    layout = [*INTERLEAVED, "--training.steps", "18"]
    out = death_run(tmp_path, layout, 2, "--fault.kill", "6:1:backward,15:0:forward")
    found = assert_local_and_exact(out, baseline(layout, 2), (1,), (1, 3))
    assert [(r.ranks, r.scope) for r in found] == [((1,), (1, 3)), ((0,), (0, 2))]


FROZEN = r"^shell: rank {r}: trainer pid \d+ said nothing for [\d.]+ s \(more than {key}=5 s\): frozen"


def assert_a_hang_replaced_in_place(out: str, rank: int) -> None:
    """Rank `rank` stopped at step 9: its shell killed it as frozen, its standby replaced it in generation 1,
    and no rank waited for torchrun's restart."""
    assert f"fault: rank {rank} stopped (SIGSTOP) in the backward phase of step 9" in out
    assert re.search(FROZEN.format(r=rank, key="fault.timeout_s"), out, re.M), out
    assert re.search(rf"^shell: rank {rank}: trainer pid \d+ died \(signal SIGKILL\) .* generation 1 ", out, re.M)
    assert "not joined" not in out and [r.restart for r in rejoins(run_events(out))][:1] == ["replaced"], out


# In the default suite: a frozen trainer killed after the heartbeat bound and replaced, its fault dated from its
# last word (tests/test_rank_shell.py::test_a_frozen_trainer_is_killed_and_replaced), and a recovery's detection
# charged in the records (test_sigkill_in_backward_is_replaced_in_place).
@pytest.mark.slow
def test_a_hang_is_detected_within_the_heartbeat_bound_and_charged(tmp_path):
    """A hang costs the heartbeat bound, and the records say so.
    pp=2: rank 1 stops (SIGSTOP) in its backward pass of step 9 while its peers' collectives would wait
    120 s (`fault.timeout_s`). Its heartbeat stops with it: past `fault.heartbeat_timeout_s` (5 s) its shell
    kills it and the standby replaces it in place. The recovery line dates the hang from the trainer's last
    heartbeat (`detect`: from the fault to rank 0's detection), and the accounting charges it."""
    out = death_run(
        tmp_path,
        PP2,
        2,
        *("--fault.kill", "9:1:backward", "--fault.kill_signal", "SIGSTOP", "--fault.heartbeat_timeout_s", "5"),
    )
    assert re.search(FROZEN.format(r=1, key="fault.heartbeat_timeout_s"), out, re.M), out
    [found] = assert_local_and_exact(out, baseline(PP2, 2), (1,), (1,))
    assert found.restart == "replaced", found
    stopped = float(re.search(r"^fault: rank 1 stopped \(SIGSTOP\) .* at unix=(\S+)$", out, re.M)[1])
    detected = float(re.search(r"^survivor: rank 0 .* \(detected at unix=(\S+)\)$", out, re.M)[1])
    # the bound, not the collectives' 120 s; dated from the last heartbeat, at most a beat before the stop
    assert 5 <= found.detect < 5 + 15 and 0 <= found.detect - (detected - stopped) <= 1.5, (found, out)
    acct = accounting(out)
    assert acct.recovery_s >= found.seconds + found.detect - 0.002 and acct.detect_s == found.detect, acct
    assert (acct.failures, acct.recomputed) == (1, found.replayed), acct


@pytest.mark.slow
def test_a_hung_worker_is_killed_by_its_shell_and_replaced_in_place(tmp_path):
    """pp=2: rank 1 stops (SIGSTOP) in its backward pass, keeping its connections open. Its heartbeat stops
    with it: after `fault.timeout_s` its shell kills it and the standby replaces it, while rank 0 (whose
    receive failed) keeps its state in memory: the hang is recovered in place, like a death."""
    out = death_run(
        tmp_path,
        PP2,
        2,
        *("--fault.kill", "9:1:backward", "--fault.kill_signal", "SIGSTOP", "--fault.timeout_s", "5"),
    )
    assert_a_hang_replaced_in_place(out, 1)
    [survivor] = survivors(out)
    assert (survivor.rank, survivor.step) == (0, 9) and survivor.how.startswith("a collective failed"), out
    assert_local_and_exact(out, baseline(PP2, 2), (1,), (1,))


@pytest.mark.slow
def test_a_hang_is_detected_in_every_process_group(tmp_path):
    """pp2/dp2/ep2: rank 2 stops in its backward pass. Its peers wait for it in the pipeline, expert and
    data-parallel groups of the device mesh (created after the default group, with PyTorch's 30-minute
    default): every group is bounded by `fault.timeout_s`, and its shell replaces it after that bound, so
    the job recovers in seconds, locally and in place."""
    reference = baseline(PP2_DP2_EP2_BF16, 4)
    out = death_run(
        tmp_path,
        PP2_DP2_EP2_BF16,
        4,
        *("--fault.kill", "9:2:backward", "--fault.kill_signal", "SIGSTOP", "--fault.timeout_s", "5"),
    )
    assert_a_hang_replaced_in_place(out, 2)
    assert_local_and_exact(out, reference, (2,), (1,))


def baseline_death_run(tmp_path, strategy: str, *extra: str) -> tuple[str, RecoveryReport]:
    """pp=2 under `checkpoint.strategy`: rank 1 SIGKILLs itself in the backward pass of step 9; returns the
    output and the restarted job's recovery line."""
    out = run_cli(
        *BASE,
        *PP2,
        "--checkpoint.strategy",
        strategy,
        "--checkpoint.host_dir",
        str(tmp_path / "shm"),
        "--checkpoint.persist_dir",
        str(tmp_path / "disk"),
        "--fault.kill",
        "9:1:backward",
        *extra,
        nproc=2,
        torchrun=("--max-restarts=1",),
    ).stdout
    assert "fault: rank 1 killed (SIGKILL) in the backward phase of step 9" in out
    [recovery] = baseline_restarts(out)
    return out, recovery


@pytest.mark.parametrize(
    ("strategy", "source"),
    [
        pytest.param("gemini", "rank1: replica on rank00000", id="gemini"),
        pytest.param("checkfreq", "rank1: disk ", id="checkfreq", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_a_baseline_restarts_from_its_newest_checkpoint(tmp_path, strategy, source):
    """After the torchrun restart every rank rolls back to the baseline's newest complete checkpoint (gemini:
    the dead rank takes its copy from the replica on its peer, not from its own host memory; checkfreq:
    from disk) and recomputes from there: the same losses and final state as the fault-free run."""
    out, recovery = baseline_death_run(tmp_path, strategy, "--checkpoint.interval", "3")
    sources, rollback_to = "; ".join(recovery.snapshots_from), recovery.rollback_to
    assert (recovery.step, recovery.ranks, recovery.strategy) == (9, (1,), strategy) and sources.startswith(source)
    assert 1 < rollback_to < 9 and recovery.replayed == 9 - rollback_to
    events = run_events(out)
    reference = baseline(PP2, 2)
    assert min(step_losses(after(events, recovery))) == 9  # the iterations recomputed were logged before
    assert_each_step_once(events, reference)
    assert final_line(events[events.index(recovery) :]) == final_line(reference)


@pytest.mark.slow
def test_moc_restarts_from_its_checkpoints_and_loses_tokens(tmp_path):
    """MoC restores every operator from its newest save on disk (experts stale) and accounts the tokens
    lost, as its in-place recovery does; not exact by design."""
    out, r = baseline_death_run(tmp_path, "moc", "--checkpoint.interval", "2", "--checkpoint.moc_experts", "2")
    assert (r.step, r.ranks, r.rollback_to, r.strategy) == (9, (1,), 7, "moc")
    assert "; ".join(r.snapshots_from).startswith("rank1: disk ")
    assert r.lost_tokens > 0 and 0 < r.plt < 1
    assert accounting(out).lost_tokens == r.lost_tokens, out
    final_line(out)


@pytest.mark.slow
def test_a_restarted_baseline_refuses_a_window_of_another_run(tmp_path):
    """While the job restarts, a checkpoint of another run (another torchrun run and seed), newer than the
    job's own, lands in its directory: every rank refuses it in one line and removes it, and the job rolls
    back to its own checkpoint."""
    other = tmp_path / "other"
    shared = ["--checkpoint.strategy", "checkfreq", "--checkpoint.host_dir", str(tmp_path / "shm")]
    run_cli(
        *BASE,
        *PP2,
        *shared,
        "--job.seed",
        "1",
        "--checkpoint.interval",
        "4",
        "--checkpoint.persist_dir",
        str(other),
        nproc=2,
    )
    foreign, planted = other / "debug_moe" / "window-00000007", tmp_path / "disk" / "debug_moe" / "window-00000007"
    args = [*BASE, *PP2, *shared, "--checkpoint.interval", "3", "--checkpoint.persist_dir", str(tmp_path / "disk")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    lines = []
    with subprocess.Popen(
        [*cmd, "train.py", *args, "--fault.kill", "9:1:backward", "--job.output_dir", str(RUN_OUTPUTS)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("fault: rank 1 killed"):  # the restarted job starts seconds later
                shutil.copytree(foreign, planted)
        assert proc.wait() == 0, "".join(lines)
    out = "".join(lines)
    for rank in (0, 1):
        assert re.search(
            rf"^restart: rank {rank} refused {planted}/rank0000{rank}: .*(run_id|job\.seed).*; removed it$", out, re.M
        ), out
    [r] = baseline_restarts(out)
    assert (r.step, r.ranks, r.rollback_to) == (9, (1,), 6) and not list(planted.glob("rank*"))
    assert final_line(out) == final_line(baseline(PP2, 2))


@pytest.mark.slow
def test_a_death_during_validation_loses_no_validation_line(tmp_path):
    """Rank 1 dies in the validation after iteration 6: the restarted job resumes after 6 and runs that
    validation again, so the run's validation lines equal the fault-free run's, every one of them."""
    validation = ["--training.val_every", "3", "--training.val_batches", "2"]
    out = death_run(tmp_path, [*PP2, *validation], 2, "--fault.kill", "6:1:validation")
    assert [(f.rank, f.step, f.phase) for f in faults(out)] == [(1, 6, "validation")], out
    reference = baseline([*PP2, *validation], 2)
    losses = {v.step: v.val_loss for v in validations(out)}  # the last of each step's (one ran again)
    assert losses == {v.step: v.val_loss for v in validations(reference)} and 6 in losses, out
    assert final_line(out) == final_line(reference)


@pytest.mark.slow
def test_a_survivor_dies_while_the_next_generation_replays(tmp_path):
    """pp2/dp2/ep2: rank 2 dies at 8; rank 3, a survivor of the same stage, replays with its replacement in
    generation 1 and dies there (iteration 7). Generation 2 replaces it too; stage 0 still only serves logs."""
    out = death_run(tmp_path, PP2_DP2_EP2_BF16, 4, "--fault.kill", "8:2:backward,7:3:replay")
    assert "fault: rank 3 killed (SIGKILL) in the replay phase of step 7" in out
    assert re.search(r"^shell: rank 3: .* replaces it in generation 2 ", out, re.M), out
    found = assert_local_and_exact(out, baseline(PP2_DP2_EP2_BF16, 4), (2, 3), (1,))
    assert [r.step for r in found] == [8]


@pytest.mark.slow
def test_a_survivor_dies_while_joining_the_next_generation(tmp_path):
    """pp2/dp2/ep2: rank 2 dies at 8; rank 3, a survivor of the same stage, dies right after it joined the
    process groups of generation 1, losing the state it kept. The others learn of it when generation 1's
    groups are not created within `fault.timeout_s`, and its replacement waits twice that for generation 2.
    Generation 2 replaces both; stage 0 keeps its state through both generations and only serves logs, stage
    1 replays."""
    kills = ("--fault.kill", "8:2:backward,8:3:join")
    # its peers wait for it in generation 1's group creation until the bound (shortened here)
    out = death_run(tmp_path, PP2_DP2_EP2_BF16, 4, *kills, "--fault.timeout_s", "30")
    assert "fault: rank 3 killed (SIGKILL) in the join phase of step 8" in out
    assert re.search(r"^shell: rank 3: .* replaces it in generation 2 ", out, re.M), out
    found = assert_local_and_exact(out, baseline(PP2_DP2_EP2_BF16, 4), (2, 3), (1,))
    assert [r.step for r in found] == [8]


@pytest.mark.slow
def test_more_deaths_than_replacements_fall_back_to_torchrun(tmp_path):
    """pp=2 with `fault.max_replacements 1`: rank 1's first death is replaced in place; at its second the
    shell has none left and exits, torchrun restarts every worker, and rank 0 keeps its state across it."""
    out = death_run(
        tmp_path, PP2, 2, "--fault.kill", "9:1:backward,10:1:forward", "--fault.max_replacements", "1", restarts=1
    )
    assert re.search(r"^shell: rank 1: trainer pid \d+ died \(signal SIGKILL\); replacements spent", out, re.M), out
    found = assert_local_and_exact(out, baseline(PP2, 2), (1,), (1,))
    assert [(r.step, r.ranks, r.scope) for r in found] == [(9, (1,), (1,)), (10, (1,), (1,))]
    assert any(r.step == 10 and r.restart == "local" for r in recoveries(out)), out
