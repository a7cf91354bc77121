"""Dense checkpoints that can be trusted, through real train.py / eval.harness processes and real files:
saving never destroys what it did not write and never leaves a complete-looking partial checkpoint;
loading never unpickles, refuses another run's state, and reports damage in one line naming the file."""

import dataclasses
import hashlib
import json
import os
import pickle
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import CHILD_ENV, DEBUG_CONFIG, ROOT, RUN_OUTPUTS, final_line, one_error, run_cli, step_losses
from trainer.checkpoint.dense_read import open_meta
from trainer.checkpoint.publish import CheckpointError
from trainer.config import load_config
from trainer.sealed_json import sealed

QUIET = ["--metrics.tensorboard", "false", "--metrics.log_every", "1", "--training.val_every", "0"]


def train(*args, **kw):
    return run_cli("--config", DEBUG_CONFIG, *QUIET, *args, **kw)


def harness(checkpoint: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eval.harness", "--checkpoint", str(checkpoint), "--limit", "1"],  # piqa_local
        cwd=ROOT,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def refused_before_training(proc: subprocess.CompletedProcess, *words: str) -> None:
    one_error(proc, "checkpoint.save_final", *words)
    assert proc.stderr.strip().count("\n") == 0 and step_losses(proc.stdout) == {}, proc.stdout


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, str]:
    """A checkpoint after 1 step of the debug config, and the stdout of the run that saved it."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    return ckpt, train("--training.steps", "1", "--checkpoint.save_final", str(ckpt)).stdout


@pytest.mark.slow
def test_save_final_refuses_what_it_would_destroy(tmp_path):
    """A user's directory, a file, a symlink or an unwritable place: refused before training, nothing touched."""
    users = tmp_path / "results"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    refused_before_training(
        train("--training.steps", "1", "--checkpoint.save_final", str(users), check=False), "not a MoEvement checkpoint"
    )
    assert os.listdir(users) == ["notes.txt"] and (users / "notes.txt").read_text() == "mine"
    file = tmp_path / "model"
    file.write_text("mine")
    refused_before_training(
        train("--training.steps", "1", "--checkpoint.save_final", str(file), check=False), "not a directory"
    )
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    refused_before_training(
        train("--training.steps", "1", "--checkpoint.save_final", str(tmp_path / "link"), check=False), "symlink"
    )
    assert sorted(os.listdir(tmp_path)) == ["empty", "link", "model", "results"] and file.read_text() == "mine"
    assert os.listdir(tmp_path / "empty") == []
    refused_before_training(
        train("--training.steps", "1", "--checkpoint.save_final", "/proc/x", check=False), "cannot write", "/proc/x"
    )


