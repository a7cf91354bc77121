"""Periodic dense checkpoints (`checkpoint.dense_interval`, trainer/checkpoint/periodic.py) and where a run
starts (trainer/checkpoint/resume.py), through real train.py processes and real files: a relaunch resumes
from the newest checkpoint, bit-exact, and its record says so; no run deletes or overwrites another's
checkpoints; a death while writing or pruning leaves nothing half-made; a save that fails (a full disk) is
one line and training goes on; a damaged newest checkpoint falls back to the newest intact one; a recovery
in the same job deletes none."""

import json
import os
import re
import sys

import pytest

from tests.helpers import (
    BASE,
    CHILD_ENV,
    MOEVEMENT,
    PP2,
    ROOT,
    baseline,
    final_line,
    mounted_tmpfs,
    one_error,
    run_bounded,
    run_cli,
    run_events,
)
from trainer.checkpoint.events import CheckpointLoaded, CheckpointNotSaved, CheckpointSaved
from trainer.config import load_config
from trainer.records.event_log import run_folders


def train(*args: str, **kw):
    return run_cli(*BASE, "--training.steps", "6", *args, **kw)


def saving(folder, interval: int = 2, keep: int = 2) -> list[str]:
    return [
        *("--checkpoint.dense_interval", str(interval), "--checkpoint.keep_latest", str(keep)),
        *("--checkpoint.folder", str(folder)),
    ]


def run_record(stdout: str) -> tuple[dict, object]:
    """(run.json, config.toml loaded) of the last run folder a run's stdout names."""
    folder = run_folders(stdout, ROOT)[-1]
    return json.loads((folder / "run.json").read_text()), load_config(str(folder / "config.toml"))


def meta(path) -> dict:
    return json.loads((path / "meta.json").read_text())


def test_a_relaunch_resumes_from_the_newest_checkpoint_bit_exact(tmp_path):
    """Guarantee: No data loss (a relaunch resumes, bit-exact).
    Saves after steps 2 and 4 (keep_latest 2), then SIGKILL while step 6's files are written: step-2 and
    step-4 are published, step 6 is only a marked temporary. The same command relaunched (the kill aside)
    says it loads step 4 (MoEvement then restarts from its persisted window, newer), trains to the
    uninterrupted run's digest, removes the dead writer's temporary and prunes step 2 of its own lineage.
    Its record names where it started (step, meta.json's seal) and saves `load_step = 4`."""
    folder = tmp_path / "ck"
    job = [*saving(folder), *MOEVEMENT, "--checkpoint.host_dir", str(tmp_path / "shm")]  # fault.kill needs one
    killed = train(*job, "--fault.kill", "6:0:dense_save", check=False)
    assert killed.returncode == -9 and "fault: rank 0 killed (SIGKILL)" in killed.stdout, killed.stderr
    saved = [e for e in run_events(killed.stdout) if isinstance(e, CheckpointSaved)]
    assert [(e.step, e.directory) for e in saved] == [(2, str(folder / "step-2")), (4, str(folder / "step-4"))]
    entries = sorted(os.listdir(folder))
    assert entries[1:] == ["step-2", "step-4"] and entries[0].startswith(".step-6.tmp-"), entries
    resumed = train(*job).stdout
    loaded = [e for e in run_events(resumed) if isinstance(e, CheckpointLoaded)]
    expected = CheckpointLoaded(4, str(folder / "step-4"), meta(folder / "step-4")["loss"])
    assert [e.line() for e in loaded] == [expected.line()], resumed
    assert final_line(resumed) == final_line(train().stdout)
    assert sorted(os.listdir(folder)) == ["step-4", "step-6"]  # the stale temporary went, step 2 was pruned
    record, config = run_record(resumed)
    seal = meta(folder / "step-4")["seal"]
    assert record["resumed_from"] == {"checkpoint": str(folder / "step-4"), "step": 4, "meta_seal": seal}
    assert record["lineage"] == run_record(killed.stdout)[0]["lineage"] == meta(folder / "step-6")["lineage"]
    assert (config.checkpoint.load_step, config.checkpoint.load) == (4, "")


