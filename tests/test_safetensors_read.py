"""trainer/safetensors_read.py: safetensors files read tensor by tensor with plain reads, the tensors equal to
the safetensors library's, nothing of the file kept resident, and a malformed file one line naming it."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.test_hf import DEEPSEEK_CONFIG
from trainer.hf import main
from trainer.safetensors_read import SafetensorsFile, SafetensorsFileError


def test_every_dtype_reads_as_the_library_reads_it(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(7, generator=gen).bfloat16(),
        "f16": torch.randn(2, 2, 2, generator=gen).half(),
        "f64": torch.randn(4, generator=gen).double(),
        "i64": torch.arange(6).reshape(2, 3),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "u8": torch.tensor([250, 1], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(5, generator=gen).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "all.safetensors"), metadata={"format": "pt"})
    ours, theirs = SafetensorsFile(tmp_path / "all.safetensors"), load_file(tmp_path / "all.safetensors")
    assert sorted(ours.keys()) == sorted(theirs)
    for name, expected in theirs.items():
        got = ours.get_tensor(name)
        assert got.dtype == expected.dtype and ours.shape(name) == tuple(expected.shape), name
        assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name


def _rss_file() -> int:
    """This process's resident file-backed pages, bytes (mapped files it has touched)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_reading_keeps_nothing_of_the_file_resident(tmp_path):
    """128 MiB read tensor by tensor, every value used: safe_open's tensors leave the pages they touched
    resident in the process while its handle lives (the whole file here); this reader leaves none."""
    path = tmp_path / "big.safetensors"
    save_file({f"t{i}": torch.full((1 << 20,), float(i)) for i in range(32)}, str(path))

    def grown(handle) -> int:
        before = _rss_file()
        for name in handle.keys():
            assert float(handle.get_tensor(name).sum()) == float(name[1:]) * (1 << 20)
        return _rss_file() - before

    with safe_open(str(path), framework="pt") as mapped:
        assert grown(mapped) >= 100 << 20  # what the measure sees when the file stays mapped
    assert grown(SafetensorsFile(path)) <= 4 << 20


def _header_file(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "header, data, why",
    [
        ({"a": F32_2}, b"\0" * 4, "the tensors hold 8 bytes, the file's data 4"),
        ({"a": F32_2 | {"dtype": "F33"}}, b"\0" * 8, "no dtype of safetensors"),
        ({"a": F32_2 | {"shape": [3]}}, b"\0" * 8, "do not hold its shape [3]"),
        ({"a": F32_2, "b": F32_2 | {"data_offsets": [4, 12]}}, b"\0" * 12, "not where the one before ends"),
        ({"a": F32_2 | {"shape": [-2]}}, b"\0" * 8, "is not a list of sizes"),
        ([1, 2], b"", "header is not a JSON object"),
    ],
)
def test_a_malformed_file_is_refused(tmp_path, header, data, why):
    _header_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(SafetensorsFileError, match=re.escape(why)):
        SafetensorsFile(tmp_path / "bad.safetensors")


def test_a_malformed_shard_is_one_line_naming_it(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(DEEPSEEK_CONFIG))
    (src / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {src / 'model.safetensors'}: unreadable (header length {1 << 40} does not fit the file's 10 bytes)\n"
    )
