"""The rank shell's protocol with its children, in real processes (trainer/lifecycle/rank_shell.py).

The children are a small script (`run_shell` in tests/helpers.py) in the roles the shell gives them: a
"trainer" reports its generation on the shell's pipe and then dies or exits as the test says; a "standby"
waits for its activation and records it. The trainer itself under a shell runs in tests/test_real_deaths.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import ROOT, SHELL_CHILD, run_shell
from trainer.lifecycle import exit_codes


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
    assert [a["fault_step"] for a in activations] == [5, 6]  # ... and the iteration it died in
    assert out.count("replaces it in generation") == 2, out


def test_a_standby_prepares_once_its_trainer_trains(tmp_path):
    """A standby imports and prebuilds only when told (`fault.standby_prepare` when_training): once its slot's
    trainer says it trains (its generation set up and recovered), or right before its activation when the
    trainer died first; never during the replacement's recovery. With `at_once`, as soon as it starts."""
    status, records, out = run_shell(tmp_path, ["training-die", "die", "busy-0"], max_replacements=4)
    assert status == 0, out
    standbys = {r["standby"] for r in records if "standby" in r}
    assert len(standbys) == 3, records  # the first, and one behind each replacement (records in either order)
    activated = [r["trainer"] for r in records if r.get("generation") in (1, 2)]
    assert set(activated) < standbys, records
    assert [r["prepared"] for r in records if "prepared" in r] == activated, records  # the third never prepares
    second_trainer = records.index({"trainer": activated[0], "generation": 1})
    assert records.index({"prepared": activated[1]}) > second_trainer  # told at its activation, not before
    (tmp_path / "at_once").mkdir()
    status, records, out = run_shell(tmp_path / "at_once", ["busy-0"], max_replacements=4, at_once=True)
    prepared = [r["prepared"] for r in records if "prepared" in r]
    assert status == 0 and prepared == [r["standby"] for r in records if "standby" in r], records


def test_a_trainer_dead_before_its_first_word_is_replaced_too(tmp_path):
    """Its shell has not heard it yet (no heartbeat to go silent): its death is a death all the same."""
    status, records, out = run_shell(tmp_path, ["silent-die", "0"], max_replacements=4)
    assert status == 0, out
    assert [r["generation"] for r in records if "trainer" in r] == [1], records
    assert [(r["activated"]["generation"], r["activated"]["fault_step"]) for r in records if "activated" in r] == [
        (1, None)  # it began no iteration
    ]
    assert out.count("replaces it in generation") == 1, out


@pytest.mark.parametrize("status", [exit_codes.CLEAN_ERROR, exit_codes.FALLBACK])
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


def test_a_frozen_trainer_is_killed_and_replaced(tmp_path):
    """Guarantee: a hang costs the heartbeat bound (a detection charged in the records:
    tests/test_real_deaths.py::test_sigkill_in_backward_is_replaced_in_place).
    The trainer stops (SIGSTOP: a hang, its heartbeat thread stopped with it) and says nothing for longer
    than `fault.heartbeat_timeout_s`: the shell kills it (one line) and the standby replaces it, as after a death."""
    status, records, out = run_shell(tmp_path, ["freeze", "0"], max_replacements=4, heartbeat_timeout_s=1.5)
    assert status == 0, out
    frozen = [r["trainer"] for r in records if "trainer" in r][0]
    said = re.search(rf"^shell: rank 1: trainer pid {frozen} said nothing for ([\d.]+) s \(more than ", out, re.M)
    assert said and 1.5 <= float(said[1]) < 10, out
    replaced = re.search(
        rf"trainer pid {frozen} died \(signal SIGKILL\) at unix=(\S+); .* replaces it in generation 1", out
    )
    assert replaced, out
    assert [r["generation"] for r in records if "trainer" in r] == [0, 1], records
    # the replacement learns when the fault struck: the frozen trainer's last word, a silence before the kill
    [activation] = [r["activated"] for r in records if "activated" in r]
    assert 1.5 <= float(replaced[1]) - activation["fault_unix"] < 10, (activation, out)


