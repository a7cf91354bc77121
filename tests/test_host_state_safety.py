"""Host state that can be trusted (docs/design/safety.md): what a restart accepts, where state lives, what
is refused, and what is cleaned. Real processes, real files, real signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from moevement.recovery.report import RecoveryReport
from tests.helpers import (
    DEBUG_CONFIG,
    ROOT,
    RUN_OUTPUTS,
    final_line,
    mounted_tmpfs,
    one_error,
    reached,
    recoveries,
    run_cli,
    step_losses,
    survivors,
)
from trainer.lifecycle.survivor_lines import PREEMPTED

BASE = [
    "--config",
    DEBUG_CONFIG,
    "--metrics.tensorboard",
    "false",
    "--training.val_every",
    "0",
    "--training.steps",
    "10",
    "--checkpoint.strategy",
    "moevement",
    "--checkpoint.window",
    "2",
]


def whole_job_restarts(out: str) -> list[RecoveryReport]:
    """MoEvement's recovery lines of a whole-job restart (`restart=global snapshots_from="..."`) a run recorded."""
    return [r for r in recoveries(out) if r.restart == "global" and r.strategy is None and r.snapshots_from is not None]


_references: dict[tuple[str, ...], str] = {}


def reference(*extra: str, nproc: int = 1) -> str:
    """stdout of the fault-free run with these extra arguments (once per session)."""
    key = (*extra, str(nproc))
    if key not in _references:
        _references[key] = run_cli(*BASE, *extra, nproc=nproc).stdout
    return _references[key]


def crash(*args: str) -> None:
    """A run whose process exits at `--fault.crash STEP:0` (no clean-up: its host state stays)."""
    proc = run_cli(*BASE, *args, check=False)
    assert proc.returncode == 13 and "fault: rank 0 crashes at step" in proc.stdout, proc.stdout + proc.stderr


def host(tmp_path: Path, *extra: str) -> list[str]:
    return [*extra, "--checkpoint.host_dir", str(tmp_path / "shm"), "--job.name", "safety"]


@pytest.mark.slow
def test_relaunch_resumes_and_foreign_state_is_refused(tmp_path):
    """A crashed job relaunched with the same config resumes from its persisted window (bit-exact); one
    with another learning rate refuses the window, naming the file and the key, and starts afresh."""
    args = host(tmp_path, "--checkpoint.persist_dir", str(tmp_path / "disk"))
    crash(*args, "--fault.crash", "8:0")
    other_lr = run_cli(*BASE, *args, "--training.lr", "0.001", "--training.steps", "10").stdout
    assert re.search(
        r"^restart: rank 0 rejected .*shm/safety/rank00000/local/w\d-s\d\.bin.*belongs to another run: "
        r"training\.lr \(saved 0\.003, this run 0\.001\)",
        other_lr,
        re.M,
    ), other_lr
    assert "STARTING FROM THE INITIAL STATE" in other_lr
    assert final_line(other_lr) == final_line(reference("--training.lr", "0.001"))
    # that run finished cleanly: its state is gone, so crash again and relaunch with the same config
    crash(*args, "--fault.crash", "8:0")
    resumed = run_cli(*BASE, *args).stdout
    m = whole_job_restarts(resumed)
    restart = [(r.step, r.rollback_to, r.replayed, "; ".join(r.snapshots_from)) for r in m[:1]]
    assert restart == [(8, 5, 2, "rank0: local shared memory")], resumed
    assert final_line(resumed) == final_line(reference())


