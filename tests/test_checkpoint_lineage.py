"""Where a run starts and what its periodic saves may touch, decided in this process over real files: which
checkpoint of `checkpoint.folder` a start resumes from (trainer/checkpoint/resume.py), that pruning and
replacing keep to the saving run's lineage (trainer/checkpoint/step_folder.py), and that a damaged newest
checkpoint falls back to the newest intact one. The processes' side is tests/test_periodic_checkpoints.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch

from models import build_model
from tests.helpers import DEBUG_CONFIG, ROOT
from trainer.checkpoint.dense import FORMAT, save_dense
from trainer.checkpoint.events import (
    CheckpointFallback,
    CheckpointLoaded,
    CheckpointNotPruned,
    CheckpointPruned,
    FreshStart,
)
from trainer.checkpoint.identity import RunIdentity
from trainer.checkpoint.lineage import new_lineage
from trainer.checkpoint.publish import PARTIAL, CheckpointError
from trainer.checkpoint.resume import choose, load_start
from trainer.checkpoint.state import training_state_digest
from trainer.checkpoint.step_folder import make_folder, prune, refusal, tidy
from trainer.config import ConfigError, load_config
from trainer.optim import build_optimizer
from trainer.records.event_log import KINDS
from trainer.sealed_json import sealed

A, B = "a" * 16, "b" * 16  # two lineages


def config(folder: Path, *extra: str):
    return load_config(str(ROOT / DEBUG_CONFIG), ["--checkpoint.folder", str(folder), *extra])


def fake(folder: Path, step: int, cfg, lineage: str | None) -> Path:
    """A checkpoint directory `step-<step>` whose sealed meta.json names the run `cfg` and `lineage`, and a
    model file it lists (enough for every decision here; loading it is another matter)."""
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    (path / "model-00000.safetensors").write_bytes(b"x" * 8)
    meta = {
        "format": FORMAT,
        "step": step,
        "loss": 1.0,
        "model": dataclasses.asdict(cfg.model),
        "run": RunIdentity.of_dense(cfg).to_json(),
        "files": {"model-00000.safetensors": hashlib.sha256(b"x" * 8).hexdigest()},
        **({"lineage": lineage} if lineage else {}),
    }
    (path / "meta.json").write_text(json.dumps(sealed(meta)))
    return path


def test_a_start_resumes_from_the_newest_checkpoint_of_its_config(tmp_path):
    cfg = config(tmp_path)
    for step in (2, 4):
        fake(tmp_path, step, cfg, A)
    fake(tmp_path, 6, config(tmp_path, "--training.lr", "0.01"), B)  # another config's, newer: not a candidate
    choice = choose(cfg, in_place=False)
    assert [(t.step, t.damaged) for t in choice.tries] == [(4, None), (2, None)] and choice.fallback
    assert choice.refused is None and choice.events == []
    (tmp_path / "step-4" / "meta.json").write_text("{")  # a damaged meta.json stays a try, passed over when loading
    assert [(t.step, bool(t.damaged)) for t in choose(cfg, in_place=False).tries] == [(4, True), (2, False)]


def test_a_folder_of_another_config_only_is_refused_naming_the_keys(tmp_path):
    fake(tmp_path, 2, config(tmp_path), A)
    other = config(tmp_path, "--training.lr", "0.01")
    refused = choose(other, in_place=False).refused
    assert "another configuration only" in refused and "training.lr (saved 0.003, this run 0.01)" in refused
    assert "--checkpoint.load_step 0" in refused
    assert choose(config(tmp_path, "--training.lr", "0.01", "--checkpoint.load_other_config"), False).refused is None


def test_an_empty_folder_starts_fresh_saying_so_and_load_step_0_starts_over(tmp_path):
    cfg = config(tmp_path, "--checkpoint.dense_interval", "2")
    assert choose(cfg, in_place=False).events == [FreshStart(str(tmp_path))]  # an empty folder: no error
    fake(tmp_path, 2, cfg, A)
    fake(tmp_path, 4, cfg, A)
    over = choose(config(tmp_path, "--checkpoint.load_step", "0"), in_place=False)
    assert over.tries == [] and over.events == [FreshStart(str(tmp_path), (2, 4))]
    assert "starting over (checkpoint.load_step 0)" in over.events[0].line()
    assert [t.step for t in choose(config(tmp_path, "--checkpoint.load_step", "2"), False).tries] == [2]
    with pytest.raises(CheckpointError, match="no checkpoint of step 3"):
        choose(config(tmp_path, "--checkpoint.load_step", "3"), in_place=False)
    # an in-place generation rejoins with its survivors' state: no folder, no line
    assert choose(cfg, in_place=True).tries == [] and choose(cfg, in_place=True).events == []
    # the newest checkpoint of this run past training.steps: refused, not trained backwards over
    assert (
        "training.steps' (3) is below the step (4)" in choose(config(tmp_path, "--training.steps", "3"), False).refused
    )


def test_pruning_deletes_only_the_saving_lineage_up_to_the_step_it_saved(tmp_path):
    cfg = config(tmp_path)
    for step, lineage in [(1, B), (2, A), (3, None), (4, A), (5, B), (6, A), (8, A)]:
        fake(tmp_path, step, cfg, lineage)
    (tmp_path / "step-2" / "notes.txt").write_text("mine")
    struck = []
    events = prune(tmp_path, keep=1, lineage=A, upto=6, strike=lambda: struck.append(1))
    assert [type(e) for e in events] == [CheckpointNotPruned, CheckpointPruned] and "notes.txt" in events[0].why
    assert events[1] == CheckpointPruned(4, str(tmp_path / "step-4"), 1) and struck == [1]
    left = sorted(os.listdir(tmp_path))
    assert left == ["step-1", "step-2", "step-3", "step-5", "step-6", "step-8"], left  # 8: past the step saved
    assert prune(tmp_path, keep=0, lineage=A, upto=8, strike=lambda: None) == []


def test_a_save_replaces_only_a_step_of_its_own_lineage(tmp_path):
    cfg = config(tmp_path)
    ours, theirs, older = fake(tmp_path, 2, cfg, A), fake(tmp_path, 4, cfg, B), fake(tmp_path, 6, cfg, None)
    assert refusal(ours, A) is None and refusal(tmp_path / "step-8", A) is None
    assert f"lineage {B}" in refusal(theirs, A) and "written with no lineage" in refusal(older, A)
    (tmp_path / "step-10").mkdir()
    assert refusal(tmp_path / "step-10", A) is None  # empty
    (tmp_path / "step-10" / "x").write_text("")
    assert "not a checkpoint of this run" in refusal(tmp_path / "step-10", A)


def test_tidy_finishes_what_a_death_left_of_this_lineage_only(tmp_path):
    cfg = config(tmp_path)
    mine, theirs = fake(tmp_path, 2, cfg, A), fake(tmp_path, 4, cfg, B)
    (mine / "model-00000.safetensors").unlink()  # a prune killed after its first file
    os.rename(mine, tmp_path / ".step-2.pruned-abc_1")
    os.rename(theirs, tmp_path / ".step-4.old-xyz")
    (tmp_path / ".step-6.pruned-done").mkdir()  # meta.json went last: only the directory was left
    dead = tmp_path / ".step-8.tmp-dead"
    dead.mkdir()
    (dead / PARTIAL).write_text(json.dumps({"pid": 2**22 + 1, "host": socket.gethostname()}))
    (dead / "model-00000.safetensors").write_bytes(b"partial")
    make_folder(tmp_path, A)
    assert sorted(os.listdir(tmp_path)) == [".step-4.old-xyz"]
    tidy(tmp_path, B)
    assert os.listdir(tmp_path) == []


def test_checkpoint_events_read_back_into_their_lines():
    loaded = CheckpointLoaded(4, "/x/step-4", 5.1234567)
    assert KINDS[loaded.KIND].from_record(json.loads(json.dumps(loaded.record()))).line() == loaded.line()
    fresh = FreshStart("/x", (2, 4))
    assert KINDS[fresh.KIND].from_record(json.loads(json.dumps(fresh.record()))) == fresh


def _tiny(folder: Path):
    cfg = config(folder, "--model.n_layers", "2", "--checkpoint.dense_interval", "2")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    return cfg, model, build_optimizer(model, cfg.training)


def _train(model, optimizer) -> None:
    model(torch.randint(0, 256, (2, 16))).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path):
    """Steps 2 and 4 saved (lineage A); one byte of step 4's optimizer file flipped: the start passes it over
    with a line naming it and loads step 2, whose state and lineage it continues. With every checkpoint
    damaged it is one error naming each, not the initial state."""
    cfg, model, optimizer = _tiny(tmp_path)
    digests = {}
    for step in (1, 2, 3, 4):
        _train(model, optimizer)
        if step % 2 == 0:
            save_dense(str(tmp_path / f"step-{step}"), model, optimizer, step, 1.0, cfg)
            digests[step] = training_state_digest(model, optimizer)
    for step in (2, 4):  # save_final writes no lineage; a periodic save would
        meta = json.loads((tmp_path / f"step-{step}" / "meta.json").read_text())
        (tmp_path / f"step-{step}" / "meta.json").write_text(json.dumps(sealed({**meta, "lineage": A})))
    damaged = tmp_path / "step-4" / "optim-00000.safetensors"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    _, fresh_model, fresh_optimizer = _tiny(tmp_path)
    start = load_start(cfg, fresh_model, fresh_optimizer, in_place=False)
    assert [type(e) for e in start.events] == [CheckpointFallback, CheckpointLoaded]
    assert start.events[0].step == 4 and "checksum mismatch" in start.events[0].why
    assert (start.step, start.source.step, start.source.lineage) == (2, 2, A)
    assert start.resolved.checkpoint.load_step == 2
    assert training_state_digest(fresh_model, fresh_optimizer) == digests[2]
    (tmp_path / "step-2" / "model-00000.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no checkpoint of this run in .* loads \(step 4: .*; step 2: "):
        load_start(cfg, *_tiny(tmp_path)[1:], in_place=False)
    with pytest.raises(ConfigError, match="another configuration only"):
        load_start(config(tmp_path, "--model.n_layers", "2", "--training.lr", "0.1"), *_tiny(tmp_path)[1:], False)


def test_a_fresh_start_begins_a_new_lineage():
    assert len({new_lineage() for _ in range(3)}) == 3 and len(new_lineage()) == 16