@pytest.mark.slow
def test_replacing_a_checkpoint_touches_nothing_else(tmp_path):
    """DIR.tmp and DIR.old are not ours; a checkpoint is replaced atomically, leaving no temporaries."""
    ckpt = tmp_path / "ckpt"
    for name in ("ckpt.tmp", "ckpt.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text(name)
    train("--training.steps", "2", "--training.stop_at", "1", "--checkpoint.save_final", str(ckpt))
    second = train("--training.steps", "2", "--checkpoint.save_final", str(ckpt)).stdout
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.old", "ckpt.tmp"]
    for name in ("ckpt.tmp", "ckpt.old"):
        assert os.listdir(tmp_path / name) == ["mine.txt"] and (tmp_path / name / "mine.txt").read_text() == name
    assert sorted(os.listdir(ckpt)) == ["meta.json", "model-00000.safetensors", "optim-00000.safetensors"]
    assert ckpt.stat().st_mode & 0o777 == 0o700 and all(p.stat().st_mode & 0o777 == 0o600 for p in ckpt.iterdir())
    loaded = train("--training.steps", "2", "--checkpoint.load", str(ckpt)).stdout
    assert json.loads((ckpt / "meta.json").read_text())["step"] == 2 and final_line(loaded) == final_line(second)
    # A checkpoint that also holds a file train.py did not write is not replaced.
    (ckpt / "eval_results.json").write_text("{}")
    meta = (ckpt / "meta.json").read_text()
    refused_before_training(
        train("--training.steps", "1", "--checkpoint.save_final", str(ckpt), check=False), "eval_results.json"
    )
    assert (ckpt / "meta.json").read_text() == meta and (ckpt / "eval_results.json").exists()
    # ... even when a crafted meta.json lists it among the checkpoint's files: the names come from the code
    crafted = json.loads(meta)
    crafted["files"]["eval_results.json"] = "0" * 64
    (ckpt / "meta.json").write_text(json.dumps(crafted))
    refused_before_training(
        train("--training.steps", "1", "--checkpoint.save_final", str(ckpt), check=False), "eval_results.json"
    )
    assert (ckpt / "eval_results.json").read_text() == "{}"


def test_interrupted_save_looks_incomplete_and_only_it_is_cleaned(tmp_path):
    """Guarantee: No data loss (saving deletes nothing it did not write).
    A save killed mid-write (SIGXFSZ at 512 KiB) leaves only a marked `.ckpt.tmp-*`; the next save
    removes it, and leaves a marked temporary of a live process and an unmarked look-alike alone."""
    ckpt = tmp_path / "ckpt"
    script = (
        "import runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); "
        "sys.argv = sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')"
    )
    args = ["train.py", "--config", DEBUG_CONFIG, *QUIET, "--training.steps", "1", "--checkpoint.save_final", str(ckpt)]
    args += ["--job.output_dir", str(RUN_OUTPUTS)]
    killed = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 19, 1 << 19)),
    )
    assert killed.returncode == -signal.SIGXFSZ and sorted(step_losses(killed.stdout)) == [1], killed.stderr
    assert "final step=" not in killed.stdout  # the final line comes with the checkpoint's publication
    [partial] = os.listdir(tmp_path)
    assert partial.startswith(".ckpt.tmp-") and "meta.json" not in os.listdir(tmp_path / partial)
    assert ".moevement-partial" in os.listdir(tmp_path / partial)
    one_error(train("--training.steps", "1", "--checkpoint.load", str(tmp_path / partial), check=False), "meta.json")
    live, lookalike = tmp_path / ".ckpt.tmp-live", tmp_path / ".ckpt.tmp-mine"
    live.mkdir()
    (live / ".moevement-partial").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    (live / "model.safetensors").write_text("being written")
    lookalike.mkdir()
    (lookalike / "model.safetensors").write_text("mine")
    train("--training.steps", "1", "--checkpoint.save_final", str(ckpt))
    assert sorted(os.listdir(tmp_path)) == [".ckpt.tmp-live", ".ckpt.tmp-mine", "ckpt"]
    assert sorted(os.listdir(live)) == [".moevement-partial", "model.safetensors"]
    assert os.listdir(lookalike) == ["model.safetensors"]


class _Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def test_old_pickled_format_is_refused_unread(tmp_path):
    """Guarantee: No code runs from saved state (never unpickled).
    A crafted DCP-format checkpoint whose `.metadata` pickle runs code: refused, and the code never runs."""
    sanity = tmp_path / "sanity"
    pickle.loads(pickle.dumps(_Payload(sanity)))
    assert sanity.exists()  # the payload is live
    crafted, marker = tmp_path / "crafted", tmp_path / "pwned"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    (crafted / "__0_0.distcp").write_bytes(b"\0" * 64)
    model = dataclasses.asdict(load_config(str(ROOT / DEBUG_CONFIG)).model)
    files = {name: sha256(crafted / name) for name in (".metadata", "__0_0.distcp")}
    (crafted / "meta.json").write_text(
        json.dumps({"format": "moevement-dense-v1", "step": 1, "loss": 1.0, "model": model, "files": files})
    )
    one_error(train("--training.steps", "1", "--checkpoint.load", str(crafted), check=False), "old", "re-save")
    one_error(harness(crafted), "old", "re-save")
    assert not marker.exists()


