"""A buffer's commit record is rewritten in place where it repeats the one before, and stays exactly the
sealed record a fresh file would hold; a spare that changed or is not this process's is never trusted."""

from __future__ import annotations

import errno
import os

import pytest

from moevement.storage.commit_file import CommitFile
from moevement.storage.host_memory import read_header
from moevement.storage.private_files import HostMemoryError, make_private_dir
from moevement.storage.sealed import seal

ENTRIES_KEY = b'{"entries": '
BODY = b"[" + b", ".join(b'{"name": "t%d", "offset": %d}' % (i, 64 * i) for i in range(5000)) + b"]"


def record(iteration: int) -> tuple[bytes, ...]:
    """A commit record in parts, as a layout's snapshots give them: the same first two objects every time."""
    return (ENTRIES_KEY, BODY, b', "iteration": %d, "meta": {"loss": %d.5}}' % (iteration, iteration))


def parsed(iteration: int) -> dict:
    return {
        "entries": [{"name": f"t{i}", "offset": 64 * i} for i in range(5000)],
        "iteration": iteration,
        "meta": {"loss": iteration + 0.5},
    }


@pytest.fixture
def commit_file(tmp_path) -> CommitFile:
    directory = make_private_dir(tmp_path / "local")
    return CommitFile(directory / "w0-s0.json", directory / "w0-s0.spare")


def written_bytes(monkeypatch) -> list[int]:
    """Bytes each `pwritev`/`pwrite` call of the process writes from now on."""
    sizes, real_pwritev, real_pwrite = [], os.pwritev, os.pwrite

    def pwritev(fd, views, offset):
        sizes.append(sum(len(v) for v in views))
        return real_pwritev(fd, views, offset)

    def pwrite(fd, data, offset):
        sizes.append(len(data))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "pwrite", pwrite)
    return sizes


def test_a_record_that_repeats_the_last_ones_entries_is_rewritten_in_place(commit_file, monkeypatch):
    commit_file.write(record(1))
    first = os.stat(commit_file.path)
    for iteration in (2, 3):
        commit_file.retire()
        assert not commit_file.path.exists()  # a retired record is not committed
        sizes = written_bytes(monkeypatch)
        commit_file.write(record(iteration))
        monkeypatch.undo()
        assert commit_file.path.read_bytes() == seal(b"".join(record(iteration)))
        assert read_header(commit_file.path.with_suffix("")) == parsed(iteration)
        assert os.stat(commit_file.path).st_ino == first.st_ino  # the same file, its pages kept
        assert 0 < sum(sizes) < 100  # the digest and the tail, not the entries
        assert not commit_file.spare.exists()


def test_a_record_with_other_entries_is_written_whole_and_exact(commit_file):
    commit_file.write(record(1))
    commit_file.retire()
    other = (ENTRIES_KEY, BODY.replace(b'"t7"', b'"u7"'), b', "iteration": 2}')
    commit_file.write(other)
    assert commit_file.path.read_bytes() == seal(b"".join(other))
    commit_file.retire()
    commit_file.write((b'{"iteration": 3}',))  # shorter than the spare it reuses: truncated
    assert read_header(commit_file.path.with_suffix("")) == {"iteration": 3}


def test_a_spare_changed_while_retired_is_refused_by_readers_never_read_as_valid(commit_file):
    """Guarantee: No code runs from saved state (every header hashed): a commit record changed on disk is
    refused by its hash, naming the file (a restart that then falls back: tests/test_host_state_safety.py::
    test_restart_falls_back_window_by_window)."""
    commit_file.write(record(1))
    commit_file.retire()
    raw = bytearray(commit_file.spare.read_bytes())
    at = raw.index(b'"t4321"') + 2
    raw[at] ^= 1  # an entry's name, inside the bytes the next commit leaves as they are
    with open(commit_file.spare, "r+b") as f:
        f.write(raw)
    commit_file.write(record(2))
    with pytest.raises(HostMemoryError, match=r"w0-s0\.json: .*hash"):
        read_header(commit_file.path.with_suffix(""))


def test_a_spare_replaced_by_another_file_is_written_whole(commit_file):
    commit_file.write(record(1))
    commit_file.retire()
    commit_file.spare.unlink()
    fd = os.open(commit_file.spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"x" * len(seal(b"".join(record(1)))))  # same size, another inode
    os.close(fd)
    commit_file.write(record(2))
    assert commit_file.path.read_bytes() == seal(b"".join(record(2)))


def test_a_spare_that_is_not_ours_is_left_alone_and_the_record_still_lands(commit_file, tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"not yours")
    commit_file.spare.symlink_to(outside)
    commit_file.write(record(1))
    assert read_header(commit_file.path.with_suffix("")) == parsed(1)
    assert commit_file.spare.is_symlink() and outside.read_bytes() == b"not yours"
    commit_file.drop()
    assert not commit_file.path.exists() and commit_file.spare.is_symlink()  # never deleted what it did not write


def test_drop_removes_the_record_and_the_spare_this_process_wrote(commit_file):
    commit_file.write(record(1))
    commit_file.retire()
    commit_file.write(record(2))
    commit_file.drop()
    assert not commit_file.path.exists() and not commit_file.spare.exists()
    commit_file.write(record(3))
    assert read_header(commit_file.path.with_suffix("")) == parsed(3)


def test_a_failed_write_is_one_error_and_the_next_record_is_written_whole(commit_file, monkeypatch):
    commit_file.write(record(1))
    commit_file.retire()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(HostMemoryError, match=r"w0-s0\.json"):
        commit_file.write(record(2))
    monkeypatch.undo()
    assert not commit_file.path.exists()
    commit_file.write(record(3))
    assert commit_file.path.read_bytes() == seal(b"".join(record(3)))


def test_the_commit_benchmark_compares_both_writers(tmp_path, capsys):
    from benchmarks import commit_record

    commit_record.main(["--entries", "60", "--commits", "3", "--rounds", "2", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.count("round=") == 2 and "summary in_place/fresh=" in out
    assert list(tmp_path.iterdir()) == []  # its files are gone


@pytest.mark.parametrize("staged", [False, True], ids=["cpu_copy", "gpu_path_on_cpu"])
def test_a_trainers_snapshots_rewrite_their_records_in_place(tmp_path, monkeypatch, staged):
    """At W=1 every snapshot of a buffer has its layout's entries: after each buffer's first, a commit keeps
    the record's file, writes a small part of it, and reads back as the snapshot taken (the CPU's copy
    thread, and a GPU's issue path)."""
    from moevement.storage.snapshot import SnapshotHeader
    from tests.test_moevement_engine import train

    files: dict[str, set[int]] = {}
    sizes, written = written_bytes(monkeypatch), []  # bytes written per iteration with a snapshot

    def on_snapshot(header, _before, engine):
        path = engine.in_flight.latest_buffer.header_path
        files.setdefault(path.name, set()).add(os.stat(path).st_ino)
        written.append((sum(sizes), os.stat(path).st_size))
        sizes.clear()
        assert SnapshotHeader.from_json(read_header(path.with_suffix(""))).iteration == header.iteration

    train(tmp_path / "rank0", 9, on_snapshot=on_snapshot, window=1, staged=staged)
    assert sorted(files) == ["w0-s0.json", "w1-s0.json"]
    assert all(len(inodes) == 1 for inodes in files.values()), files
    assert len(written) >= 5 and all(n >= size for n, size in written[:2])  # each buffer's first: whole
    assert all(n < size // 4 for n, size in written[2:]), written  # then the digest, the tail, the manifest
