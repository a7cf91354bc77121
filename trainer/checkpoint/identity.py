"""The identity of a run, written into every piece of saved state and checked when it is read back.

A run is named by its job id (`job.name`) and a fingerprint of the config keys that determine its
training state: the model, the data and its order, the optimizer and LR schedule, the numerics, and,
for sparse snapshots, the parallel layout (a snapshot holds one rank's part of the state). Keys that
only change how a run is observed or how fast it runs (logging, checkpoint strategy, thread counts,
`training.stop_at`) are left out, so a relaunch of the same job with them changed still resumes.

Saved state carries `RunIdentity.to_json()`; a reader calls `mismatch(saved)` and refuses the state,
naming its file and the keys that differ, unless the result is empty.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

# Keys of the training config that determine the training state (section -> keys; None: every key).
STATE_KEYS: dict[str, tuple[str, ...] | None] = {
    "job": ("seed",),
    "model": None,
    "data": ("dataset", "hub_config", "train_split", "text_field", "tokenizer"),
    "training": (
        "steps",
        "batch_size",
        "micro_batches",
        "seq_len",
        "lr",
        "min_lr",
        "warmup_steps",
        "weight_decay",
        "beta1",
        "beta2",
        "eps",
        "max_grad_norm",
        "mixed_precision",
        "cpu_bf16_gemm",
        "deterministic",
    ),
}
LAYOUT_KEYS: dict[str, tuple[str, ...]] = {
    "parallelism": ("pp", "dp", "ep", "schedule", "stages_per_rank", "split_points"),
}
# A dense checkpoint loads into any layout, and training may go on past the step it was saved at.
DENSE_EXCLUDED = ("training.steps",)


class IdentityError(RuntimeError):
    """Saved state that belongs to another run; the message names the file and what differs."""


def _fields(cfg, sections: dict[str, tuple[str, ...] | None]) -> dict[str, object]:
    out = {}
    for section_name, keys in sections.items():
        section = asdict(getattr(cfg, section_name))
        for key in keys or sorted(section):
            out[f"{section_name}.{key}"] = section[key]
    return out


@dataclass(frozen=True)
class RunIdentity:
    """Job id, and the config values (flat `section.key` -> value) that determine the training state."""

    job: str
    fields: dict[str, object] = field(default_factory=dict)

    @classmethod
    def of_sparse(cls, cfg) -> RunIdentity:
        """For snapshots, replicas and persisted windows: one rank's state, so the layout counts."""
        return cls(cfg.job.name, {**_fields(cfg, STATE_KEYS), **_fields(cfg, LAYOUT_KEYS)})

    @classmethod
    def of_dense(cls, cfg) -> RunIdentity:
        """For dense checkpoints: layout-independent, and `training.steps` may grow. An elastic job
        (`parallelism.elastic`) changes its micro-batches per rank with its data-parallel degree and keeps
        their rows, which it is named by instead."""
        fields = {k: v for k, v in _fields(cfg, STATE_KEYS).items() if k not in DENSE_EXCLUDED}
        if cfg.parallelism.elastic:
            shares = fields.pop("training.micro_batches") * cfg.parallelism.dp
            fields["training.micro_batch_rows"] = cfg.training.batch_size // shares
        return cls(cfg.job.name, fields)

    @property
    def fingerprint(self) -> str:
        canonical = json.dumps(self.fields, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"job": self.job, "fingerprint": self.fingerprint, "fields": dict(self.fields)}

    def mismatch(self, saved: object, *, check_job: bool = True) -> list[str]:
        """What differs between this run and a saved `to_json()` record ([] when it belongs to this run)."""
        if not isinstance(saved, dict) or not isinstance(saved.get("fields"), dict):
            return ["no run identity (written by another program or an older version)"]
        differ = []
        if check_job and saved.get("job") != self.job:
            differ.append(f"job.name (saved {saved.get('job')!r}, this run {self.job!r})")
        theirs = saved["fields"]
        for key in sorted(set(self.fields) | set(theirs)):
            mine, other = self.fields.get(key, "<absent>"), theirs.get(key, "<absent>")
            if json.dumps(mine, default=str) != json.dumps(other, default=str):
                differ.append(f"{key} (saved {other!r}, this run {mine!r})")
        return differ

    def elastic_mismatch(self, saved: object) -> list[str]:
        """`mismatch` for sparse state an elastic job re-lays from another data-parallel degree: `parallelism.dp`
        and `training.micro_batches` may differ where a micro-batch keeps its rows (`parallelisms.elastic`)."""
        if not isinstance(saved, dict) or not isinstance(saved.get("fields"), dict):
            return self.mismatch(saved)
        mine = RunIdentity(self.job, _rows_not_ranks(self.fields))
        return mine.mismatch({**saved, "fields": _rows_not_ranks(saved["fields"])})

    def check(self, saved: object, source: str, *, check_job: bool = True) -> None:
        """Raise IdentityError naming `source` unless `saved` belongs to this run."""
        differ = self.mismatch(saved, check_job=check_job)
        if differ:
            raise IdentityError(f"{source}: belongs to another run: {'; '.join(differ)}")


def _rows_not_ranks(fields: dict[str, object]) -> dict[str, object]:
    """`fields` with the data-parallel degree and micro-batches per rank replaced by a micro-batch's rows."""
    out = dict(fields)
    dp, micro_batches = out.pop("parallelism.dp", None), out.pop("training.micro_batches", None)
    try:
        out["training.micro_batch_rows"] = out["training.batch_size"] // (micro_batches * dp)
    except (KeyError, TypeError, ZeroDivisionError):
        out["training.micro_batch_rows"] = None
    return out