def test_restart_falls_back_window_by_window(tmp_path):
    """Guarantee: No data loss (a restart falls back window by window); nothing stale is restored.
    Only persisted windows are used; a corrupted newest window (every copy) falls back to the older
    disk window, and a truncated header is named, not a traceback.

    The crash at 10 finds window 7 persisted and window 9 in flight. Window 5 is on disk for sure (the
    copy of iteration 9 waited for its write); whether the write of window 7 landed before the crash
    depends on timing, so every copy of window 7 that exists is corrupted."""
    disk = tmp_path / "disk"
    args = host(tmp_path, "--checkpoint.persist_dir", str(disk))
    crash(*args, "--fault.crash", "10:0")
    shm = tmp_path / "shm" / "safety" / "rank00000" / "local"
    newest = sorted(p for p in shm.glob("w*-s*.json") if '"window_start": 7' in p.read_text())
    [in_flight] = [p for p in shm.glob("w*-s*.json") if '"window_start": 9' in p.read_text()]
    assert len(newest) == 2
    _flip_byte(newest[0].with_suffix(".bin"))  # a flipped byte in memory (and on disk, if there)
    disk_copy = disk / "safety" / "window-00000007" / "rank00000" / "s0.bin"
    on_disk = disk_copy.exists()
    if on_disk:
        _flip_byte(disk_copy)
    in_flight.write_text(in_flight.read_text()[:40])  # a truncated header
    out = run_cli(*BASE, *args).stdout
    assert re.search(rf"^restart: rank 0 rejected {re.escape(str(in_flight))}: .*unreadable header", out, re.M), out
    rejected_disk = r"^restart: rank 0 rejected disk .*window-00000007/rank00000: .*checksum mismatch"
    assert bool(re.search(rejected_disk, out, re.M)) == on_disk, out
    assert "restart: window 7 has no intact copy on rank(s) 0; falling back to the next older window" in out
    m = whole_job_restarts(out)
    assert m and (m[0].rollback_to, m[0].replayed) == (5, 2) and "disk" in "; ".join(m[0].snapshots_from), out
    assert final_line(out) == final_line(reference())
    assert step_losses(out) == {t: v for t, v in step_losses(reference()).items() if t >= 7}  # trained from t0+W


