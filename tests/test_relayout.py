"""Re-laying a sparse window into another data-parallel layout (moevement/recovery/relayout.py): every new
rank gets exactly its FSDP rows of every tensor, whole tensors stay whole, and a window that is not cut
the way its layout says is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from moevement.recovery.relaid_restart import RelayTarget, find_relaid_window
from moevement.recovery.relayout import (
    DataParallel,
    NewPlace,
    Sharded,
    chunk_rows,
    old_ranks_needed,
    relaid_window,
    sharding_of,
)
from moevement.recovery.restart import host_windows, load_host
from moevement.storage.host_memory import read_header
from moevement.storage.persistence import read_window
from moevement.storage.snapshot import SnapshotError, SnapshotHeader, layout_of
from parallelisms.pipeline import lm_loss
from tests.helpers import one_rank_group
from tests.tiny_moe import batch, tiny_engine
from trainer.checkpoint.identity import RunIdentity
from trainer.config import load_config
from trainer.step import take_expert_load

DENSE = "layers.0.attention.wq.weight"
EXPERT = "layers.1.moe.experts.2.w1.weight"  # on expert-parallel rank 1 of 2 (experts 2..3 of 4)
BUFFER = "layers.1.moe.router.bias"


def _global_state(rows: int) -> dict[tuple[str, str], torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return {
        ("master", DENSE): torch.randn(rows, 3, generator=g),
        ("master", f"optim.{DENSE}.exp_avg"): torch.randn(rows, 3, generator=g),
        ("master", f"optim.{DENSE}.step"): torch.tensor(7.0),
        ("compute", EXPERT): torch.randn(rows, 2, generator=g).to(torch.bfloat16),
        ("master", BUFFER): torch.randn(4, generator=g),
    }


def _sharding(rows: int, place: NewPlace) -> dict[str, Sharded]:
    layout = place.layout
    dense = len(chunk_rows(rows, layout.group(False), layout.member(place.dp_rank, False)))
    expert = len(chunk_rows(rows, layout.group(True), layout.member(place.dp_rank, True)))
    return {DENSE: Sharded(rows, False, dense), EXPERT: Sharded(rows, True, expert)}


def _window(state: dict, layout: DataParallel, dp_rank: int, slots: int = 2) -> list[tuple[SnapshotHeader, dict]]:
    """One old rank's window: its rows of every sharded tensor, whole tensors whole."""
    out = []
    for slot in range(slots):
        items = []
        for (role, name), tensor in state.items():
            expert = name == EXPERT
            if tensor.dim() and name != BUFFER:
                rows = chunk_rows(tensor.shape[0], layout.group(expert), layout.member(dp_rank, expert))
                tensor = tensor[rows.start : rows.stop] + slot
            items.append((name.rsplit(".", 1)[0], name, role, tensor, tensor.dtype))
        entries, sources, nbytes = layout_of(items)
        meta = {"dp_rank": dp_rank, "scalars": {"lr": 0.1}}
        header = SnapshotHeader(10 + slot, 10, slot, slots, dp_rank, ["a"], ["b"], entries, nbytes, meta)
        out.append((header, {(e.role, e.name): t for e, t in zip(entries, sources, strict=True)}))
    return out


@pytest.mark.parametrize(("n", "size"), [(n, size) for n in range(10) for size in range(1, 5)])
def test_chunk_rows_are_torch_chunk_as_fsdp_cuts(n, size):
    chunks = torch.arange(n).chunk(size) if n else ()
    for member in range(size):
        expected = chunks[member].tolist() if member < len(chunks) else []
        assert list(chunk_rows(n, size, member)) == expected


@pytest.mark.parametrize(("old", "new"), [((2, 1), (1, 1)), ((2, 1), (4, 1)), ((4, 2), (2, 2)), ((2, 2), (6, 2))])
@pytest.mark.parametrize("rows", [5, 8])
def test_every_new_rank_gets_exactly_its_rows(old, new, rows):
    state, old_layout, new_layout = _global_state(rows), DataParallel(*old), DataParallel(*new)
    windows = {d: _window(state, old_layout, d) for d in range(old_layout.dp)}
    for dp_rank in range(new_layout.dp):
        place = NewPlace(new_layout, dp_rank, rank=100 + dp_rank)
        sharding = _sharding(rows, place)
        needed = old_ranks_needed(sharding, place, old_layout)
        relaid = relaid_window({d: windows[d] for d in needed}, sharding, place, old_layout, {"dp_rank": dp_rank})
        for slot, (header, tensors) in enumerate(relaid):
            assert (header.rank, header.meta["dp_rank"], header.meta["scalars"]) == (
                100 + dp_rank,
                dp_rank,
                {"lr": 0.1},
            )
            assert (header.iteration, header.active, header.frozen) == (10 + slot, ["a"], ["b"])
            for (role, name), whole in state.items():
                expert = name == EXPERT
                if whole.dim() and name != BUFFER:
                    mine = chunk_rows(rows, new_layout.group(expert), new_layout.member(dp_rank, expert))
                    whole = whole[mine.start : mine.stop] + slot
                elif name == BUFFER:
                    whole = windows[place.ep_rank][slot][1][(role, name)]
                assert torch.equal(tensors[(role, name)], whole), (name, dp_rank, slot)


