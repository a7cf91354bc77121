"""Prepared corpora (trainer/data/prepare.py, trainer/data/token_shards.py): the same batches as the in-memory
path, resumable preparation, one-line errors on damaged shards, and a training run's digest."""

import os

# Never touch the network: must be set before `datasets` is first imported.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import CHILD_ENV, DEBUG_CONFIG, ROOT, final_line, recoveries, run_cli
from trainer.data import corpus, token_shards
from trainer.data import prepare as prepare_data
from trainer.data.batches import build_data, make_loader
from trainer.data.corpus import DataConfig, DataError, load_tokens
from trainer.data.token_shards import INDEX_NAME, PROGRESS_NAME, file_sha256, open_split, verify_prepared
from trainer.data.tokenizer import build_tokenizer
from trainer.sealed_json import seal_of

WIKI = corpus.SHARED_WIKITEXT2
needs_wiki = pytest.mark.skipif(not (WIKI / "valid.txt").is_file(), reason=f"{WIKI} not present")
SHARD = 10007  # tokens per shard in these tests: prime, so 65- and 129-token rows cross shard boundaries


def prepare(out: Path, *args: str) -> int:
    return prepare_data.main(["--out", str(out), "--shard-tokens", str(SHARD), *args])


def shard_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_datasets_cache"))


