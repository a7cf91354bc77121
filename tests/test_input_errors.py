"""Bad input gets one clear error line naming the key and the file, never a traceback (docs/design/interfaces.md,
"Errors").

End-to-end cases run `train.py` as a real subprocess; the rest check the same errors at the function
that raises them.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

# Never touch the network: must be set before `datasets` is first imported.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest

from moevement.failures import FaultPlan, FaultSpecError, KillEvent, read_trace
from tests.helpers import CHILD_ENV, DEBUG_CONFIG, ROOT, RUN_TIMEOUT_S, run_cli, start_session
from trainer.config import ConfigError, load_config
from trainer.data.batches import build_data
from trainer.data.corpus import DataConfig, DataError, load_tokens
from trainer.data.tokenizer import ByteTokenizer, TokenizerError, build_tokenizer

QUIET = ("--metrics.tensorboard", "false", "--metrics.progress", "false")


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """A private datasets cache so tests neither read nor litter ~/.cache."""
    return str(tmp_path_factory.mktemp("hf_datasets_cache"))


def train_error(*args: str) -> str:
    """The one `error: ` line of a `train.py` run that must fail on bad input (exit status 2)."""
    proc = run_cli("--config", DEBUG_CONFIG, *QUIET, "--training.steps", "2", *args, check=False)
    assert proc.returncode == 2, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)
    return path


GARBAGE = bytes(range(256)) * 8  # NUL bytes and invalid UTF-8


# ----------------------------------------------------------------------------- 1. tokenizer file


@pytest.mark.parametrize(
    "content, why",
    [  # the second in-process too: test_bad_tokenizer_file_says_why
        ('{"model": ', "not JSON"),
        pytest.param('{"a": 1}', "not a Hugging Face tokenizers file", marks=pytest.mark.slow),
    ],
)
def test_cli_bad_tokenizer_file_is_one_line(tmp_path, content, why):
    path = write(tmp_path / "tokenizer.json", content)
    line = train_error("--data.tokenizer", str(path))
    assert "data.tokenizer" in line and str(path) in line and why in line


def _bpe_json(special: list[str]) -> str:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, **{s: 2 + i for i, s in enumerate(special)}}, merges=[]))
    return tok.to_str()


@pytest.mark.parametrize(
    "content, why",
    [
        ("", "not JSON (the file is empty)"),
        ("{'model': 1}", "not JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        ("[1, 2]", 'no "model" object'),
        ('{"model": {"type": "BPE"}}', "not a valid tokenizers file"),
        ('{"a": 1}', "not a Hugging Face tokenizers file"),
        (_bpe_json([]), "none of the end-of-sequence tokens"),
    ],
)
def test_bad_tokenizer_file_says_why(tmp_path, content, why):
    path = write(tmp_path / "tok.json", content)
    with pytest.raises(TokenizerError, match=r"^data\.tokenizer: .*tok\.json") as e:
        build_tokenizer(str(path))
    assert why in str(e.value)
    with pytest.raises(DataError, match="data.tokenizer"):  # what train.py catches
        build_data(DataConfig(tokenizer=str(path)), 64, 8, 1, 0)


def test_good_tokenizer_file_still_loads(tmp_path):
    tok = build_tokenizer(str(write(tmp_path / "tok.json", _bpe_json(["</s>"]))))
    assert (tok.eos_id, tok.vocab_size) == (2, 3)
    with pytest.raises(TokenizerError, match="data.tokenizer: .*neither 'byte' nor an existing"):
        build_tokenizer(str(tmp_path / "absent.json"))


# ----------------------------------------------------------------------------- 2. data files


@pytest.mark.parametrize(
    "name, content, why",
    [  # the empty and non-UTF-8 files in-process: test_bad_data_file_names_file_and_cause
        pytest.param("valid.txt", b"", "is empty", marks=pytest.mark.slow),
        ("valid.txt", GARBAGE, "is binary, not text"),
        pytest.param(
            "valid.txt",
            b"caf\xe9 au lait\n" * 50,
            "is not UTF-8 text (invalid byte 0xe9 near offset 3)",
            marks=pytest.mark.slow,
        ),
        pytest.param("valid.jsonl", b"", "is empty", marks=pytest.mark.slow),
    ],
)
def test_cli_empty_or_binary_data_file_is_one_line(tmp_path, name, content, why):
    path = write(tmp_path / "data" / name, content)
    line = train_error("--data.dataset", str(path.parent), "--data.cache_dir", str(tmp_path / "cache"))
    assert line.startswith("error: data.dataset: ") and str(path) in line and "data.train_split='valid'" in line
    assert why in line and "An error occurred" not in line


@pytest.mark.slow
def test_cli_missing_text_field_and_missing_dir_are_one_line(tmp_path):
    path = write(tmp_path / "data" / "valid.jsonl", '{"body": "hello"}\n')
    line = train_error("--data.dataset", str(path.parent), "--data.cache_dir", str(tmp_path / "cache"))
    assert "data.text_field: column 'text' not found" in line and str(path) in line and "['body']" in line
    line = train_error("--data.dataset", str(tmp_path / "nowhere"))
    assert "data.dataset: path" in line and "does not exist" in line
    line = train_error("--data.dataset", str(path.parent), "--data.train_split", "train")
    assert "data.train_split: no file for split 'train'" in line


@pytest.mark.parametrize(
    "name, content, why",
    [
        ("valid.txt", b"", "is empty"),
        ("valid.txt", b"abc\x00def\n", "is binary, not text (NUL byte at offset 3)"),
        ("valid.txt", b"caf\xe9 au lait\n" * 50, "is not UTF-8 text (invalid byte 0xe9 near offset 3)"),
        ("valid.txt", b"\n  \n", "contains no text"),
        ("valid.jsonl", b"\n\n", "has no rows"),
        ("valid.json", b"[]", "has no rows"),
        ("valid.jsonl", b'{"text": "a"}\n{"text": \n', "JSON parse error"),
        ("valid.jsonl", b'{"text": 5}\n', "holds int, not text"),
        ("valid.jsonl", b'{"text": null}\n{"body": 1}\n', "contains no text"),
        ("valid.parquet", b"", "is empty"),
        ("valid.parquet", b"PAR1 not parquet", "ArrowInvalid"),
    ],
)
def test_bad_data_file_names_file_and_cause(tmp_path, hf_cache, name, content, why):
    path = write(tmp_path / name, content)
    with pytest.raises(DataError, match=r"^data\.(dataset|text_field): ") as e:
        load_tokens(DataConfig(dataset=str(tmp_path), cache_dir=hf_cache), "valid", ByteTokenizer())
    msg = str(e.value)
    assert why in msg and str(path) in msg and "data.train_split='valid'" in msg and "\n" not in msg


def test_shards_one_empty_is_fine_all_empty_is_not(tmp_path, hf_cache):
    cfg = DataConfig(dataset=str(tmp_path), cache_dir=hf_cache)
    write(tmp_path / "train-0.txt", "")
    write(tmp_path / "train-1.txt", "")
    with pytest.raises(DataError, match=r"all 2 files of .* \(data\.train_split='train'\) are empty"):
        load_tokens(cfg, "train", ByteTokenizer())
    write(tmp_path / "train-1.txt", "hello\n")
    assert load_tokens(cfg, "train", ByteTokenizer()).tolist() == list(b"hello\n")


def test_unlistable_data_directory(tmp_path, monkeypatch):
    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "iterdir", denied)
    with pytest.raises(DataError, match=r"^data\.dataset: cannot list directory .*: Permission denied"):
        load_tokens(DataConfig(dataset=str(tmp_path)), "valid", ByteTokenizer())


# ----------------------------------------------------------------------------- 3. training.steps


@pytest.mark.slow  # the message: test_zero_or_negative_steps_is_refused; a config error through the CLI is one
# line: tests/test_train.py::test_bad_config_is_one_error_line
def test_cli_zero_steps_is_refused():
    line = train_error("--training.steps", "0", "--dry-run")
    assert line == "error: config key 'training.steps' must be positive, got 0"


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_zero_or_negative_steps_is_refused(steps):
    with pytest.raises(ConfigError, match=f"'training.steps' must be positive, got {steps}"):
        load_config(str(ROOT / DEBUG_CONFIG), ["--training.steps", steps])


@pytest.mark.parametrize("mtbf", ["-1", "0.5", "1e-12"])
def test_mtbf_below_one_iteration_is_refused(mtbf):
    """A mean time between failures below one iteration is refused at load (1e-12 used to make the failure
    draw loop run for hours)."""
    with pytest.raises(ConfigError, match=r"'fault.mtbf_iters' must be 0 \(no failures\) or at least 1 iteration"):
        load_config(str(ROOT / DEBUG_CONFIG), ["--checkpoint.strategy", "moevement", "--fault.mtbf_iters", mtbf])


# ----------------------------------------------------------------------------- 4. failures after the last step

MOEVEMENT = ("--checkpoint.strategy", "moevement")


@pytest.mark.slow  # the message: test_fault_after_last_step_names_key_step_and_last_step; a config error through
# the CLI is one line: tests/test_train.py::test_bad_config_is_one_error_line
def test_cli_fault_after_last_step_is_refused():
    line = train_error(*MOEVEMENT, "--fault.at", "3:1", "--dry-run")
    assert "'fault.at'" in line and "step 3" in line and "last step 2" in line


@pytest.mark.parametrize(
    "args, key, step, last",
    [
        (["--fault.at", "5:1,61:0"], "fault.at", 61, 60),
        (["--fault.crash", "70:1"], "fault.crash", 70, 60),
        (["--fault.kill", "61:1:optimizer"], "fault.kill", 61, 60),
        (["--training.stop_at", "20", "--fault.at", "21:1"], "fault.at", 21, 20),
    ],
)
def test_fault_after_last_step_names_key_step_and_last_step(args, key, step, last):
    with pytest.raises(ConfigError, match=rf"'{key}' has a failure at step {step}, after the run's last step {last}"):
        load_config(str(ROOT / DEBUG_CONFIG), [*MOEVEMENT, *args])


@pytest.mark.parametrize("spec", ["5", "5:1:sideways", "0:1", "5:-1", "5:1:forward:again", "x:1"])
def test_malformed_fault_kill_names_the_key_and_the_phases(spec):
    phases = "forward, backward, clip, optimizer, snapshot, replication"
    with pytest.raises(ConfigError, match=rf"'fault.kill' must look like STEP:RANK\[:PHASE\].*{phases}"):
        load_config(str(ROOT / DEBUG_CONFIG), [*MOEVEMENT, "--fault.kill", spec])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("5:1:final", "kills in the final phase at the end of a run, whose last step is 12, not 5"),
        ("12:0:saved", "kills in the saved phase of checkpoint.save_final, which this run does not set"),
    ],
)
def test_an_end_of_run_kill_names_what_it_misses(spec, message):
    with pytest.raises(ConfigError, match=re.escape(f"config key 'fault.kill' {message}")):
        load_config(str(ROOT / DEBUG_CONFIG), [*MOEVEMENT, "--training.steps", "12", "--fault.kill", spec])


def test_fault_kill_fires_once_per_torchrun_generation():
    plan = FaultPlan(kill="6:1:backward,9:0,9:2:optimizer", world=4, last_step=10)
    assert [plan.kill_of(r, 0) for r in range(4)] == [None, KillEvent(6, 1, "backward"), None, None]
    assert [plan.kill_of(r, 1) for r in range(4)] == [
        KillEvent(9, 0, "forward"),
        None,
        KillEvent(9, 2, "optimizer"),
        None,
    ]
    assert all(plan.kill_of(r, 2) is None for r in range(4))
    # generations follow the order given: a death while the restarted job replays an earlier iteration
    plan = FaultPlan(kill="9:1:backward,7:1:replay", world=2, last_step=12)
    assert [plan.kill_of(1, g) for g in range(3)] == [KillEvent(9, 1, "backward"), KillEvent(7, 1, "replay"), None]
    # a survivor's death while it joins the next generation follows the death at the same step
    plan = FaultPlan(kill="9:1:backward,9:0:join", world=2, last_step=12)
    assert [plan.kill_of(0, g) for g in range(3)] == [None, KillEvent(9, 0, "join"), None]
    assert [plan.kill_of(1, g) for g in range(3)] == [KillEvent(9, 1, "backward"), None, None]


def test_fault_at_last_step_is_accepted():
    cfg = load_config(str(ROOT / DEBUG_CONFIG), [*MOEVEMENT, "--fault.at", "60:1", "--fault.crash", "60:0"])
    assert cfg.fault.at == "60:1"
    assert [e.step for e in FaultPlan("5:1", world=2, last_step=5).events] == [5]
    with pytest.raises(FaultSpecError, match="'fault.at' has a failure at step 6, after the run's last step 5"):
        FaultPlan("6:1", world=2, last_step=5)


# ----------------------------------------------------------------------------- 5. fault.trace


def test_cli_bad_trace_is_one_line(tmp_path):
    trace = write(tmp_path / "trace.csv", b"iteration,rank\n\xff\xfe,1\n")
    line = train_error(*MOEVEMENT, "--fault.trace", str(trace), "--dry-run")
    assert "'fault.trace'" in line and str(trace) in line and "not UTF-8" in line


@pytest.mark.parametrize(
    "content, why",
    [
        (b"", "must start with a header"),
        (b"a,b\n1,2\n", "must start with a header `iteration,rank` or `time_s,rank`, got ['a', 'b']"),
        (b"iteration,rank\n", "no failure rows"),
        (b"iteration,rank\n\xff,1\n", "not UTF-8"),
        (b"iteration,rank\n\n5,x\n", "line 3 must have"),
        (b"time_s,rank\nnan,1\n", "not a finite number"),
        (b"time_s,rank\n-1,1\n", "negative"),
        (b"iteration,rank\n0,1\n", "iteration < 1"),
    ],
)
def test_bad_trace_names_file_and_cause(tmp_path, content, why):
    trace = write(tmp_path / "trace.csv", content)
    with pytest.raises(FaultSpecError, match=r"^config key 'fault\.trace': ") as e:
        read_trace(str(trace))
    assert why in str(e.value) and str(trace) in str(e.value)
    with pytest.raises(FaultSpecError, match="cannot read it"):
        read_trace(str(tmp_path / "absent.csv"))
    with pytest.raises(FaultSpecError, match="cannot read it"):
        read_trace(str(tmp_path))


@pytest.mark.parametrize(
    "args, key",
    [
        (["--fault.kill_signal", "SIGTERM"], "fault.kill_signal"),
        (["--fault.timeout_s", "0"], "fault.timeout_s"),
        (["--fault.node_loss_s", "1"], "fault.node_loss_s"),
        (["--fault.heartbeat_timeout_s", "2"], "fault.heartbeat_timeout_s"),  # under a few 1 s heartbeats
        (["--fault.heartbeat_timeout_s", "1e9"], "fault.heartbeat_timeout_s"),  # over an hour
        (["--fault.heartbeat_timeout_s", "nan"], "fault.heartbeat_timeout_s"),
    ],
)
def test_bad_fault_detection_settings_name_the_key(args, key):
    with pytest.raises(ConfigError, match=rf"'{key}'"):
        load_config(str(ROOT / DEBUG_CONFIG), [*MOEVEMENT, *args])


def test_cli_unwritable_output_dir_is_one_line(tmp_path):
    """The run record cannot be written (output_dir is a file): one line naming job.output_dir."""
    blocker = write(tmp_path / "a-file", "not a directory")
    line = train_error("--job.output_dir", str(blocker))
    assert "job.output_dir" in line and str(blocker) in line


# In the default suite: an error every rank meets under torchrun and rank shells is one line for the job
# (test_an_error_every_rank_meets_is_one_line_and_the_job_ends_at_once).
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["none", "moevement"])  # moevement: rank shells
def test_a_config_error_under_torchrun_is_said_once_per_job(strategy):
    """Bad input is one line (a config error under torchrun).
    Every rank reads the same config: a bad key is one `error:` line for the job, not one per rank."""
    args = ("--training.steps", "0", "--checkpoint.strategy", strategy)
    proc = run_cli("--config", DEBUG_CONFIG, *QUIET, *args, nproc=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error: config key" in line]
    assert errors == ["error: config key 'training.steps' must be positive, got 0"], proc.stderr


def timed_torchrun(*args: str, nproc: int = 2) -> tuple[int, list[tuple[float, str]], float]:
    """`train.py args` under torchrun with `nproc` workers: (its exit status, each output line with the
    monotonic time it was read, the time the job ended)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    proc = start_session([*cmd, *args], ROOT, CHILD_ENV, stderr=subprocess.STDOUT)
    timed: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: timed.extend((time.monotonic(), line) for line in proc.stdout))
    reader.start()
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("hung") from None
    ended = time.monotonic()
    reader.join()
    return proc.returncode, timed, ended