def test_a_new_rank_reads_only_the_old_ranks_whose_rows_it_holds():
    place = NewPlace(DataParallel(2, 1), 1, rank=1)
    assert old_ranks_needed(_sharding(8, place), place, DataParallel(4, 1)) == [0, 2, 3]  # 0: headers, buffers


def test_a_window_cut_another_way_is_refused():
    state, old = _global_state(8), DataParallel(2, 1)
    windows = {d: _window(state, old, d) for d in range(2)}
    header, tensors = windows[1][0]
    tensors[("master", DENSE)] = tensors[("master", DENSE)][:3]
    place = NewPlace(DataParallel(1, 1), 0, rank=0)
    with pytest.raises(SnapshotError, match=r"old dp rank 1's master entry .* has 3 rows, not 4"):
        relaid_window(windows, _sharding(8, place), place, old, {})


def test_snapshots_of_different_iterations_are_not_mixed():
    state, old = _global_state(8), DataParallel(2, 1)
    windows = {d: _window(state, old, d) for d in range(2)}
    windows[1][1][0].iteration += 1
    place = NewPlace(DataParallel(1, 1), 0, rank=0)
    with pytest.raises(SnapshotError, match="does not match its peers'"):
        relaid_window(windows, _sharding(8, place), place, old, {})


def test_a_model_sharded_otherwise_is_refused():
    state, old = _global_state(8), DataParallel(2, 1)
    windows = {d: _window(state, old, d) for d in range(2)}
    place = NewPlace(DataParallel(1, 1), 0, rank=0)
    sharding = {**_sharding(8, place), DENSE: Sharded(8, False, 4)}
    with pytest.raises(SnapshotError, match="not the 8 that FSDP's chunking gives"):
        relaid_window(windows, sharding, place, old, {})


def _identity(*overrides: str) -> dict:
    cfg = load_config("train_configs/debug_moe.toml", ["--parallelism.dp", "2", *overrides])
    return RunIdentity.of_sparse(cfg).to_json()


def test_an_elastic_window_of_another_dp_belongs_to_the_run_while_a_micro_batch_keeps_its_rows():
    saved = _identity()  # debug_moe: 8 rows a batch, 2 micro-batches a rank: 2 rows a micro-batch at dp = 2
    mine = RunIdentity(saved["job"], saved["fields"])
    same_rows = _identity("--parallelism.dp", "1", "--training.micro_batches", "4")
    assert mine.mismatch(same_rows) != [] and mine.elastic_mismatch(same_rows) == []
    other_rows = _identity("--parallelism.dp", "1", "--training.micro_batches", "2")
    assert mine.elastic_mismatch(other_rows) == ["training.micro_batch_rows (saved 4, this run 2)"]
    assert [d.split(" ")[0] for d in mine.elastic_mismatch(_identity("--model.dim", "32"))] == ["model.dim"]


META = {"dp_rank": 0, "pp_rank": 0, "layout": {"dp": 1, "ep": 1}, "run": {"job": "tiny"}}


def _windows_in_host_memory(job_dir: Path, disk: Path | None = None) -> list:
    """The tiny MoE trained 10 iterations (W = 3: windows 3-5 and 6-8 complete, 9-11 begun) into
    `job_dir/rank00000` (and its persisted windows into `disk`, if given); its operators."""
    persist = {"persist_dir": str(disk)} if disk is not None else {}
    model, optimizer, engine = tiny_engine(job_dir / "rank00000", job_meta=META, **persist)
    for t in range(1, 11):
        engine.begin(t)
        lm_loss(model(batch(t)[0]), batch(t)[1]).backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.end(t, {"loss": 1.0, "clip_coef": 1.0}, *take_expert_load(model))
    engine.close()  # host state kept (the tests' options)
    return engine.ops


def _relay(job_dir: Path, ops, dense_step: int = 0, mismatch=lambda saved: [], disk: Path | None = None):
    lines: list[str] = []
    place = NewPlace(DataParallel(1, 1), 0, rank=0)
    target = RelayTarget(0, place, sharding_of(ops), META, mismatch, dense_step)
    with one_rank_group():
        return find_relaid_window(job_dir, target, lines.append, disk), lines


