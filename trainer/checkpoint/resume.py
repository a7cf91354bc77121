"""Where a run starts: the dense checkpoint it resumes from, chosen, checked and loaded (every rank).

TorchTitan's rule, `checkpoint.load_step` -1 (the default): a start resumes from the newest checkpoint of
this run's configuration in `checkpoint.folder` (`RunIdentity.of_dense`, the job name aside); one that does
not load (damaged: a flipped byte, a missing file) is passed over with one line for the next older. A folder
that holds checkpoints of other configurations only is refused in one line naming the keys that differ
(with `checkpoint.load_other_config` they are left aside). With none of this run there, `checkpoint.load`
(TorchTitan's `initial_load_path`) or the initial state, saying so. `load_step 0` starts over: `checkpoint.load`
or the initial state, the folder left as it is; `load_step N` loads `step-N` exactly. An in-place generation
of a job that is not elastic rejoins with its survivors' state (the strategy restores it) and looks at no
folder. An elastic job starts every torchrun round by this rule.

Rank 0 reads the folder and tells the others what to try, in order; every rank loads each try (the files'
checks spread over the ranks, `dense_read.load_dense`) and the ranks agree on its outcome, so they load and
fall back alike. What was decided is a `Start`: the step, the source (for the run record), the lines to say
once the run record is open, and the config as resolved (`load_step N` or `load DIR`, never -1), which
reruns the same start.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.checkpoint.dense_read import is_imported, load_dense, open_meta
from trainer.checkpoint.events import CheckpointFallback, CheckpointLoaded, CheckpointOtherConfig, FreshStart
from trainer.checkpoint.identity import IdentityError, RunIdentity
from trainer.checkpoint.publish import LINEAGE, CheckpointError
from trainer.checkpoint.rank0 import all_records, from_rank0, is_rank0
from trainer.checkpoint.step_folder import checkpoint_folder, published_steps, step_dir
from trainer.config import Config, ConfigError

START_OVER = "start over with --checkpoint.load_step 0"


@dataclass(frozen=True)
class Source:
    """The checkpoint a run loaded: its directory, step, loss, the seal of its meta.json (a SHA-256 over the
    file's canonical JSON, which lists every file's SHA-256) and the lineage the run continues (None: the
    run begins a new one)."""

    directory: str
    step: int
    loss: float
    meta_seal: str
    lineage: str | None

    def record(self) -> dict:
        """The run record's `resumed_from` (`trainer/records/run_record.py`)."""
        return {"checkpoint": self.directory, "step": self.step, "meta_seal": self.meta_seal}


@dataclass
class Start:
    """Where this rank's run starts: the last iteration done and its loss, what it loaded (None: the
    initial state), the lines to say once the run record is open, and the config as resolved."""

    step: int
    loss: float
    source: Source | None
    events: list
    resolved: Config


@dataclass(frozen=True)
class Try:
    """A checkpoint to load: its directory and step in the folder (None: `checkpoint.load`), or why it is
    passed over unread (a meta.json that does not pass its checks)."""

    directory: str
    step: int | None = None
    damaged: str | None = None


@dataclass
class Choice:
    """Rank 0's decision: what to try, in order; whether a failed try falls back to the next (the folder's
    newest-first list) or is the run's error; lines to say; the refusal, if any (a ConfigError)."""

    tries: list[Try] = field(default_factory=list)
    fallback: bool = False
    events: list = field(default_factory=list)
    refused: str | None = None


def survey(folder: Path, identity: RunIdentity) -> tuple[list[Try], list[tuple[int, list[str]]]]:
    """The published checkpoints of `folder`, newest first: (those of the run `identity`, and those whose
    meta.json does not pass, as tries; (step, the differing keys) of those of other configurations)."""
    ours, others = [], []
    for step in reversed(published_steps(folder)):
        directory = step_dir(folder, step)
        try:
            meta = open_meta(str(directory))
        except CheckpointError as e:
            ours.append(Try(str(directory), step, damaged=str(e)))
            continue
        differ = identity.mismatch(meta.get("run"), check_job=False)
        if differ:
            others.append((step, differ))
        else:
            ours.append(Try(str(directory), step))
    return ours, others


def choose(cfg: Config, in_place: bool) -> Choice:
    """What this start loads, by the rule of the module's docstring. Rank 0 (reads the folder)."""
    c, folder = cfg.checkpoint, checkpoint_folder(cfg)
    load = [Try(c.load)] if c.load else []
    if c.load_step > 0:
        steps = published_steps(folder)
        if c.load_step not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise CheckpointError(
                f"checkpoint.load_step: no checkpoint of step {c.load_step} in {folder} (steps: {have})"
            )
        return Choice([Try(str(step_dir(folder, c.load_step)), c.load_step)])
    if c.load_step == 0 or (in_place and not cfg.parallelism.elastic):
        if load or in_place:
            return Choice(load)
        held = tuple(published_steps(folder))
        return Choice(events=[FreshStart(str(folder), held)] if held or c.dense_interval else [])
    ours, others = survey(folder, RunIdentity.of_dense(cfg))
    if ours:
        return Choice(ours, fallback=True, refused=_past_the_end(cfg, ours, folder))
    if others and not c.load_other_config:
        step, differ = others[0]
        return Choice(
            refused=f"checkpoint.folder: {folder} holds checkpoints of another configuration only (the newest, "
            f"step {step}: {'; '.join(differ)}); not resumed, never overwritten: choose another "
            f"checkpoint.folder or job.name, or {START_OVER}"
        )
    fresh = not load and (c.dense_interval or others)
    return Choice(load, events=[FreshStart(str(folder))] if fresh else [])


