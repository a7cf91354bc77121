"""The Hugging Face export as transformers and the Hub expect it (trainer/hf_export.py): safetensors shards and
their index, which ``from_pretrained`` loads to the project's logits and an upload takes; the pinned
transformers' config keys, loaded without a warning; the source tokenizer's special tokens; the user's
permissions. The import of a sharded folder."""

from __future__ import annotations

import json
import logging
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch
from huggingface_hub import CommitOperationAdd, constants
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2MoeForCausalLM

from eval.checkpoint import load_checkpoint
from tests.test_hf import _deepseek_checkpoint, _modules_cache, _no_network, _qwen  # noqa: F401 (a fixture)
from trainer.hf import main
from trainer.hf_tokenizer import byte_level_tokenizer

INDEX = "model.safetensors.index.json"
SMALL_SHARDS = ("--max-shard-size", "40KB")  # the tiny models below: 5 to 7 shards


def _export(ckpt: Path, out: Path, *extra: str) -> None:
    assert main(["export", str(ckpt), str(out), *extra]) == 0


def _family(tmp_path: Path, family: str):
    """(checkpoint, the logits the export must give, from_pretrained's arguments) of a tiny model of `family`."""
    if family == "deepseek":
        _deepseek_checkpoint(tmp_path / "ckpt")
        return tmp_path / "ckpt", load_checkpoint(tmp_path / "ckpt").model, {"trust_remote_code": True}
    ref, src = _qwen(tmp_path)
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 0
    return tmp_path / "ckpt", lambda tokens: ref(tokens).logits, {}


def _hub_checks(out: Path) -> int:
    """What an upload (``HfApi.upload_folder``) checks before it sends anything, offline: every file an upload
    operation (a path the repository takes, a regular file, its size and sha256), none over the Hub's 50 GB;
    and what ``from_pretrained`` relies on: the index names every tensor of every shard, each once, with their
    total size. The number of shards."""
    for path in sorted(out.iterdir()):
        operation = CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path))
        assert operation.upload_info.size == path.stat().st_size <= constants.MAX_HTTP_DOWNLOAD_SIZE
    index = json.loads((out / INDEX).read_text())
    held, total = {}, 0
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(out / file, framework="pt") as shard:
            assert shard.metadata() == {"format": "pt"}  # transformers refuses a shard without it
            for name in shard.keys():
                assert name not in held
                held[name], total = file, total + shard.get_tensor(name).nbytes
    assert held == index["weight_map"] and index["metadata"]["total_size"] == total
    return len(set(held.values()))


@pytest.mark.parametrize("family", ["deepseek", "qwen"])
def test_a_sharded_export_loads_to_the_project_s_logits_and_passes_the_hub_s_checks(tmp_path, monkeypatch, family):
    ckpt, expected, load = _family(tmp_path, family)
    _export(ckpt, tmp_path / "out", *SMALL_SHARDS)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert _hub_checks(tmp_path / "out") >= 3
    _no_network(monkeypatch)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", **load).eval()
    tokens = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        diff = (hf(tokens).logits - expected(tokens)).abs().max().item()
    assert diff <= 1e-5, diff