def test_the_newest_persisted_window_in_host_memory_is_re_laid_verified(tmp_path):
    ops = _windows_in_host_memory(tmp_path)
    found, lines = _relay(tmp_path, ops)
    assert (found.window_start, found.window_size, found.relaid, found.window_index) == (
        6,
        3,
        True,
        2,
    )  # past the manifest's
    assert lines == ["restart: re-laid window 6 (W=3) of dp=1 into dp=1 from host memory"]
    assert found.sources == ["dp=1: rank00000/local"]
    stored = load_host(host_windows(0, tmp_path / "rank00000" / "local").windows[6])
    for (header, tensors), (stored_header, stored_tensors) in zip(found.snapshots, stored, strict=True):
        assert (header.iteration, header.active, header.frozen) == (
            stored_header.iteration,
            stored_header.active,
            stored_header.frozen,
        )
        assert tensors.keys() == stored_tensors.keys()
        assert all(torch.equal(tensors[k], stored_tensors[k]) for k in tensors)


def test_a_window_that_saves_nothing_past_the_dense_checkpoint_is_not_used(tmp_path):
    found, lines = _relay(tmp_path, _windows_in_host_memory(tmp_path), dense_step=8)
    assert found is None
    assert lines == [
        "restart: no window in host memory re-lays into dp=1 past step 8; resuming from the dense checkpoint"
    ]


def test_a_corrupted_or_foreign_window_is_refused_and_the_dense_checkpoint_kept(tmp_path, capsys):
    ops = _windows_in_host_memory(tmp_path)
    found, lines = _relay(tmp_path, ops, mismatch=lambda saved: ["model.dim (saved 32, this run 64)"])
    assert found is None and "belongs to another run: model.dim (saved 32, this run 64)" in capsys.readouterr().out
    (slot_1,) = [p for p in (tmp_path / "rank00000" / "local").glob("w*-s1.bin") if _window_of(p) == 6]
    data = bytearray(slot_1.read_bytes())
    data[100] ^= 1
    slot_1.write_bytes(bytes(data))
    found, lines = _relay(tmp_path, ops)
    assert found is None and "checksum mismatch" in capsys.readouterr().out
    assert lines[0] == "restart: window 6 of dp=1 cannot be re-laid on every rank; trying an older one"
    assert lines[-1].startswith("restart: no window in host memory re-lays into dp=1")


def _window_of(buffer: Path) -> int:
    return read_header(buffer.with_suffix(""))["window_start"]


def test_a_job_whose_host_memory_is_gone_re_lays_its_newest_window_from_persist_dir(tmp_path, capsys):
    """Every node lost: the newest persisted window is read from persist_dir, verified and re-laid; one with a
    corrupted byte is refused and the window before it is used. With host memory intact, host memory is
    read first."""
    job, disk = tmp_path / "job", tmp_path / "disk"
    ops = _windows_in_host_memory(job, disk)
    found, lines = _relay(job, ops, disk=disk)
    assert (found.window_start, found.sources, lines) == (
        6,
        ["dp=1: rank00000/local"],
        ["restart: re-laid window 6 (W=3) of dp=1 into dp=1 from host memory"],
    )
    shutil.rmtree(job / "rank00000")
    found, lines = _relay(job, ops, disk=disk)
    assert (found.window_start, found.window_size, found.relaid) == (6, 3, True)
    assert found.sources == ["dp=1: persist_dir window-00000006/rank00000"]
    assert lines == ["restart: re-laid window 6 (W=3) of dp=1 into dp=1 from persist_dir"]
    stored = read_window(disk / "window-00000006" / "rank00000")
    for (header, tensors), (stored_header, stored_tensors) in zip(found.snapshots, stored, strict=True):
        assert header.iteration == stored_header.iteration and tensors.keys() == stored_tensors.keys()
        assert all(torch.equal(tensors[k], stored_tensors[k]) for k in tensors)
    slot_1 = disk / "window-00000006" / "rank00000" / "s1.bin"
    data = bytearray(slot_1.read_bytes())
    data[100] ^= 1
    slot_1.write_bytes(bytes(data))
    found, lines = _relay(job, ops, disk=disk)
    assert "checksum mismatch" in capsys.readouterr().out
    assert found.window_start == 3 and lines == [
        "restart: window 6 of dp=1 cannot be re-laid on every rank; trying an older one",
        "restart: re-laid window 3 (W=3) of dp=1 into dp=1 from persist_dir",
    ]
