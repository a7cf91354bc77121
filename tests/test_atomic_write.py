"""`trainer.atomic_write`: a file is published whole, never written through a symlink."""

from __future__ import annotations

import pytest

from trainer.atomic_write import write_atomically


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "record.json"
    target.write_text("old")
    write_atomically(target, "new")
    write_atomically(tmp_path / "bytes.bin", memoryview(b"\x00\x01"))
    assert target.read_text() == "new" and (tmp_path / "bytes.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bytes.bin", "record.json"]


def test_a_symlink_is_never_written_through(tmp_path):
    """A symlink at the target is replaced by the file (what it points at is untouched); one planted at the
    temporary name makes the write fail, the target and the symlink's target unchanged."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    target = tmp_path / "out.json"
    target.symlink_to(victim)
    write_atomically(target, "mine")
    assert victim.read_text() == "keep" and not target.is_symlink() and target.read_text() == "mine"
    (tmp_path / ".out.json.partial").symlink_to(victim)
    with pytest.raises(OSError):
        write_atomically(target, "again")
    assert victim.read_text() == "keep" and target.read_text() == "mine"
    assert (tmp_path / ".out.json.partial").is_symlink()  # not ours to delete