class _Records(logging.Handler):
    """The records of transformers' own loggers (they do not propagate to the root logger)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("family", ["deepseek", "qwen"])
def test_an_export_loads_without_a_warning_or_a_question(tmp_path, monkeypatch, family):
    """Config, weights, tokenizer and generation config: no warning (deprecated keys, the remote code's own),
    no interactive question; the deepseek family's code is trusted as its model's is."""
    ckpt, _, load = _family(tmp_path, family)
    _export(ckpt, tmp_path / "out", *SMALL_SHARDS)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail(f"asked: {a}"))
    records = _Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            AutoModelForCausalLM.from_pretrained(tmp_path / "out", **load)
            tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out", **load)
            generation = GenerationConfig.from_pretrained(tmp_path / "out")
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert [str(w.message) for w in caught] == [] and records.lines == []
    assert tokenizer.eos_token == "</s>" and generation.eos_token_id == tokenizer.eos_token_id == 256
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not {"torch_dtype", "rope_scaling", "rope_theta"} & set(config)
    assert config["dtype"] == "float32" and config["transformers_version"] == "5.23.0"


def test_the_source_tokenizer_s_special_tokens_are_declared(tmp_path):
    """A Hugging Face folder's tokenizer (imported with its weights): its bos/eos/pad, as its
    tokenizer_config.json declares them, in the export's tokenizer, config and generation config."""
    _, src = _qwen(tmp_path)
    tok = byte_level_tokenizer()
    tok.add_special_tokens(["<s>", "<pad>"])  # </s> 256, <s> 257, <pad> 258
    tok.save(str(src / "tokenizer.json"))
    source_config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "pad_token": "<pad>"}
    (src / "tokenizer_config.json").write_text(json.dumps(source_config))
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 0
    _export(tmp_path / "ckpt", tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    ids = {"bos_token_id": 257, "eos_token_id": 256, "pad_token_id": 258}
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == tuple(ids.values())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids
    assert GenerationConfig.from_pretrained(tmp_path / "out").to_diff_dict() | ids == GenerationConfig(
        **ids
    ).to_diff_dict() | {"transformers_version": "5.23.0"}


def test_a_source_tokenizer_config_naming_an_unknown_token_is_one_line(tmp_path, capsys):
    _, src = _qwen(tmp_path)
    byte_level_tokenizer().save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    unknown = f"pad_token '<pad>' is not a token of {src / 'tokenizer.json'}"
    assert capsys.readouterr().err == f"error: {src / 'tokenizer_config.json'}: {unknown}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "qwen"]  # nothing half-written


@pytest.mark.parametrize("umask, directory, file", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_an_export_has_the_user_s_permissions(tmp_path, umask, directory, file):
    """As save_pretrained leaves a model: what the umask gives, not the owner-only of host state."""
    _deepseek_checkpoint(tmp_path / "ckpt")
    before = os.umask(umask)
    try:
        _export(tmp_path / "ckpt", tmp_path / "out", *SMALL_SHARDS)
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == directory
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert modes == dict.fromkeys(modes, file) and len(modes) > 8


@pytest.mark.parametrize(
    "size, named",
    [("5 gigs", "is not a size"), ("0", "at least 1 byte"), ("60GB", "at most the Hub's 50GB per file")],
)
def test_a_bad_shard_size_is_one_line(tmp_path, capsys, size, named):
    _deepseek_checkpoint(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max-shard-size", size]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --max-shard-size: {size!r}") and named in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_sharded_folder_imports_shard_by_shard_and_gives_back_its_tensors(tmp_path):
    ckpt, _, _ = _family(tmp_path, "qwen")
    _export(ckpt, tmp_path / "out", *SMALL_SHARDS)
    assert main(["import", str(tmp_path / "out"), str(tmp_path / "again")]) == 0
    original, again = load_checkpoint(ckpt).model.state_dict(), load_checkpoint(tmp_path / "again").model.state_dict()
    assert sorted(original) == sorted(again) and all(torch.equal(original[k], again[k]) for k in original)


@pytest.mark.parametrize("link", [INDEX, "model-00002-of-00007.safetensors"])
def test_a_symlinked_shard_or_index_is_refused_unfollowed(tmp_path, capsys, link):
    _deepseek_checkpoint(tmp_path / "ckpt")
    _export(tmp_path / "ckpt", tmp_path / "out", *SMALL_SHARDS)
    (tmp_path / "out" / link).rename(tmp_path / link)
    (tmp_path / "out" / link).symlink_to(tmp_path / link)
    capsys.readouterr()
    assert main(["import", str(tmp_path / "out"), str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'out' / link}: is a symlink; refused, never followed")
    assert err.count("\n") == 1 and not (tmp_path / "again").exists()


def test_an_imported_then_exported_sharded_model_keeps_every_tensor(tmp_path):
    """The released layout survives both directions: Qwen's own sharded save_pretrained, imported, exported
    in shards, equals the original tensor for tensor."""
    ref, src = _qwen(tmp_path)
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / INDEX).is_file()
    assert main(["import", str(sharded), str(tmp_path / "ckpt")]) == 0
    _export(tmp_path / "ckpt", tmp_path / "out", *SMALL_SHARDS)
    original = load_file(src / "model.safetensors")
    exported = {}
    for file in set(json.loads((tmp_path / "out" / INDEX).read_text())["weight_map"].values()):
        exported |= load_file(tmp_path / "out" / file)
    assert sorted(original) == sorted(exported) and all(torch.equal(original[k], exported[k]) for k in original)
    assert isinstance(Qwen2MoeForCausalLM.from_pretrained(tmp_path / "out"), Qwen2MoeForCausalLM)
