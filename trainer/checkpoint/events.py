"""The dense checkpoints' console lines (docs/design/output-lines.md), typed: where a run starts (loaded, a fresh start,
a fallback past a damaged checkpoint, another config's checkpoint loaded on purpose) and what its periodic
saves did (saved, not saved and why, pruned, not pruned), and the end of run's `checkpoint.save_final`.

Each is a `TypedLine` (trainer/typed_line.py): `line()` is the console line byte for byte (every one starts
`checkpoint: `, but `saved checkpoint step=`, the format output-lines.md fixes for `save_final`), `record()` the JSON
object the run record keeps of it (`trainer/records/event_log.py`), numbers rounded as the line prints them, and
`from_record(record).line()` is the printed line again. They are printed through a `say(event)` callable
(`MetricsLogger.line` on rank 0), from the training thread or, for a periodic save, from the rank's background
save thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.typed_line import TypedLine


@dataclass(frozen=True)
class CheckpointLoaded(TypedLine):
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
class CheckpointOtherConfig(TypedLine):
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
class FreshStart(TypedLine):
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
class CheckpointFallback(TypedLine):
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
class CheckpointSaved(TypedLine):
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
class CheckpointNotSaved(TypedLine):
    """`checkpoint: step <n> not saved to <dir>: <why>`: a periodic save given up (a full disk, a rank that
    wrote nothing, a step directory of another run); nothing of it stays and training goes on."""

    KIND: ClassVar[str] = "checkpoint_not_saved"

    step: int
    directory: str
    why: str

    def line(self) -> str:
        return f"checkpoint: step {self.step} not saved to {self.directory}: {self.why}"


@dataclass(frozen=True)
class CheckpointPruned(TypedLine):
    """`checkpoint: pruned step <n> (<dir>): checkpoint.keep_latest=<k>`: an older checkpoint of this run's
    lineage deleted after a save."""

    KIND: ClassVar[str] = "checkpoint_pruned"

    step: int
    directory: str
    keep: int

    def line(self) -> str:
        return f"checkpoint: pruned step {self.step} ({self.directory}): checkpoint.keep_latest={self.keep}"


@dataclass(frozen=True)
class CheckpointNotPruned(TypedLine):
    """`checkpoint: <dir> not deleted (checkpoint.keep_latest=<k>): <why>`: a checkpoint pruning would delete
    holds something this program did not write, or could not be deleted; it stays."""

    KIND: ClassVar[str] = "checkpoint_not_pruned"

    directory: str
    keep: int
    why: str

    def line(self) -> str:
        return f"checkpoint: {self.directory} not deleted (checkpoint.keep_latest={self.keep}): {self.why}"


@dataclass(frozen=True)
class FinalCheckpointSaved(TypedLine):
    """`saved checkpoint step=<n> dir=<dir>`: the checkpoint `checkpoint.save_final` asked for is published
    (after the `final` line: docs/design/output-lines.md)."""

    KIND: ClassVar[str] = "checkpoint_final_saved"

    step: int
    directory: str

    def line(self) -> str:
        return f"saved checkpoint step={self.step} dir={self.directory}"


CHECKPOINT_EVENTS = (
    CheckpointLoaded,
    CheckpointOtherConfig,
    FreshStart,
    CheckpointFallback,
    CheckpointSaved,
    CheckpointNotSaved,
    CheckpointPruned,
    CheckpointNotPruned,
    FinalCheckpointSaved,
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
    | FinalCheckpointSaved
)
