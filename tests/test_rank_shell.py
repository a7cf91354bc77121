"""The rank shell's protocol with its children, in real processes (trainer/run/rank_shell.py).

The children here are a small script in the roles the shell gives them: a "trainer" reports its generation
on the shell's pipe and then dies or exits as the test says; a "standby" waits for its activation and
records it. The trainer itself under a shell runs in tests/test_real_deaths.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from trainer.run import rank_shell

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    sys.path.insert(0, {root!r})
    from trainer.run import rank_shell
    log = open({log!r}, "a")
    role = os.environ[rank_shell.ROLE]
    if role == "standby":
        log.write(json.dumps({{"standby": os.getpid()}}) + "\\n")
        log.flush()
        activation = rank_shell.await_activation()
        if activation is None:
            sys.exit(0)
        log.write(json.dumps({{"activated": activation, "role": os.environ[rank_shell.ROLE]}}) + "\\n")
        log.flush()
    generation = int(os.environ.get(rank_shell.GENERATION, "0"))
    rank_shell.report(f"generation {{generation}}")
    log.write(json.dumps({{"trainer": os.getpid(), "generation": generation}}) + "\\n")
    log.flush()
    ending = {endings!r}[min(generation, len({endings!r}) - 1)]
    if ending == "finished-die":
        rank_shell.report("finished 7")
    if ending == "standby-killed-die":  # kill the standby, wait for the shell's new one, die
        def standbys():
            return [json.loads(line)["standby"] for line in open({log!r}) if '"standby"' in line]
        while not standbys():
            time.sleep(0.05)
        os.kill(standbys()[0], signal.SIGKILL)
        while len(standbys()) < 2:
            time.sleep(0.05)
    if ending.endswith("die"):
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(ending))
    """
)


def run_shell(tmp_path, endings: list[str], max_replacements: int) -> tuple[int, list[dict], str]:
    """A shell over the child script whose trainer of generation g ends as `endings[g]` ("die": SIGKILL,
    "finished-die": SIGKILL after reporting the job finished at step 7, "standby-killed-die": SIGKILL once it
    killed the standby and the shell started another, or an exit status); returns (the shell's status, the
    children's records, the shell's output)."""
    log = tmp_path / "log.jsonl"
    script = tmp_path / "child.py"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script.write_text(CHILD.format(root=root, log=str(log), endings=endings))
    driver = (
        f"import sys; sys.path.insert(0, {root!r}); from trainer.run.rank_shell import RankShell; "
        f"sys.exit(RankShell([sys.executable, {str(script)!r}], {max_replacements}).run())"
    )
    env = {k: v for k, v in os.environ.items() if k != rank_shell.ROLE}
    env.update(RANK="1", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=120)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, records, proc.stdout + proc.stderr


def test_a_dead_trainer_is_replaced_by_the_standby_in_the_next_generation(tmp_path):
    status, records, out = run_shell(tmp_path, ["die", "die", "0"], max_replacements=4)
    assert status == 0, out
    trainers = [r for r in records if "trainer" in r]
    assert [t["generation"] for t in trainers] == [0, 1, 2], records
    assert len({t["trainer"] for t in trainers}) == 3  # three processes, one per generation
    activations = [r["activated"] for r in records if "activated" in r]
    assert [a["generation"] for a in activations] == [1, 2]
    assert all(r["role"] == "trainer" for r in records if "activated" in r)  # an activated standby trains
    assert [a["died"] for a in activations] == [t["trainer"] for t in trainers[:2]]  # each names its predecessor
    assert out.count("replaces it in generation") == 2, out


@pytest.mark.parametrize("status", [2, rank_shell.FALLBACK])
def test_a_clean_error_or_a_fallback_is_handed_to_torchrun(tmp_path, status):
    """Exit status 2 (a clean error) or 75 (asking for torchrun's restart) ends the slot with that status."""
    code, records, out = run_shell(tmp_path, [str(status)], max_replacements=4)
    assert code == status and not any("activated" in r for r in records), out


def test_replacements_are_bounded(tmp_path):
    """After `max_replacements` replacements the next death ends the slot: torchrun's restart takes over."""
    code, records, out = run_shell(tmp_path, ["die"], max_replacements=1)
    assert code == 128 + 9, out
    assert [r["generation"] for r in records if "trainer" in r] == [0, 1]
    assert "replacements spent: torchrun restarts" in out


def test_a_dead_standby_is_respawned_and_replaces_the_next_death(tmp_path):
    """The standby dies while the trainer runs: the shell starts a new one at once (one line), and the
    trainer's later death is replaced by it in place, not handed to torchrun."""
    status, records, out = run_shell(tmp_path, ["standby-killed-die", "0"], max_replacements=4)
    assert status == 0, out
    first, second = [r["standby"] for r in records if "standby" in r][:2]
    assert re.search(rf"^shell: rank 1: standby pid {first} died \(signal SIGKILL\); standby pid {second} ", out, re.M)
    assert [r["generation"] for r in records if "trainer" in r] == [0, 1], records
    assert "replaces it in generation 1" in out, out