def test_checkpoint_of_another_config_needs_load_other_config(saved, tmp_path):
    """Guarantee: Nothing foreign or stale is restored.
    Another training.lr is refused naming meta.json and the key (another job.name is not a difference);
    with checkpoint.load_other_config it loads, listing the differences."""
    ckpt, stdout = saved
    other = [
        "--training.steps",
        "1",
        "--training.lr",
        "0.01",
        "--job.name",
        "fine_tune",
        "--checkpoint.load",
        str(ckpt),
    ]
    error = one_error(train(*other, check=False), str(ckpt / "meta.json"), "training.lr")
    assert "job.name" not in error
    allowed = train(*other, "--checkpoint.load_other_config", "true").stdout
    [line] = [line for line in allowed.splitlines() if line.startswith("checkpoint:") and "another config" in line]
    assert "training.lr" in line and "job.name" not in line
    assert f"checkpoint: loaded step 1 from {ckpt} (loss " in allowed
    assert step_losses(allowed) == {} and final_line(allowed) == final_line(stdout)


def test_damaged_checkpoint_is_one_line_naming_the_file(saved, tmp_path):
    """Guarantee: Bad input is one line (a damaged checkpoint).
    meta.json garbage, a truncated optimizer file, a safetensors file whose bytes match meta.json but
    do not parse: train.py and eval.harness each fail with one line naming the file."""
    from eval.checkpoint import load_checkpoint
    from eval.errors import EvalError

    cases = {
        "meta": ("meta.json", "unreadable"),
        "optim": ("optim-00000.safetensors", "checksum"),
        "model": ("model-00000.safetensors", "unreadable"),
    }
    for case, (name, what) in cases.items():
        ckpt = tmp_path / case
        shutil.copytree(saved[0], ckpt)
        if case == "meta":
            (ckpt / name).write_text('{"format": "moevement-dense-v3", "step": ')
        elif case == "optim":
            (ckpt / name).write_bytes((ckpt / name).read_bytes()[:-100])
        else:
            (ckpt / name).write_bytes(b"\xff" * 8 + b"not a header")
            meta = json.loads((ckpt / "meta.json").read_text())
            meta["files"][name] = sha256(ckpt / name)
            (ckpt / "meta.json").write_text(json.dumps(sealed(meta)))
        one_error(train("--training.steps", "1", "--checkpoint.load", str(ckpt), check=False), str(ckpt / name), what)
        if case != "optim":  # evaluation reads only the model tensors
            with pytest.raises(EvalError, match=f"{re.escape(str(ckpt / name))}.*{what}"):
                load_checkpoint(ckpt)