@pytest.fixture(scope="module")
def prepared_wiki(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "wikitext-2"
    assert prepare(out, "--data.dataset", "wikitext-2") == 0
    return out


def assert_same_batches(a, b, steps, dp=2) -> None:
    assert (a.num_tokens, a.num_sequences, a.batches_per_epoch) == (b.num_tokens, b.num_sequences, b.batches_per_epoch)
    for step in steps:
        for rank in range(dp):
            xa, ya = a.local_batch(step, rank, dp)
            xb, yb = b.local_batch(step, rank, dp)
            assert torch.equal(xa, xb) and torch.equal(ya, yb), (step, rank)


# ----------------------------------------------------------------------------- same batches


@needs_wiki
def test_prepared_wikitext_serves_the_in_memory_batches(prepared_wiki, hf_cache):
    tok, mem_train, mem_val = build_data(DataConfig(cache_dir=hf_cache), 64, 8, 2, seed=1234)
    _, train, val = build_data(DataConfig(dataset=str(prepared_wiki)), 64, 8, 2, seed=1234)
    assert len(train.tokens.files) == -(-train.num_tokens // SHARD) > 100  # many shards, rows across them
    every = np.empty(train.num_tokens, dtype=np.int64)
    train.tokens.read(0, every)
    assert every.tolist() == load_tokens(DataConfig(), "valid", tok).tolist()
    bpe = train.batches_per_epoch
    assert_same_batches(train, mem_train, [0, 1, bpe - 1, bpe, 3 * bpe + 2])
    assert_same_batches(val, mem_val, range(val.num_batches))
    # a spawned loader worker gets the shards by path and maps them again
    again = pickle.loads(pickle.dumps(train.tokens))
    idx = train.global_indices(5)
    assert torch.equal(again.sequences(idx, 65), mem_train.tokens.sequences(idx, 65))
    loader = make_loader(train, start_step=7, dp_rank=1, dp_size=2, num_workers=2, end_step=9)
    for step, x, y in loader:
        ex, ey = mem_train.local_batch(step, 1, 2)
        assert torch.equal(x, ex) and torch.equal(y, ey)


def _wordlevel_tokenizer(path: Path, size: int) -> Path:
    """A word-level tokenizer.json with ``size`` words (``w0`` ..), eos ``</s>`` last."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size - 2)} | {"[UNK]": size - 2, "</s>": size - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def test_jsonl_with_a_32_bit_vocabulary_resumes_inside_chunks(tmp_path, hf_cache, monkeypatch):
    rng = np.random.default_rng(0)
    docs = {
        split: [" ".join(f"w{w}" for w in rng.integers(0, 70_000, size=rng.integers(1, 60))) for _ in range(n)]
        for split, n in (("train", 300), ("valid", 40))
    }
    for split, texts in docs.items():
        (tmp_path / "src").mkdir(exist_ok=True)
        rows = [{"text": t} for t in texts] + [{"text": "  "}, {"text": None}]  # skipped as in memory
        (tmp_path / "src" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = _wordlevel_tokenizer(tmp_path / "tokenizer.json", 70_003)
    keys = ["--data.dataset", str(tmp_path / "src"), "--data.tokenizer", str(tokenizer)]
    keys += ["--data.train_split", "train", "--data.val_split", "valid", "--data.cache_dir", hf_cache]
    monkeypatch.setattr(prepare_data, "CHUNK_CHARS", 2000)  # many chunks; shards end inside them
    assert prepare(tmp_path / "whole", *keys) == 0
    assert prepare(tmp_path / "parts", *keys, "--max-shards", "1") == 0
    assert prepare(tmp_path / "parts", *keys, "--max-shards", "0") == 0  # resumes, writes nothing
    assert prepare(tmp_path / "parts", *keys) == 0
    assert shard_files(tmp_path / "parts") == shard_files(tmp_path / "whole")
    index = json.loads((tmp_path / "whole" / INDEX_NAME).read_text())
    assert index["dtype"] == "uint32" and index["splits"]["train"]["num_documents"] == 300

    cfg = DataConfig(dataset=str(tmp_path / "src"), tokenizer=str(tokenizer), train_split="train", val_split="valid")
    tok, mem_train, mem_val = build_data(DataConfig(**{**cfg.__dict__, "cache_dir": hf_cache}), 15, 4, 2, seed=3)
    assert max(load_tokens(cfg, "train", tok).tolist()) > 1 << 16
    _, train, val = build_data(DataConfig(**{**cfg.__dict__, "dataset": str(tmp_path / "whole")}), 15, 4, 2, seed=3)
    assert_same_batches(train, mem_train, range(train.batches_per_epoch + 2))
    assert_same_batches(val, mem_val, range(val.num_batches))


# ----------------------------------------------------------------------------- resumable


@needs_wiki
def test_interrupted_preparation_resumes_to_identical_shards(tmp_path, prepared_wiki):
    out = tmp_path / "parts"
    assert prepare(out, "--max-shards", "3") == 0
    assert not (out / INDEX_NAME).exists() and (out / PROGRESS_NAME).exists()
    with pytest.raises(DataError, match=r"^data\.dataset: prepared corpus .* is an unfinished preparation"):
        build_data(DataConfig(dataset=str(out)), 64, 8, 2, 0)
    # what a kill leaves: a half-written shard under its temporary name, a renamed one not yet recorded
    (out / ".valid-00003.bin.partial").write_bytes(b"\x07" * 100)
    (out / "valid-00003.bin").write_bytes(b"\x01" * 64)
    assert prepare(out, "--max-shards", "150") == 0  # across the split boundary
    assert prepare(out) == 0
    assert shard_files(out) == shard_files(prepared_wiki)
    assert verify_prepared(out) == verify_prepared(prepared_wiki)
    # a finished directory: a second run changes nothing, other settings are refused
    assert prepare(out) == 0 and shard_files(out) == shard_files(prepared_wiki)
    with pytest.raises(DataError, match=r"holds a preparation with other settings \(shard_tokens\)"):
        prepare_data.prepare(DataConfig(), out, SHARD + 1, None)


@needs_wiki
@pytest.mark.slow
def test_killed_preparation_resumes_to_identical_shards(tmp_path):
    """A real SIGKILL wherever it lands, then the same command again."""
    text = (WIKI / "valid.txt").read_text() * 8
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.txt").write_text(text)
    args = ["-m", "trainer.data.prepare", "--data.dataset", str(tmp_path / "src"), "--data.train_split", "train"]
    args += ["--data.val_split", "", "--shard-tokens", "40009"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run([sys.executable, *args, "--out", str(whole)], cwd=ROOT, env=CHILD_ENV, check=True)
    proc = subprocess.Popen([sys.executable, *args, "--out", str(killed)], cwd=ROOT, env=CHILD_ENV)
    deadline = time.monotonic() + 120
    while _recorded_shards(killed) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (killed / INDEX_NAME).exists(), "finished before the kill"
    assert 2 <= _recorded_shards(killed) < 225
    subprocess.run([sys.executable, *args, "--out", str(killed)], cwd=ROOT, env=CHILD_ENV, check=True)
    assert shard_files(killed) == shard_files(whole)


def _recorded_shards(out: Path) -> int:
    try:
        return (out / PROGRESS_NAME).read_bytes().count(b'"shard"')
    except FileNotFoundError:
        return 0


# ----------------------------------------------------------------------------- bad input


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


@needs_wiki
@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda d: (d / "valid-00002.bin").unlink(),
            r"shard '.*valid-00002\.bin' listed in token_index\.json is missing",
        ),
        (lambda d: _truncate(d / "test-00004.bin"), r"shard '.*test-00004\.bin' is 20012 bytes, its index says 10007"),
        (lambda d: _symlink(d / "valid-00001.bin", d / "valid-00000.bin"), r"shard '.*valid-00001\.bin' is a symlink"),
        (
            lambda d: _edit_index(d, tokenizer={"kind": "HFTokenizer"}),
            r"^data\.tokenizer: .*token_index\.json.*HFTokenizer",
        ),
        (lambda d: _edit_index(d, version=3), r"token_index\.json' is not a moevement-token-shards version 2 index"),
        (lambda d: _edit_index(d, version=1), r"token_index\.json' was written by an older version \(index version 1"),
        (lambda d: _edit_index(d, reseal=False, shard_tokens=10008), r"token_index\.json' does not match its seal"),
        (lambda d: _swap_shards(d, reseal=False), r"token_index\.json' does not match its seal"),
        (lambda d: _swap_shards(d), r"shard 'valid-00001\.bin' is listed at position 0 of split 'valid'"),
        (lambda d: (d / INDEX_NAME).write_text("{"), r"token_index\.json' is not readable JSON"),
        (lambda d: _rename_shard(d, "../valid-00000.bin"), r"shard name '\.\./valid-00000\.bin' .* not a plain"),
    ],
)
def test_damaged_prepared_corpus_is_one_clear_error(tmp_path, prepared_wiki, damage, message):
    d = _copy(prepared_wiki, tmp_path / "damaged")
    damage(d)
    with pytest.raises(DataError, match=message) as err:
        build_data(DataConfig(dataset=str(d)), 64, 8, 2, 0)
    assert "\n" not in str(err.value)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(20012)


def _symlink(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def _write_index(d: Path, index: dict, reseal: bool = True) -> None:
    """Write `index`, sealed again as the preparation seals it (`reseal`: an edit that knows the seal)."""
    if reseal:
        index["seal"] = seal_of(index)
    (d / INDEX_NAME).write_text(json.dumps(index))


def _edit_index(d: Path, reseal: bool = True, **changes) -> None:
    index = json.loads((d / INDEX_NAME).read_text())
    for key, value in changes.items():
        index[key] = {**index[key], **value} if isinstance(value, dict) else value
    _write_index(d, index, reseal)


def _rename_shard(d: Path, name: str) -> None:
    index = json.loads((d / INDEX_NAME).read_text())
    index["splits"]["valid"]["shards"][0]["file"] = name
    _write_index(d, index)


def _swap_shards(d: Path, reseal: bool = True) -> None:
    """The first two shard entries of the training split swapped: each still names its own file and hash."""
    index = json.loads((d / INDEX_NAME).read_text())
    shards = index["splits"]["valid"]["shards"]
    shards[0], shards[1] = shards[1], shards[0]
    _write_index(d, index, reseal)


def _rehash(d: Path) -> None:
    """Every shard's sha256 in the index made to match its bytes, and the index sealed again."""
    index = json.loads((d / INDEX_NAME).read_text())
    for entry in index["splits"].values():
        for shard in entry["shards"]:
            shard["sha256"] = file_sha256(d / shard["file"])
    _write_index(d, index)


@needs_wiki
def test_content_damage_is_found_before_its_tokens_train(tmp_path, prepared_wiki):
    """Two bytes flipped inside a shard (same size): a small split is hashed whole when it opens, and
    --verify reads every byte; each names the shard."""
    d = _copy(prepared_wiki, tmp_path / "flipped")
    with open(d / "test-00003.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    damaged = r"shard '.*test-00003\.bin' does not match its sha256 in token_index\.json"
    with pytest.raises(DataError, match=damaged):
        build_data(DataConfig(dataset=str(d)), 64, 8, 2, 0)
    with pytest.raises(DataError, match=damaged):
        verify_prepared(d)
    with pytest.raises(DataError, match=r"^data\.val_split: split 'nope' is not in .*prepared: \['test', 'valid'\]"):
        build_data(DataConfig(dataset=str(d), val_split="nope"), 64, 8, 2, 0)


@needs_wiki
def test_a_large_splits_damaged_shard_stops_before_its_tokens_train_twice(tmp_path, prepared_wiki, monkeypatch):
    """Above the size hashed at opening, a shard is hashed in the background from its first read: the reads of
    that batch go on, the next batch that reads the shard is refused, naming it; an intact shard reads on."""
    monkeypatch.setattr(token_shards, "VERIFY_AT_OPEN_BYTES", 0)
    d = _copy(prepared_wiki, tmp_path / "flipped")
    with open(d / "valid-00001.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\x41\x00")  # a valid id ('A'): only the hash can tell
    tokens = open_split(d, "valid", build_tokenizer("byte"), "data.train_split")

    def batch(*starts: int) -> torch.Tensor:
        return tokens.sequences(torch.tensor([s // 64 for s in starts]), 64)

    batch(0, 64)  # shard 0's hash starts, and its second read of the batch goes on
    batch(128)  # shard 0 is intact: the next batch's read passes its check
    shard1 = SHARD // 64 * 64 + 128
    batch(shard1, shard1 + 64)  # shard 1's first batch: its hash starts, both reads go on
    with pytest.raises(DataError, match=r"shard '.*valid-00001\.bin' does not match its sha256"):
        batch(shard1 + 128)
    worker = pickle.loads(pickle.dumps(tokens))  # a spawned loader worker: what is verified travels
    assert worker.check.verified == {0}


def test_prepare_refuses_a_foreign_directory_and_other_keys(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("not a preparation")
    assert prepare(tmp_path, "--data.dataset", str(tmp_path / "mine.txt")) == 2
    assert "is neither empty nor a preparation directory" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "not a preparation"
    with pytest.raises(SystemExit):
        prepare(tmp_path / "new", "--training.steps", "3")
    assert "only --data.KEY VALUE overrides" in capsys.readouterr().err


@needs_wiki
def test_cli_damaged_shard_is_one_line(tmp_path, prepared_wiki):
    d = _copy(prepared_wiki, tmp_path / "damaged")
    _truncate(d / "valid-00000.bin")
    proc = run_cli("--config", DEBUG_CONFIG, "--training.steps", "2", "--data.dataset", str(d), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: data.dataset: shard '{d}/valid-00000.bin' is 20012 bytes, its index says 10007 tokens = "
        "20014 bytes (truncated or replaced)"
    ]


# ----------------------------------------------------------------------------- training


@needs_wiki
@pytest.mark.slow
def test_training_from_a_prepared_corpus_ends_with_the_in_memory_digest(prepared_wiki):
    args = ("--config", DEBUG_CONFIG, "--training.steps", "3", "--training.val_every", "3")
    args += ("--metrics.tensorboard", "false")
    in_memory = final_line(run_cli(*args).stdout)
    prepared = final_line(run_cli(*args, "--data.dataset", str(prepared_wiki)).stdout)
    assert prepared == in_memory


@needs_wiki
@pytest.mark.slow
def test_two_ranks_recover_in_place_from_a_prepared_corpus(prepared_wiki, tmp_path):
    """dp=2 from memory-mapped shards with a failure of rank 1 recovered by MoEvement ends with the digest of
    the fault-free dp=2 run on the in-memory path: every rank reads batch t again after recovery."""
    args = ("--config", DEBUG_CONFIG, "--training.steps", "6", "--parallelism.dp", "2")
    args += ("--metrics.tensorboard", "false", "--checkpoint.strategy", "moevement", "--checkpoint.window", "2")
    fault_free = run_cli(*args, "--checkpoint.host_dir", str(tmp_path / "a"), nproc=2)
    recovered = run_cli(
        *args,
        "--checkpoint.host_dir",
        str(tmp_path / "b"),
        "--fault.at",
        "4:1",
        "--data.dataset",
        str(prepared_wiki),
        nproc=2,
    )
    assert recoveries(recovered.stdout)
    assert final_line(recovered.stdout) == final_line(fault_free.stdout)


@needs_wiki
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.slow
def test_token_ids_outside_the_vocabulary_are_one_line_naming_the_shard(tmp_path, prepared_wiki, workers):
    """Every token of the training split overwritten with id 65535 (same sizes, so the corpus opens): the run
    stops with one line naming a shard and the token's position, also from a loader worker process."""
    d = _copy(prepared_wiki, tmp_path / "ids")
    for shard in d.glob("valid-*.bin"):
        shard.write_bytes(b"\xff" * shard.stat().st_size)
    _rehash(d)  # an index that vouches for these bytes: the ids themselves are out of range
    args = ("--training.steps", "2", "--data.dataset", str(d), "--data.num_workers", str(workers))
    proc = run_cli("--config", DEBUG_CONFIG, *args, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert re.fullmatch(
        rf"error: data\.dataset: shard '{re.escape(str(d))}/valid-\d{{5}}\.bin' holds token id 65535 at token \d+, "
        r"outside the tokenizer's vocabulary of 257 \(damaged; .*\)",
        lines[0],
    ), lines[0]


@needs_wiki
@pytest.mark.slow
def test_a_damaged_corpus_under_torchrun_is_one_line_for_the_job(tmp_path, prepared_wiki):
    """Both ranks read out-of-vocabulary token ids, each in a shard of its own (two different lines, one per
    rank, before): the job prints one of them, once, and every worker exits."""
    d = _copy(prepared_wiki, tmp_path / "ids")
    for shard in d.glob("valid-*.bin"):
        shard.write_bytes(b"\xff" * shard.stat().st_size)
    _rehash(d)
    args = (
        "--training.steps",
        "2",
        "--parallelism.dp",
        "2",
        "--data.dataset",
        str(d),
        "--metrics.tensorboard",
        "false",
    )
    proc = run_cli("--config", DEBUG_CONFIG, *args, nproc=2, check=False)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert proc.returncode != 0 and len(errors) == 1, proc.stdout + proc.stderr
    assert errors[0].startswith("error: data.dataset: shard ") and "holds token id 65535" in errors[0], errors


@needs_wiki
def test_prepare_on_a_full_file_system_is_one_line_and_resumes(tmp_path):
    """A write that fails (the file size limit here, as a full disk would: EFBIG instead of ENOSPC) is one
    `error:` line naming the file; the same command run again without the limit finishes the preparation."""
    out = tmp_path / "prepared"
    script = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 14, 1 << 14)); "
        "from trainer.data import prepare; sys.exit(prepare.main(sys.argv[1:]))"
    )
    args = ["--out", str(out), "--shard-tokens", str(SHARD), "--data.dataset", "wikitext-2"]
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=300
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"error: prepare: cannot write {out}") and "run again to resume" in lines[0], lines
    assert prepare(out, "--data.dataset", "wikitext-2") == 0 and verify_prepared(out)