def test_a_busy_trainer_whose_heartbeat_goes_on_is_not_killed(tmp_path):
    """A trainer busy (or waiting) for twice `fault.heartbeat_timeout_s` but not frozen keeps saying `alive`: the shell
    leaves it alone and the slot ends with its exit status."""
    status, records, out = run_shell(tmp_path, ["busy-0"], max_replacements=4, heartbeat_timeout_s=2)
    assert status == 0 and "said nothing" not in out, out
    assert [r["generation"] for r in records if "trainer" in r] == [0], records


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` has ended (and been reaped) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(("ending", "killer"), [("stop-shell-busy", "trainer"), ("stop-shell", "standby")])
def test_a_stopped_shell_is_killed_by_its_child(tmp_path, ending, killer):
    """The shell itself stops (a real SIGSTOP of the shell's process): it beats to its children no more, and
    one of them kills it after `fault.heartbeat_timeout_s` (one line), so torchrun, which waits on the shell,
    sees its worker die instead of waiting for ever. The trainer notices first; after the trainer exited,
    its standby does. The shell's children die with it."""
    started = time.monotonic()
    status, records, out = run_shell(tmp_path, [ending], max_replacements=4, heartbeat_timeout_s=2)
    assert status == -signal.SIGKILL, out
    assert time.monotonic() - started < 40, out  # the trainer of "stop-shell-busy" would live 60 s more
    children = {
        "trainer": [r["trainer"] for r in records if "trainer" in r],
        "standby": [r["standby"] for r in records if "standby" in r],
    }
    said = re.search(
        rf"^shell: rank 1: rank shell pid (\d+) said nothing for ([\d.]+) s "
        rf"\(more than fault.heartbeat_timeout_s=2 s\): stopped or stuck; "
        rf"killed by its {killer} pid {children[killer][0]} ",
        out,
        re.M,
    )
    assert said and 2 <= float(said[2]) < 30, out
    assert len(re.findall(r"said nothing", out)) == 1, out
    assert all(gone(pid) for pid in children["trainer"] + children["standby"]), records


def test_the_shell_imports_no_torch():
    """A rank shell is a thin parent: importing it (and what it imports to say and record its lines) loads no
    torch, which would cost seconds and, on a GPU, nothing it needs."""
    probe = "import sys, trainer.lifecycle.entry, trainer.lifecycle.rank_shell; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out


def test_sigterm_inside_the_shells_wait_for_its_standby_does_not_hang_it(tmp_path, monkeypatch):
    """torchrun's SIGTERM can land while the shell waits for a child (it stops its standby once the trainer
    ended), and the handler then runs inside that wait. It used to wait for the standby too, on the lock the
    interrupted wait holds: the shell hung until torchrun's SIGKILL 30 s later (the job's end took that
    long). Here the test holds that lock, as the interrupted wait does; the handler only sends signals."""
    from trainer.lifecycle import rank_shell

    script = tmp_path / "child.py"
    script.write_text(SHELL_CHILD.format(root=str(ROOT), log=str(tmp_path / "log.jsonl"), endings=["busy-0"]))
    monkeypatch.delenv(rank_shell.ROLE, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    previous = signal.getsignal(signal.SIGTERM)
    shell = rank_shell.RankShell([sys.executable, str(script)], 4, 600.0)
    try:
        with shell.standby._waitpid_lock:  # the shell's own `standby.wait()`, interrupted by the signal
            handler = threading.Thread(target=shell._forward_sigterm, args=(signal.SIGTERM, None), daemon=True)
            handler.start()
            handler.join(10)
            assert not handler.is_alive(), "the SIGTERM handler waits on the lock of the wait it interrupted"
        assert shell.stopping
        assert shell.child.wait(10) == -signal.SIGTERM and shell.standby.wait(10) == -signal.SIGKILL
    finally:
        signal.signal(signal.SIGTERM, previous)
        for child in (shell.child, shell.standby):
            child.kill()
            child.wait()