@pytest.mark.parametrize("flip", [0, pytest.param(1, marks=pytest.mark.slow)], ids=["step-1-to-0", "step-1-to-3"])
def test_a_flipped_step_in_meta_json_is_refused(saved, tmp_path, flip):
    """One bit of `"step": 1` flipped in meta.json: refused by its seal. Sealed again (a hash is not a
    signature), it is still refused: the optimizer's step count disagrees (never trained on from another step)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    raw = (ckpt / "meta.json").read_bytes()
    at = raw.index(b'"step": 1') + len(b'"step": ')
    (ckpt / "meta.json").write_bytes(raw[:at] + bytes([raw[at] ^ (1 << flip)]) + raw[at + 1 :])
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / 'meta.json'}: does not match its seal")):
        open_meta(str(ckpt))  # what train.py's --checkpoint.load reads first
    (ckpt / "meta.json").write_text(json.dumps(sealed(json.loads((ckpt / "meta.json").read_text()))))
    proc = train("--training.steps", "3", "--checkpoint.load", str(ckpt), check=False)
    one_error(proc, "optim-00000.safetensors", str(ckpt / "meta.json"), "(one of them was changed)")


@pytest.mark.parametrize(
    "keep_file", [pytest.param(True, marks=pytest.mark.slow), False], ids=["file-kept", "file-deleted"]
)
def test_an_optimizer_file_missing_from_meta_json_is_refused(saved, tmp_path, keep_file):
    """The optimizer file's entry deleted from a resealed meta.json (with or without the file): refused naming
    meta.json and the parameter without optimizer state, instead of training on fresh AdamW state. Saying
    `weights_only` does not pass either: only an imported step-0 checkpoint is weights-only."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["files"]["optim-00000.safetensors"]
    (ckpt / "meta.json").write_text(json.dumps(sealed(meta)))
    if not keep_file:
        (ckpt / "optim-00000.safetensors").unlink()
    proc = train("--training.steps", "3", "--checkpoint.load", str(ckpt), check=False)
    one_error(proc, str(ckpt / "meta.json"), "no optimizer state for", "no optimizer file): one is missing")
    (ckpt / "meta.json").write_text(json.dumps(sealed({**meta, "weights_only": True})))
    weights_only = re.escape(f"{ckpt / 'meta.json'}: a weights-only checkpoint is of step 0")
    with pytest.raises(CheckpointError, match=weights_only):
        open_meta(str(ckpt))


@pytest.mark.slow
def test_older_unsealed_formats_are_refused_and_file_names_are_checked(saved, tmp_path):
    """A checkpoint of an older version (v3: these files, meta.json unsealed; v2: one model.safetensors and
    one optim.safetensors) is refused in one line naming its format, by train.py and evaluation. A sealed
    meta.json listing a file by any other name (here one outside the directory) is refused naming 'files'."""
    from eval.checkpoint import load_checkpoint
    from eval.errors import EvalError

    ckpt, _ = saved
    meta = {k: v for k, v in json.loads((ckpt / "meta.json").read_text()).items() if k != "seal"}
    for old, files in (("v3", meta["files"]), ("v2", {"model.safetensors": "0" * 64, "optim.safetensors": "0" * 64})):
        older = tmp_path / old
        shutil.copytree(ckpt, older)
        (older / "meta.json").write_text(json.dumps({**meta, "format": f"moevement-dense-{old}", "files": files}))
        proc = train("--training.steps", "1", "--checkpoint.load", str(older), check=False)
        one_error(proc, str(older / "meta.json"), f"moevement-dense-{old} of an older version", "not sealed")
        with pytest.raises(EvalError, match="not sealed"):
            load_checkpoint(older)
    outside = tmp_path / "outside"
    shutil.copytree(ckpt, outside)
    shutil.copy(ckpt / "model-00000.safetensors", tmp_path / "model-00001.safetensors")
    files = {**meta["files"], "../model-00001.safetensors": meta["files"]["model-00000.safetensors"]}
    (outside / "meta.json").write_text(json.dumps(sealed({**meta, "files": files})))
    one_error(train("--training.steps", "1", "--checkpoint.load", str(outside), check=False), "meta.json", "files")


@pytest.mark.slow
def test_single_process_checkpoint_loads_into_sharded_layouts(tmp_path):
    """Each rank takes its own pipeline stages, experts and FSDP shards (parameters and AdamW state)
    from the safetensors files: pp=2,dp=2,ep=2 and dp=4,ep=2 report the saved state's digest."""
    ckpt = tmp_path / "ckpt"
    shape = [
        "--model.n_layers",
        "4",
        "--training.batch_size",
        "16",
        "--training.micro_batches",
        "4",
        "--training.seq_len",
        "64",
        "--training.steps",
        "3",
    ]
    saved_line = final_line(train(*shape, "--checkpoint.save_final", str(ckpt)).stdout)
    for layout in (
        ["--parallelism.pp", "2", "--parallelism.dp", "2", "--parallelism.ep", "2"],
        ["--parallelism.dp", "4", "--parallelism.ep", "2"],
    ):
        loaded = train(*shape, *layout, "--checkpoint.load", str(ckpt), nproc=4).stdout
        assert step_losses(loaded) == {} and final_line(loaded) == saved_line, layout


