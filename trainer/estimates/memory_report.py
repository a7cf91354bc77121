"""The dry run's accelerator-memory lines (`trainer.estimates.memory_estimate`), one line per item.

Ranks whose figures are all equal share a line (`ranks=0-7`). Figures are GB (1e9 bytes).
"""

from __future__ import annotations

from moevement.storage.snapshot import STAGING_SLOTS
from trainer.config import Config
from trainer.estimates.activation_estimate import MODES
from trainer.estimates.host_estimate import gb
from trainer.estimates.memory_estimate import RankMemory, configured_mode, describe, estimate


def ranks_text(ranks: list[int]) -> str:
    """`[0, 1, 2, 5]` -> `0-2,5`."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _memory_fields(m: RankMemory) -> str:
    s = m.state
    peaks = " ".join(f"peak_{mode}={gb(m.peak(mode))}" for mode in MODES)
    return (
        f"pp={m.pp_rank} params={gb(s.params)} grads={gb(s.grads)} adamw={gb(s.moments)} buffers={gb(s.buffers)} "
        f"gathered={gb(m.gathered)} accum_grads={gb(m.accumulated)} moevement={gb(m.moevement)} {peaks}"
    )


def _activation_fields(m: RankMemory) -> str:
    alive = m.alive["none"]
    saved = " ".join(f"{mode}={gb(m.alive[mode].nbytes)}" for mode in MODES)
    working = " ".join(f"working_{mode}={gb(m.working[mode])}" for mode in MODES)
    return f"pp={m.pp_rank} micro_batches_alive={alive.micro_batches} {saved} {working} ({alive.why})"


def _grouped(ranks: list[RankMemory], fields) -> list[tuple[str, str]]:
    """(ranks text, fields) per distinct `fields(rank)`, in rank order."""
    groups: dict[str, list[int]] = {}
    for m in ranks:
        groups.setdefault(fields(m), []).append(m.rank)
    return [(ranks_text(rs), text) for text, rs in groups.items()]


def report(cfg: Config) -> list[str]:
    """The accelerator-memory lines of `train.py --dry-run`."""
    ranks = estimate(cfg)
    mode = configured_mode(cfg)
    lines = [f"accelerator memory per rank, GB (upper-bound bookkeeping of what is alive together; {describe(cfg)}):"]
    lines += [f"accel_memory ranks={r} {text}" for r, text in _grouped(ranks, _memory_fields)]
    lines += [f"accel_activations ranks={r} {text}" for r, text in _grouped(ranks, _activation_fields)]
    peaks = " ".join(f"peak_{m}={gb(max(r.peak(m) for r in ranks))}" for m in MODES)
    lines.append(
        f"accel_memory per_rank_max {peaks} (configured: {mode}; caching-allocator reserve and fragmentation "
        "come on top; docs/guide.md 'Memory before renting a GPU')"
    )
    lines.append(
        f"accel_moevement per_rank_max={gb(max(r.moevement for r in ranks))}: the snapshot staging ring "
        "(chunks gathered and checksummed on the device, then one copy each into pinned host buffers: "
        f"{STAGING_SLOTS} slots of {cfg.checkpoint.chunk_mb} MiB or the largest FP32 entry, and one slot of "
        "checksum transient) and the copy-bandwidth probe's source"
    )
    return lines