def test_no_run_deletes_or_overwrites_another_runs_checkpoints(tmp_path):
    """Guarantee: No data loss (no run deletes another's checkpoints).
    The two ways it happened: a 6-step run keeps steps 4 and 6 (keep_latest 2); the same job for 2 steps is
    refused (its newest checkpoint is past training.steps), and so is one with another training.lr (naming
    the key); started over on purpose (`load_step 0`) with that lr, it saves step 2, does not save step 4
    (the first run's, left byte for byte) and prunes only its own."""
    folder = tmp_path / "ck"
    train(*saving(folder))
    first = {step: (folder / step / "meta.json").read_bytes() for step in ("step-4", "step-6")}
    one_error(train(*saving(folder), "--training.steps", "2", check=False), "training.steps", "load_step 0")
    one_error(train(*saving(folder), "--training.lr", "0.01", check=False), "training.lr (saved 0.003, this run 0.01)")
    over = train(
        *saving(folder, keep=1), "--training.lr", "0.01", "--checkpoint.load_step", "0", "--training.steps", "4"
    )
    events = run_events(over.stdout)
    assert [e.step for e in events if isinstance(e, CheckpointSaved)] == [2], over.stdout
    [refused] = [e for e in events if isinstance(e, CheckpointNotSaved)]
    assert refused.step == 4 and "holds a checkpoint of another run" in refused.why
    assert sorted(os.listdir(folder)) == ["step-2", "step-4", "step-6"]
    assert {step: (folder / step / "meta.json").read_bytes() for step in first} == first
    assert meta(folder / "step-2")["lineage"] != meta(folder / "step-6")["lineage"]


@pytest.mark.slow
def test_a_kill_while_pruning_leaves_no_half_checkpoint_and_the_relaunch_tidies(tmp_path):
    """keep_latest 1, a save every step: rank 0 is SIGKILLed while pruning step 2 after publishing step 3
    (after its first file). What is left of step 2 is set aside, not a published checkpoint; the relaunch
    resumes from step 3, removes the remains, and ends with the uninterrupted run's digest."""
    folder = tmp_path / "ck"
    strategy = [*MOEVEMENT, "--checkpoint.host_dir", str(tmp_path / "shm")]
    killed = train(*saving(folder, 1, 1), *strategy, "--fault.kill", "3:0:dense_prune", check=False)
    assert killed.returncode == -9 and "in the dense_prune phase of step 3" in killed.stdout, killed.stderr
    entries = sorted(os.listdir(folder))
    assert entries[1:] == ["step-3"] and entries[0].startswith(".step-2.pruned-"), entries
    assert "meta.json" in os.listdir(folder / entries[0])  # set aside whole but for its first file
    resumed = train(*saving(folder, 1, 1)).stdout
    assert f"checkpoint: loaded step 3 from {folder / 'step-3'}" in resumed
    assert final_line(resumed) == final_line(train().stdout)
    assert sorted(os.listdir(folder)) == ["step-6"]


TIMEOUT = ["--fault.timeout_s", "120"]  # the old code waited this out for every save a full disk failed