def test_streamed_safetensors_equal_the_library_s_and_name_their_sha256(tmp_path):
    """Checkpoints are written one tensor at a time; safetensors reads them back exactly (mixed dtypes, odd
    sizes, empty tensors), every tensor aligned to its element size, and the returned sha256 is the file's."""
    import torch
    from safetensors import safe_open

    from trainer.checkpoint.safetensors_stream import write_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "b.half": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "a.float": torch.randn(7, generator=gen),
        "c.long": torch.arange(3),
        "d.empty": torch.zeros(0, 4),
        "e.byte": torch.tensor([1, 2, 3], dtype=torch.uint8),
    }
    path = tmp_path / "t.safetensors"
    digest = write_safetensors(path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, tensors.__getitem__)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor) and f.get_tensor(name).dtype == tensor.dtype
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    sizes = {"F32": 4, "BF16": 2, "I64": 8, "U8": 1}
    assert all(v["data_offsets"][0] % sizes[v["dtype"]] == 0 for v in header.values())
    with pytest.raises(FileExistsError):  # never over an existing file
        write_safetensors(path, {}, tensors.__getitem__)


def test_a_failed_write_publishes_nothing_and_leaves_no_temporary(tmp_path):
    """A file that cannot be written (here: the disk fills up after the first tensor) is one CheckpointError
    naming the target; the marked temporary directory is removed and nothing appears at the target."""
    import errno

    import torch

    from models.args import ModelArgs
    from trainer.checkpoint.dense import CheckpointError, Tensors, save_imported

    def tensor_of(name: str) -> torch.Tensor:
        if name == "b":
            raise OSError(errno.ENOSPC, "No space left on device")
        return torch.zeros(4)

    model = Tensors({"a": (torch.float32, (4,)), "b": (torch.float32, (4,))}, tensor_of)
    with pytest.raises(CheckpointError, match=f"CKPT: cannot save to {re.escape(str(tmp_path / 'ckpt'))}.*space"):
        save_imported(str(tmp_path / "ckpt"), model, ModelArgs(), {"source": "test"}, key="CKPT")
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_one_rank_failing_to_write_fails_the_save_on_every_rank_and_leaves_nothing(tmp_path):
    """dp=2 (FSDP: the save walk assembles tensors across both ranks): rank 1 cannot write past 64 KiB
    (RLIMIT_FSIZE, SIGXFSZ ignored: the write fails with EFBIG). Rank 1 still takes part in the rest of the
    walk, both ranks fail with the same one-line error, and neither the checkpoint nor a temporary stays."""
    wrapper = tmp_path / "rank1_small_files.py"
    wrapper.write_text(
        "import os, resource, runpy, signal, sys\n"
        "if os.environ['RANK'] == '1':\n"
        "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))\n"
        f"sys.argv[0] = {str(ROOT / 'train.py')!r}\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')\n"
    )
    ckpt = tmp_path / "out" / "ckpt"
    args = ["--config", DEBUG_CONFIG, *QUIET, "--training.steps", "1", "--parallelism.dp", "2"]
    args += ["--checkpoint.save_final", str(ckpt), "--job.output_dir", str(RUN_OUTPUTS), "--fault.timeout_s", "120"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(wrapper), *args],
        cwd=ROOT,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 2 and len(set(errors)) == 1, proc.stderr
    assert f"cannot save to {ckpt}" in errors[0] and "File too large" in errors[0], errors[0]
    assert sorted(step_losses(proc.stdout)) == [1] and "final step=" not in proc.stdout  # said at publication
    assert str(ROOT / "trainer") not in proc.stderr  # no trace through ours
    assert os.listdir(tmp_path / "out") == []