def test_an_error_every_rank_meets_is_one_line_and_the_job_ends_at_once(tmp_path):
    """Guarantee: Bad input is one line (an error every rank meets under torchrun).
    Both ranks (under rank shells) fail to make a host directory whose parent is missing: one `error:` line
    for the job, and the job ends within seconds of it. (Each rank printed it; and a worker often took 30 s
    to end, until torchrun killed it: its SIGTERM landed while the rank shell waited for its standby.)"""
    host = tmp_path / "missing" / "host"
    args = ("--parallelism.dp", "2", "--checkpoint.strategy", "moevement", "--checkpoint.host_dir", str(host))
    args += ("--job.output_dir", str(tmp_path / "runs"))
    status, timed, ended = timed_torchrun("--config", DEBUG_CONFIG, *QUIET, "--training.steps", "2", *args)
    errors = [(at, line.strip()) for at, line in timed if "error:" in line]
    output = "".join(line for _, line in timed)
    assert status != 0 and [line for _, line in errors] == [f"error: {host}: its parent directory does not exist"], (
        output
    )
    # every worker exits 2, unless torchrun's SIGTERM after the first one's exit reaches its shell first
    codes = re.findall(r"exitcode  : (-?\d+) ", output)
    assert len(codes) == 2 and "2" in codes and set(codes) <= {"2", "-15"}, output
    assert ended - errors[0][0] < 20, output  # torchrun's SIGKILL comes 30 s after its SIGTERM


# In the default suite: any key's absurd value is one short line naming it, and an error line cuts what it does
# not bound itself (tests/test_config_bounds.py), and train.py says such errors in one line (its CLI cases there).
@pytest.mark.slow
def test_a_huge_config_value_is_one_bounded_line(tmp_path):
    """A 5 MB `job.name` (not a valid name) is one short `error:` line that quotes its start and says its
    length, not a 5 MB line."""
    text = (ROOT / DEBUG_CONFIG).read_text().replace("[job]\n", f'[job]\nname = "{"x/" * 2_500_000}"\n', 1)
    config = write(tmp_path / "huge.toml", re.sub(r'(?m)^name = "debug_moe"\n', "", text))
    proc = run_cli("--config", str(config), *QUIET, "--training.steps", "2", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[:2000]
    assert len(lines[0]) < 300 and lines[0].endswith(
        "'x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/x/'... (5000000 characters)"
    ), lines[0][-200:]