def failed_saves(proc, folder, why: str) -> list:
    """The run went on past its failed saves: it ended with the digest of a run that saves nothing, well
    within fault.timeout_s, each failure one `not saved` line naming the folder, the megabytes rank 0 needed
    and those free, and `why`. Returns the events it recorded."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = run_events(proc.stdout)
    for e in (e for e in events if isinstance(e, CheckpointNotSaved)):
        pattern = rf"rank 0 could not write its \d+\.\d MB \([\d.]+ MB free in {folder}: {why}\)"
        assert re.fullmatch(pattern, e.why), e.why
    assert float(re.search(r"^accounting wall_s=(\S+)", proc.stdout, re.M)[1]) < 120, proc.stdout
    assert final_line(events) == final_line(baseline([], 1))
    return events


def test_a_full_disk_is_one_line_per_save_and_the_next_save_is_tried(tmp_path):
    """The folder on a real 8 MB file system (tmpfs; skipped where mounting is not allowed), one checkpoint
    about 5 MB: step 4 is saved, steps 8 and 12 find no room (`No space left on device`): each is one line,
    at once, and training goes on; no temporary stays."""
    with mounted_tmpfs(tmp_path / "small", "8m") as disk:
        folder = disk / "ck"
        proc = run_cli(*BASE, *saving(folder, 4, 1), *TIMEOUT, "--job.output_dir", str(tmp_path / "runs"))
        events = failed_saves(proc, folder, "No space left on device")
        assert [e.step for e in events if isinstance(e, CheckpointSaved)] == [4], proc.stdout
        assert [e.step for e in events if isinstance(e, CheckpointNotSaved)] == [8, 12], proc.stdout
        assert os.listdir(folder) == ["step-4"]


SMALL_FILES = (
    "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18)); "
    "sys.argv = sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')"
)


@pytest.mark.slow
def test_a_failed_save_is_one_line_and_training_goes_on(tmp_path):
    """The same where no mount is allowed: no file over 256 KiB can be written (RLIMIT_FSIZE, so the write
    fails with EFBIG): every due save is tried and is one line; no temporary stays."""
    folder = tmp_path / "ck"
    args = [*BASE, *saving(folder, 4), *TIMEOUT, "--job.output_dir", str(tmp_path / "runs")]
    proc = run_bounded([sys.executable, "-c", SMALL_FILES, "train.py", *args], ROOT, CHILD_ENV)
    events = failed_saves(proc, folder, "File too large")
    assert [e.step for e in events if isinstance(e, CheckpointNotSaved)] == [4, 8, 12], proc.stdout
    assert os.listdir(folder) == []


@pytest.mark.slow
@pytest.mark.parametrize("elastic", [False, True], ids=["relaunch", "elastic"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, elastic):
    """Steps 2 and 4 saved, one byte of step 4's model file flipped: the next start (a relaunch, or an
    elastic job's round) says step 4 is not usable, loads step 2 and ends with the uninterrupted run's
    digest, its new step 4 in place of the damaged one (its own lineage)."""
    folder = tmp_path / "ck"
    extra = ["--parallelism.elastic"] if elastic else []
    train(*saving(folder, keep=0), *extra, "--training.steps", "4")
    damaged = folder / "step-4" / "model-00000.safetensors"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    resumed = train(*saving(folder, keep=0), *extra).stdout
    assert re.search(rf"^checkpoint: step 4 in {folder / 'step-4'} is not usable \(.*checksum mismatch", resumed, re.M)
    assert f"checkpoint: loaded step 2 from {folder / 'step-2'}" in resumed
    assert final_line(resumed) == final_line(train().stdout)
    assert sorted(os.listdir(folder)) == ["step-2", "step-4", "step-6"]


@pytest.mark.slow
def test_load_step_errors_are_one_line(tmp_path):
    """A step the folder does not hold, `load_step` beside `load`, and a `dense_save` kill on a step that is
    not saved: one `error:` line each, naming the key."""
    folder = ["--checkpoint.folder", str(tmp_path / "none")]
    cases = [
        (("--checkpoint.load_step", "3", *folder), r"checkpoint.load_step: no checkpoint of step 3 in .*none"),
        (("--checkpoint.load_step", "3", "--checkpoint.load", str(tmp_path)), r"checkpoint.load_step.*give one"),
        ((*MOEVEMENT, "--checkpoint.dense_interval", "4", "--fault.kill", "6:0:dense_save"), r"fault.kill.*step 6"),
    ]
    for args, pattern in cases:
        proc = train(*args, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1 and re.search(pattern, errors[0]), proc.stderr


@pytest.mark.slow
def test_periodic_checkpoints_of_a_pipeline_survive_a_recovery(tmp_path):
    """pp=2 under torchrun: every rank writes its own files in the background and rank 0 publishes each
    step once both ranks recorded theirs. Rank 1 dies while writing step 6's and is replaced in place: as the
    next generation starts, rank 0 gives step 6 up with one line and removes its temporary; no checkpoint is
    deleted, the later ones are saved, and each loads to the uninterrupted run's digest."""
    folder = tmp_path / "ck"
    saving_ = ["--checkpoint.dense_interval", "3", "--checkpoint.folder", str(folder)]
    layout = [*BASE, *PP2, "--checkpoint.host_dir", str(tmp_path / "shm")]
    out = run_cli(*layout, *MOEVEMENT, *saving_, "--fault.kill", "6:1:dense_save", nproc=2).stdout
    assert "replaces it in generation 1" in out, out
    [lost] = [e for e in run_events(out) if isinstance(e, CheckpointNotSaved)]
    assert lost.step == 6 and lost.why == "ranks [1] recorded no files (a rank died while it was written)", out
    assert sorted(os.listdir(folder)) == ["step-12", "step-3", "step-9"], out  # no temporary left
    reference = final_line(baseline(PP2, 2))
    assert final_line(out) == reference
    for step in (3, 9):
        resumed = run_cli(*layout, "--checkpoint.load", str(folder / f"step-{step}"), nproc=2).stdout
        assert f"checkpoint: loaded step {step} from" in resumed and final_line(resumed) == reference