def _past_the_end(cfg, ours: list[Try], folder: Path) -> str | None:
    """The refusal of a start whose newest checkpoint is past `training.steps`, else None."""
    newest = next((t.step for t in ours if t.damaged is None), None)
    if newest is None or newest <= cfg.training.steps:
        return None
    return (
        f"config key 'training.steps' ({cfg.training.steps}) is below the step ({newest}) of the newest checkpoint of "
        f"this run in {folder}: raise it to train on from there, or {START_OVER}"
    )


def load_start(cfg, model: torch.nn.Module, optimizer: torch.optim.Optimizer, in_place: bool) -> Start:
    """Choose (rank 0) and load (every rank) where this run starts; collective. ConfigError for a refused
    folder, CheckpointError when no try loads (naming each), IdentityError or CheckpointError for a
    `checkpoint.load` or `load_step N` that does not (as before: nothing falls back from what was named)."""
    error, choice = None, None
    if is_rank0():
        try:
            choice = choose(cfg, in_place)
        except CheckpointError as e:
            error = str(e)
    choice, error = from_rank0((choice, error))
    if error is not None:
        raise CheckpointError(error)
    if choice.refused is not None:
        raise ConfigError(choice.refused)
    events, failed = list(choice.events), []
    for attempt in choice.tries:
        outcome = attempt.damaged or _load(cfg, model, optimizer, attempt, choice.fallback)
        if isinstance(outcome, str):  # passed over: the next older is tried
            events.append(CheckpointFallback(attempt.step, attempt.directory, outcome))
            failed.append(f"step {attempt.step}: {outcome}")
            continue
        meta, differ = outcome
        return _started(cfg, attempt, meta, differ, events)
    if failed:
        folder = checkpoint_folder(cfg)
        raise CheckpointError(
            f"checkpoint.folder: no checkpoint of this run in {folder} loads ({'; '.join(failed)}); {START_OVER}"
        )
    return Start(0, float("nan"), None, events, _resolved(cfg, None, None))


def _load(cfg, model, optimizer, attempt: Try, fallback: bool) -> tuple[dict, list[str]] | str:
    """Load `attempt` (every rank); (its meta, the differing keys), or, falling back, the reason it did not
    load on some rank (every rank returns the same one)."""
    if not fallback:
        return load_dense(attempt.directory, model, optimizer, cfg)
    loaded, error = None, None
    try:
        loaded = load_dense(attempt.directory, model, optimizer, cfg)
    except (CheckpointError, IdentityError) as e:
        error = str(e)
    errors = [e for e in all_records(error) if e is not None]
    return errors[0] if errors else loaded


def _started(cfg, attempt: Try, meta: dict, differ: list[str], events: list) -> Start:
    """The start from the checkpoint `attempt` loaded (`meta`; `differ`: the keys of another config)."""
    step, loss = meta["step"], meta.get("loss", float("nan"))
    imported = meta["imported"].get("source") if is_imported(meta) else None
    events.append(CheckpointLoaded(step, attempt.directory, loss, imported))
    if differ:
        events.append(CheckpointOtherConfig(attempt.directory, tuple(differ)))
    if step > cfg.training.steps:
        raise ConfigError(
            f"config key 'training.steps' ({cfg.training.steps}) is below the checkpoint's step ({step}) in "
            f"{attempt.directory}"
        )
    lineage = meta.get(LINEAGE) if not (imported or differ) else None
    source = Source(attempt.directory, step, loss, meta["seal"], lineage)
    return Start(step, loss, source, events, _resolved(cfg, source, attempt.step))


def _resolved(cfg, source: Source | None, folder_step: int | None):
    """`cfg` with the start it made written out: `load_step N` for step N of the folder, `load DIR` and
    `load_step 0` for another checkpoint, `load_step 0` for the initial state. An elastic job keeps
    `load_step` -1 (it resumes from its newest at every round) and names what it loaded in `load`."""
    c = cfg.checkpoint
    if cfg.parallelism.elastic:
        checkpoint = dataclasses.replace(c, load=source.directory if source else c.load)
    elif folder_step is not None:
        checkpoint = dataclasses.replace(c, load_step=folder_step, load="")
    else:
        checkpoint = dataclasses.replace(c, load_step=0)
    return dataclasses.replace(cfg, checkpoint=checkpoint)
