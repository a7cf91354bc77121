"""The dense checkpoints' console lines (docs/design.md §5), typed: where a run starts (loaded, a fresh
start, a fallback past a damaged checkpoint, another config's checkpoint loaded on purpose) and what its
periodic saves did (saved, not saved and why, pruned, not pruned).

Each is a frozen dataclass like `trainer/run/event_lines.py`'s: `line()` is the console line byte for byte
(every one starts `checkpoint: `), `record()` the JSON object the run record keeps of it
(`trainer/run/event_log.py`), numbers rounded as the line prints them, and `from_record(record).line()` is
the printed line again. They are printed through a `say(event)` callable (`MetricsLogger.line` on rank 0),
from the training thread or, for a periodic save, from the rank's background save thread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar


class _Record:
    """`record()` and `from_record()` of a frozen dataclass of plain fields: tuples are JSON lists, the
    fields of `ROUNDED` are rounded to their decimals as the line prints them."""

    KIND: ClassVar[str]
    ROUNDED: ClassVar[dict[str, int]] = {}

    def record(self) -> dict:
        """The run record's JSON object of this line."""
        record = {"kind": self.KIND}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.ROUNDED and value is not None:
                value = float(f"{value:.{self.ROUNDED[f.name]}f}")
            record[f.name] = list(value) if isinstance(value, tuple) else value
        return record

    @classmethod
    def from_record(cls, record: dict):
        """The event of a record `record()` wrote (KeyError, TypeError or ValueError if it is not one)."""
        values = {k: v for k, v in record.items() if k != "kind"}
        for f in dataclasses.fields(cls):
            if isinstance(values.get(f.name), list):
                values[f.name] = tuple(values[f.name])
        return cls(**values)


@dataclass(frozen=True)
class CheckpointLoaded(_Record):
    """The run starts from a dense checkpoint:

        checkpoint: loaded step <n> from <dir> (loss <f>)
        checkpoint: <dir> holds imported weights (<source>): model initialised from them, fresh optimizer,
            starting at step 1                                                           (an imported one)

    (`<f>` with 6 decimals)."""

    KIND: ClassVar[str] = "checkpoint_loaded"
    ROUNDED: ClassVar[dict[str, int]] = {"loss": 6}

    step: int
    directory: str
    loss: float
    imported: str | None = None  # an imported checkpoint's source

    def line(self) -> str:
        """The console line, byte for byte the formats above."""
        if self.imported is not None:
            return (
                f"checkpoint: {self.directory} holds imported weights ({self.imported}): model initialised from "
                "them, fresh optimizer, starting at step 1"
            )
        return f"checkpoint: loaded step {self.step} from {self.directory} (loss {self.loss:.6f})"


@dataclass(frozen=True)
class CheckpointOtherConfig(_Record):
    """`checkpoint: <dir> was saved under another config (checkpoint.load_other_config): <key (saved ...,
    this run ...)>; ...`: what differs in a checkpoint loaded with `checkpoint.load_other_config`."""

    KIND: ClassVar[str] = "checkpoint_other_config"

    directory: str
    differ: tuple[str, ...]

    def line(self) -> str:
        return (
            f"checkpoint: {self.directory} was saved under another config (checkpoint.load_other_config): "
            f"{'; '.join(self.differ)}"
        )


@dataclass(frozen=True)
class FreshStart(_Record):
    """The run starts from the initial state although it keeps or reads checkpoints in `folder`:

    checkpoint: no checkpoint of this run in <folder>; starting from the initial state
    checkpoint: starting over (checkpoint.load_step 0); <folder> holds steps <n>, ... of other runs, left
        as they are                                                                  (`held` not empty)
    """

    KIND: ClassVar[str] = "checkpoint_fresh"

    folder: str
    held: tuple[int, ...] = ()  # the steps in the folder a start over leaves alone

    def line(self) -> str:
        if self.held:
            steps = ", ".join(map(str, self.held))
            return (
                f"checkpoint: starting over (checkpoint.load_step 0); {self.folder} holds steps {steps} of other "
                "runs, left as they are"
            )
        return f"checkpoint: no checkpoint of this run in {self.folder}; starting from the initial state"


@dataclass(frozen=True)
class CheckpointFallback(_Record):
    """`checkpoint: step <n> in <dir> is not usable (<why>); falling back to the next older checkpoint`: the
    newest checkpoint of the run is damaged; the `loaded` line that follows names the one used."""

    KIND: ClassVar[str] = "checkpoint_fallback"

    step: int
    directory: str
    why: str

    def line(self) -> str:
        return (
            f"checkpoint: step {self.step} in {self.directory} is not usable ({self.why}); falling back to the "
            "next older checkpoint"
        )


@dataclass(frozen=True)
class CheckpointSaved(_Record):
    """`checkpoint: saved step <n> to <dir> (<s> s in the background)`: a periodic checkpoint is published
    (`<s>` with 1 decimal)."""

    KIND: ClassVar[str] = "checkpoint_saved"
    ROUNDED: ClassVar[dict[str, int]] = {"seconds": 1}

    step: int
    directory: str
    seconds: float

    def line(self) -> str:
        return f"checkpoint: saved step {self.step} to {self.directory} ({self.seconds:.1f} s in the background)"


@dataclass(frozen=True)
class CheckpointNotSaved(_Record):
    """`checkpoint: step <n> not saved to <dir>: <why>`: a periodic save given up (a full disk, a rank that
    wrote nothing, a step directory of another run); nothing of it stays and training goes on."""

    KIND: ClassVar[str] = "checkpoint_not_saved"

    step: int
    directory: str
    why: str

    def line(self) -> str:
        return f"checkpoint: step {self.step} not saved to {self.directory}: {self.why}"


@dataclass(frozen=True)
class CheckpointPruned(_Record):
    """`checkpoint: pruned step <n> (<dir>): checkpoint.keep_latest=<k>`: an older checkpoint of this run's
    lineage deleted after a save."""

    KIND: ClassVar[str] = "checkpoint_pruned"

    step: int
    directory: str
    keep: int

    def line(self) -> str:
        return f"checkpoint: pruned step {self.step} ({self.directory}): checkpoint.keep_latest={self.keep}"


@dataclass(frozen=True)
class CheckpointNotPruned(_Record):
    """`checkpoint: <dir> not deleted (checkpoint.keep_latest=<k>): <why>`: a checkpoint pruning would delete
    holds something this program did not write, or could not be deleted; it stays."""

    KIND: ClassVar[str] = "checkpoint_not_pruned"

    directory: str
    keep: int
    why: str

    def line(self) -> str:
        return f"checkpoint: {self.directory} not deleted (checkpoint.keep_latest={self.keep}): {self.why}"


CHECKPOINT_EVENTS = (
    CheckpointLoaded,
    CheckpointOtherConfig,
    FreshStart,
    CheckpointFallback,
    CheckpointSaved,
    CheckpointNotSaved,
    CheckpointPruned,
    CheckpointNotPruned,
)
CheckpointEvent = (
    CheckpointLoaded
    | CheckpointOtherConfig
    | FreshStart
    | CheckpointFallback
    | CheckpointSaved
    | CheckpointNotSaved
    | CheckpointPruned
    | CheckpointNotPruned
)