@pytest.mark.slow
def test_a_damaged_linked_pair_falls_back_to_the_disk_copy(tmp_path):
    """Guarantee: No data loss (one corruption of a same-node replica's shared bytes).
    pp=2 on one node: rank 1's replicas on rank 0 are hard links to its own buffers, so one flipped byte
    spoils both names. Rank 1 crashes at 10; every buffer it holds in shared memory is then damaged in
    place. The relaunch rejects both names of each window and loads rank 1's window from persist_dir
    instead of the initial state, ending with the fault-free digest."""
    disk = tmp_path / "disk"
    args = [*host(tmp_path, "--checkpoint.persist_dir", str(disk)), "--parallelism.pp", "2"]
    args += ["--fault.max_replacements", "0"]  # no rank shell: the crash ends the job
    crashed = run_cli(*BASE, *args, "--fault.crash", "10:1", nproc=2, torchrun=("--max-restarts=0",), check=False)
    assert crashed.returncode != 0 and "fault: rank 1 crashes at step 10" in crashed.stdout, crashed.stdout
    job = tmp_path / "shm" / "safety"
    local = sorted((job / "rank00001" / "local").glob("w*-s*.bin"))
    linked = {p.stat().st_ino for p in (job / "rank00000" / "replicas" / "from1").glob("w*-s*.bin")}
    assert local and {p.stat().st_ino for p in local} & linked, "no replica shares a buffer with its sender"
    for path in local:
        if path.stat().st_size > 100:
            _flip_byte(path)  # in place: the linked replica changes with it
    out = run_cli(*BASE, *args, nproc=2).stdout
    rejected = re.findall(r"^restart: rank 1 rejected (local shared memory|replica on rank00000)\b", out, re.M)
    assert {"local shared memory", "replica on rank00000"} <= set(rejected), out
    [found] = whole_job_restarts(out)
    assert found.rollback_to > 0 and "rank1: disk" in "; ".join(found.snapshots_from), out
    assert final_line(out) == final_line(reference("--parallelism.pp", "2", nproc=2))


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "case",
    [
        "symlink",
        "foreign-owner",
        pytest.param("group-readable", marks=pytest.mark.slow),  # the same owner-only check as foreign-owner
        "planted-lock-symlink",
        "file",
    ],
)
def test_unsafe_host_directories_are_refused(tmp_path, case):
    """A host directory that is a symlink, owned by someone else, open to others, or a file is refused with
    one line; a planted symlink is never followed (its target stays untouched)."""
    shm, victim = tmp_path / "shm", tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o600)
    if case == "symlink":
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        shm.symlink_to(real)
        expect = "is a symlink"
    elif case == "foreign-owner":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        shm.mkdir(mode=0o700)
        os.chown(shm, 65534, 65534)
        expect = "owned by uid 65534"
    elif case == "group-readable":
        shm.mkdir()
        shm.chmod(0o755)
        expect = "group/other permissions"
    elif case == "planted-lock-symlink":
        (shm / "safety").mkdir(parents=True, mode=0o700)
        shm.chmod(0o700)
        (shm / "safety" / "rank00000.lock").symlink_to(victim)
        expect = "rank00000.lock: cannot open"
    else:
        shm.write_text("not a directory")
        shm.chmod(0o600)
        expect = "not a directory"
    proc = run_cli(*BASE, *host(tmp_path), "--training.steps", "1", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expect in errors[0] and "Traceback" not in proc.stderr, proc.stderr
    assert victim.read_bytes() == b"precious"


@pytest.mark.slow
def test_one_ranks_clean_error_under_torchrun_is_one_line_for_the_job(tmp_path):
    """pp=2 under torchrun: only rank 1's lock is a planted symlink. Rank 1 stops with one `error:` line;
    rank 0, whose collective then fails, learns from torchrun's store that its peer stopped with an error
    and stops too, silently (no traceback, no attempt to replace rank 1), exit status 2."""
    shm, victim = tmp_path / "shm", tmp_path / "victim"
    victim.write_bytes(b"precious")
    (shm / "safety").mkdir(parents=True, mode=0o700)
    shm.chmod(0o700)
    (shm / "safety" / "rank00001.lock").symlink_to(victim)
    proc = run_cli(*BASE, *host(tmp_path), "--parallelism.pp", "2", nproc=2, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "rank00001.lock: cannot open" in errors[0], text
    assert 'train.py", line' not in text and "Connection closed" not in text, text  # no survivor traceback
    assert "survivor:" not in text and "replaces it" not in text, text
    assert re.search(r"exitcode\s*:\s*2", text), text  # every worker's status (torchrun's summary)
    assert victim.read_bytes() == b"precious"


def test_default_host_dir_is_per_user_and_owner_only():
    from moevement.storage.private_files import default_host_dir

    assert default_host_dir().endswith(f"moevement-{os.geteuid()}")


def test_a_refused_pin_finds_the_loaded_runtime_library_to_clear_its_error():
    """`pin_or_warn` clears the CUDA runtime's error through the libcudart this process loaded (no CUDA here:
    the same lookup, for the C library every process maps)."""
    import ctypes

    from moevement.storage.host_memory import loaded_library

    libc = loaded_library("libc")
    assert libc is not None and Path(libc).is_file()
    assert ctypes.CDLL(libc).getpid() == os.getpid()  # the process's own instance, as for cudaGetLastError
    assert loaded_library("libmoevement-no-such-library") is None


@pytest.mark.slow
def test_second_live_job_is_refused_and_clean_keeps_it(tmp_path):
    """While a job runs, a second run of the same job exits with one line and leaves the first intact; the
    clean tool keeps a live job's state and removes a dead one's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    long_run = ["--training.steps", "120", "--metrics.log_every", "1"]
    cmd = [sys.executable, "train.py", *BASE, *host(tmp_path), *long_run, "--job.output_dir", str(RUN_OUTPUTS)]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        head = "".join(_wait_until_recorded(first, 3))  # holds the `run:` line naming the run's records
        folders = sorted(os.listdir(RUN_OUTPUTS / "safety"))
        second = run_cli(*BASE, *host(tmp_path), *long_run, check=False)
        assert sorted(os.listdir(RUN_OUTPUTS / "safety")) == folders  # the refused run left no run folder
        assert second.returncode == 2 and re.search(
            r"^error: .*rank00000\.lock: held by a live process \(pid "
            rf"{first.pid}\)",
            second.stderr,
            re.M,
        ), second.stderr
        clean = _clean(tmp_path)
        assert "kept" in clean and "the job is running" in clean
    finally:
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert final_line(head + out) == final_line(reference(*long_run))
    crash(*host(tmp_path), "--fault.crash", "6:0")
    assert list((tmp_path / "shm" / "safety" / "rank00000" / "local").glob("*.bin"))
    assert re.search(r"^removed .*shm/safety \(\d+\.\d MB\)$", _clean(tmp_path), re.M)
    assert not (tmp_path / "shm" / "safety").exists()


def test_a_run_refused_by_the_job_lock_leaves_nothing_behind(tmp_path):
    """While another process holds the job's lock, a run of the job is refused with one line naming the lock,
    before it makes a run folder or reads any checkpoint."""
    from moevement.storage.host_memory import JobLock
    from moevement.storage.private_files import make_private_dirs

    held = JobLock(make_private_dirs(tmp_path / "shm", "safety") / "rank00000.lock")
    try:
        proc = run_cli(*BASE, *host(tmp_path), "--job.output_dir", str(tmp_path / "runs"), check=False)
    finally:
        held.release()
    one_error(proc, "rank00000.lock: held by a live process", f"(pid {os.getpid()})")
    assert not (tmp_path / "runs").exists(), os.listdir(tmp_path / "runs")


def _clean(tmp_path: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "moevement.clean", "--host-dir", str(tmp_path / "shm")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _wait_until_recorded(proc: subprocess.Popen, step: int, timeout: float = 300) -> list[str]:
    """The lines `proc` printed until its run record holds iteration `step` (it logs every iteration)."""
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError(f"process ended before iteration {step}:\n{''.join(lines)}")
        lines.append(line)
        if reached("".join(lines), step):
            return lines
    raise AssertionError(f"iteration {step} not recorded within {timeout} s")


@pytest.mark.slow
def test_sigterm_to_torchrun_then_relaunch_resumes(tmp_path):
    """SIGTERM to the torchrun agent (a scheduler's preemption notice): the workers exit at once saying the
    state is kept; relaunching the same command resumes from the newest persisted window, bit-exact."""
    pp2 = [
        "--parallelism.pp",
        "2",
        "--training.micro_batches",
        "2",
        "--training.steps",
        "14",
        "--metrics.log_every",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
        *BASE,
        *pp2,
        *host(tmp_path),
        *("--job.output_dir", str(RUN_OUTPUTS)),
    ]
    agent = subprocess.Popen(
        launch, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        head = "".join(_wait_until_recorded(agent, 9))
        agent.send_signal(signal.SIGTERM)
        out = head + agent.communicate(timeout=60)[0]
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    assert any(e.what == PREEMPTED for e in survivors(out)), out
    relaunched = run_cli(*BASE, *pp2, *host(tmp_path), nproc=2).stdout
    m = whole_job_restarts(relaunched)
    assert m, relaunched
    assert m[0].rollback_to >= 5  # a persisted window after the profile, not the initial state
    assert final_line(relaunched) == final_line(reference(*pp2, nproc=2))


def _victim(tmp_path: Path) -> Path:
    """A directory not written by this program that looks like a window of rank 0."""
    victim = tmp_path / "victim"
    (victim / "rank00000").mkdir(parents=True, mode=0o700)
    (victim / "rank00000" / "keep.txt").write_text("not ours")
    victim.chmod(0o700)
    return victim


def test_removal_never_follows_a_symlinked_parent(tmp_path):
    """`remove_tree` walks down from its anchor by directory descriptors: a `window-*` that is a symlink is
    refused (HostMemoryError), and nothing behind it is deleted; a real owner-only tree is removed."""
    from moevement.storage.host_memory import private_subdirs, remove_tree
    from moevement.storage.private_files import HostMemoryError, make_private_dirs

    root = make_private_dirs(tmp_path / "disk", "job")
    victim = _victim(tmp_path)
    (root / "window-00000001").symlink_to(victim)
    own = make_private_dirs(root, "window-00000002", "rank00000")
    (own / "s0.bin").write_bytes(b"ours")
    assert private_subdirs(root, "window-", "rank00000") == [own]  # the link is not listed
    with pytest.raises(HostMemoryError, match="window-00000001"):
        remove_tree(root / "window-00000001" / "rank00000", root)
    assert (victim / "rank00000" / "keep.txt").read_text() == "not ours"
    remove_tree(own, root)
    assert not own.exists() and (root / "window-00000002").is_dir()
    remove_tree(own, root)  # already gone: fine


def test_a_fresh_checkfreq_run_leaves_a_symlinked_window_alone(tmp_path):
    """Guarantee: No data loss (nothing deleted through a symlink).
    A fresh CheckFreq run removes its rank's old disk windows; a `window-*` link planted in its persist
    directory is neither followed nor deleted, and the directory it points to keeps its files."""
    from moevement.storage.private_files import make_private_dirs

    disk = tmp_path / "disk"
    job = make_private_dirs(disk, "safety")
    victim = _victim(tmp_path)
    (job / "window-00000001").symlink_to(victim)
    args = host(tmp_path, "--checkpoint.persist_dir", str(disk))
    args = [a if a != "moevement" else "checkfreq" for a in args]
    out = run_cli(*BASE, *args, "--checkpoint.strategy", "checkfreq", "--checkpoint.interval", "3").stdout
    assert final_line(out) == final_line(reference())
    assert (victim / "rank00000" / "keep.txt").read_text() == "not ours"
    assert (job / "window-00000001").is_symlink()


@pytest.mark.slow
def test_clean_keeps_a_job_whose_torchrun_agent_lives(tmp_path):
    """Between a worker's death and torchrun's next generation no worker holds a lock, but the agent lives
    and will restart it: `moevement.clean` keeps the job's state then (naming the agent), and the restarted
    generation resumes from it instead of retraining from step 1."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "--max-restarts=1"]
    long_run = ["--training.steps", "40", "--metrics.log_every", "1", "--job.output_dir", str(RUN_OUTPUTS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        [*torchrun, "train.py", *BASE, *host(tmp_path), *long_run],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        _wait_until_recorded(agent, 8)
        [worker] = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
        os.kill(agent.pid, signal.SIGSTOP)  # hold the agent between the death and its next generation
        os.kill(int(worker), signal.SIGKILL)
        while _lock_held(tmp_path):  # the worker is gone once the kernel dropped its lock
            time.sleep(0.05)
        clean = _clean(tmp_path)
        assert f"its torchrun agent (pid {agent.pid}) lives" in clean, clean
        os.kill(agent.pid, signal.SIGCONT)
        out, _ = agent.communicate(timeout=300)
    finally:
        with suppress(ProcessLookupError):
            os.kill(agent.pid, signal.SIGCONT)
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0
    [rollback_to] = [r.rollback_to for r in whole_job_restarts(out)]
    assert rollback_to > 1, out  # resumed from the kept state, not retrained from step 1
    (tmp_path / "reference").mkdir()
    fault_free = reference("--training.steps", "40", *host(tmp_path / "reference"))
    assert final_line(out) == final_line(fault_free)


def _lock_held(tmp_path: Path) -> bool:
    from moevement.storage.host_memory import JobLock

    return JobLock.held(tmp_path / "shm" / "safety" / "rank00000.lock")


@pytest.fixture
def small_disk(tmp_path):
    """A real 512 KiB file system (tmpfs; needs the right to mount, as root here and in CI), owner-only."""
    with mounted_tmpfs(tmp_path / "small", "512k") as mount:
        yield mount


def test_a_full_persist_dir_is_one_line_and_leaves_no_temporary(tmp_path, small_disk):
    """persist_dir on a file system too small for one window: the run stops with one `error:` line naming
    the directory and the bytes needed (no traceback), and no temporary directory stays behind."""
    proc = run_cli(*BASE, *host(tmp_path, "--checkpoint.persist_dir", str(small_disk)), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert re.match(
        rf"^error: {small_disk}/safety/window-\d+: cannot write the sparse checkpoint of window \d+ "
        r"\(\d+\.\d MB needed, \d+\.\d MB free: No space left on device\)$",
        line,
    ), line
    assert not [p for p in small_disk.rglob("*") if p.name.endswith(".tmp")]


def test_a_full_host_dir_commit_is_one_error_naming_the_directory(small_disk):
    """A commit record that does not fit is a HostMemoryError naming the directory and the bytes needed,
    and leaves no temporary file."""
    from moevement.storage.private_files import HostMemoryError, make_private_dirs, write_json_atomic

    job = make_private_dirs(small_disk, "job")
    filler = job / "filler"
    with pytest.raises(OSError):
        filler.write_bytes(bytes(1 << 20))  # fills the file system
    with pytest.raises(HostMemoryError, match=rf"^{job}: cannot write w0-s0\.json \(0\.\d MB needed, 0\.0 MB free"):
        write_json_atomic(job / "w0-s0.json", {"entries": ["x" * 8192]})
    assert sorted(p.name for p in job.iterdir()) == ["filler"]


def test_a_record_in_parts_is_written_sealed_byte_for_byte_through_short_writes(tmp_path, monkeypatch):
    """A commit record handed over in parts (a layout's entries are one, never joined) is written exactly as
    its joined bytes sealed, and reads back; a `pwritev` that stops short is continued where it stopped."""
    import os

    from moevement.storage import host_memory, private_files
    from moevement.storage.sealed import seal

    parts = (b'{"iteration": 3, "checksums": []', b', "entries": ', b"[" + b'"x", ' * 5000 + b'"y"]', b"}")
    real_pwritev, calls = os.pwritev, []

    def short_pwritev(fd, views, offset):  # at most 4 KiB per call, and never a whole part at once
        first = bytes(views[0])[: min(4096, max(1, len(views[0]) - 1))]
        calls.append(len(first))
        return real_pwritev(fd, [first], offset)

    monkeypatch.setattr(private_files.os, "pwritev", short_pwritev)
    path = private_files.make_private_dirs(tmp_path, "job") / "w0-s0.json"
    private_files.write_json_atomic(path, parts)
    assert path.read_bytes() == seal(b"".join(parts)) == seal(parts)
    assert len(calls) > len(parts) + 3  # it went on after short writes
    monkeypatch.undo()
    assert host_memory.read_header(path.with_suffix("")) == {
        "iteration": 3,
        "checksums": [],
        "entries": [*"x" * 5000, "y"],
    }


# In the default suite: a changed header refused by its hash (tests/test_commit_file.py::
# test_a_spare_changed_while_retired_is_refused_by_readers_never_read_as_valid), a restart that rejects damaged
# copies, names them and ends bit-exact (test_restart_falls_back_window_by_window).
@pytest.mark.slow
def test_a_changed_header_value_is_a_rejected_copy(tmp_path):
    """No code runs from saved state (every header hashed); bit-exact whole-job restart.
    One digit of the learning rate in a snapshot's commit record (a scalar the replay uses) is changed in
    host memory: the header's hash refuses that copy, naming the file, and the run never uses it (it ends with
    the fault-free run's state)."""
    args = host(tmp_path)
    crash(*args, "--fault.crash", "10:0")
    shm = tmp_path / "shm" / "safety" / "rank00000" / "local"
    [changed] = sorted(p for p in shm.glob("w*-s1.json") if b'"window_start": 7' in p.read_bytes())
    raw = changed.read_bytes()
    at = raw.index(b'"lr": ') + len(b'"lr": ') + 2  # a digit of the learning rate
    changed.write_bytes(raw[:at] + (b"7" if raw[at : at + 1] != b"7" else b"3") + raw[at + 1 :])
    out = run_cli(*BASE, *args).stdout
    assert re.search(rf"^restart: rank 0 rejected {re.escape(str(changed))}: .*header hash mismatch", out, re.M), out
    assert final_line(out) == final_line(reference())
