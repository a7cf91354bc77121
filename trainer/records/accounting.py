"""ETTR bookkeeping of one run: productive iterations, recomputed ones, recovery, checkpoint memory.

An iteration counts as productive the first time it completes; running it again is recomputation (lost
work): in the training loop after a baseline's rollback (`recompute_s`), or replayed by a recovery
(its seconds are the recovery's). A recovery costs the time from its fault to training going on: the
seconds from the fault to its detection (`detect`, where a clock saw the fault: the rank shell's, for a
dead or frozen worker replaced in place) and from there on. At the end, rank 0 prints (and records) one
`accounting` line (`trainer/records/accounting_line.py`, `summary`), which `benchmarks.ettr` reads.

A run survives a torchrun restart: a worker that stops because another died writes its accounting
(`<host job dir>/accounting-rank<r>.json`; with no checkpoint strategy too, under torchrun) and the
restarted job carries it on (`carry_on`), counting the time from the detection of the death to training
going on again as recovery, and the restart as a failure: a death, a hang, a node lost for good that an
elastic job shrinks without (a round torchrun restarted because a node joined costs its seconds but is no
failure). Its wall time is then the time from the start of the first attempt's training to the end of the
last iteration or recovery: gathering the final state for the digest and shutting down are not training
(they took 7-14 s at the end of a 100-iteration `bench_moe` run, which ETTR would otherwise count as lost).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch.distributed as dist

from moevement.recovery.report import RecoveryFigures
from moevement.storage.host_memory import read_header
from moevement.storage.private_files import HostMemoryError, make_private_dirs, write_json_atomic
from parallelisms import collectives
from trainer.config import Config
from trainer.lifecycle.host_dirs import host_job_dir
from trainer.records.accounting_line import AccountingLine

COUNTERS = (
    "first_step",
    "high_water",
    "productive_s",
    "recompute_s",
    "recovery_s",
    "detect_s",
    "failures",
    "recomputed",
)


class RunAccounting:
    """`tokens_per_step`: an iteration's tokens (the global batch); `path`: where a stopping worker keeps
    this accounting for a torchrun restart (None: nowhere)."""

    def __init__(self, first_step: int, tokens_per_step: int, path: Path | None = None):
        self.first_step, self.tokens, self.path = first_step, tokens_per_step, path
        self.high_water = first_step - 1  # newest iteration completed so far
        self.productive_s = self.recompute_s = self.recovery_s = self.detect_s = 0.0
        self.failures = self.recomputed = 0
        self.started_unix = time.time()  # when the run (its first attempt) started training
        self.trained_unix = self.started_unix  # when its newest iteration or recovery ended
        self.last_recovery_end = 0.0  # perf_counter() when the newest recovery finished

    def elapsed(self) -> float:
        """Wall seconds since the run started training."""
        return time.time() - self.started_unix

    def iteration(self, step: int, seconds: float) -> None:
        self.trained_unix = time.time()
        if step > self.high_water:
            self.productive_s += seconds
            self.high_water = step
        else:
            self.recompute_s += seconds
            self.recomputed += 1

    def recovered(self, failures: int, seconds: float, figures: RecoveryFigures | None = None) -> None:
        """`failures` recovered in `seconds` from their detection; `figures`: the recovery's line, whose
        seconds from the fault to its detection (`detect`) count too, and whose replayed iterations
        (`replays`) are recomputed ones."""
        detect = figures.detect if figures is not None else 0.0
        self.failures += failures
        self.detect_s += detect
        self.recovery_s += seconds + detect
        self.recomputed += figures.replays if figures is not None else 0
        self.last_recovery_end = time.perf_counter()
        self.trained_unix = time.time()

    def carry_on(
        self, name: dict, kept: dict | None = None, in_place: bool = False, figures: RecoveryFigures | None = None
    ) -> None:
        """After a death: go on with the newest accounting any rank kept (collective), counting the time from
        its stop to now as recovery, with the restart's recovery line (`figures`: its detection and replays).
        `in_place`: survivors kept theirs in memory (`kept`, from `record`); otherwise, after a torchrun
        restart, in files named by the run and an earlier attempt (`name`: `StartPlan.name()`). A first
        attempt instead removes this rank's file, an earlier launch's."""
        if self.path is None:
            return
        if in_place:
            kept, failed = _newest_in_memory(kept), True
        else:  # a record of this same attempt: torchrun restarted the round because a node joined, no failure
            found = _newest_kept(self.path, name)
            kept, failed = (found["accounting"], found["attempt"] < name["attempt"]) if found else (None, False)
        if kept is None:
            return
        for key in COUNTERS:
            setattr(self, key, type(getattr(self, key))(kept[key]))
        self.started_unix = kept["started_unix"]
        self.recovered(int(failed), max(0.0, time.time() - kept["stopped_unix"]), figures)

    def record(self, stopped_unix: float) -> dict:
        """The accounting as a survivor keeps it when it stops at `stopped_unix` (unix seconds)."""
        kept = {key: getattr(self, key) for key in COUNTERS}
        return {**kept, "started_unix": self.started_unix, "stopped_unix": stopped_unix}

    def keep(self, name: dict, stopped_unix: float) -> None:
        """This worker stops (another died): keep the accounting, named by torchrun run and attempt (`name`),
        owner-only and atomic. It stays until the run finishes (`drop`), so an attempt that dies before
        keeping its own leaves the older one to the next."""
        if self.path is None:
            return
        write_json_atomic(self.path, {**name, "accounting": self.record(stopped_unix)})

    def drop(self) -> None:
        """The run finished: remove this rank's kept accounting (written by this program)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def summary(self, metrics: dict[str, float], lost_tokens: float) -> AccountingLine:
        """The `accounting` line of the run so far (`metrics`: the strategy's totals, `host_mb` and `log_mb`)."""
        wall = self.trained_unix - self.started_unix
        iterations = self.high_water - self.first_step + 1
        return AccountingLine(
            wall_s=wall,
            iterations=iterations,
            productive_s=self.productive_s,
            recompute_s=self.recompute_s,
            recovery_s=self.recovery_s,
            detect_s=self.detect_s,
            failures=self.failures,
            recomputed=self.recomputed,
            tokens_per_s=iterations * self.tokens / wall if wall > 0 else 0.0,
            lost_tokens=round(lost_tokens),
            host_mb=metrics.get("host_mb", 0.0),
            log_mb=metrics.get("log_mb", 0.0),
        )


def kept_path(cfg: Config, rank: int) -> Path | None:
    """Where rank `rank` keeps its accounting for a torchrun restart: `<host job dir>/accounting-rank<r>.json`.
    A checkpoint strategy made that directory; without one (`none`) it is made here (owner-only) under
    torchrun, and a run without torchrun, which nothing restarts, keeps none (None). A directory that
    cannot be made costs one line, not the run."""
    path = host_job_dir(cfg) / f"accounting-rank{rank:05d}.json"
    if cfg.checkpoint.strategy != "none":
        return path
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        make_private_dirs(path.parent.parent, path.parent.name)
    except (HostMemoryError, OSError) as e:
        print(f"accounting: rank {rank} keeps none for a torchrun restart: {e}", flush=True)
        return None
    return path


def _newest_in_memory(mine: dict | None) -> dict | None:
    """The newest of the records the survivors of an in-place replacement kept (collective)."""
    gathered: list = [None] * dist.get_world_size()
    collectives.all_gather_object(gathered, mine)
    found = [g for g in gathered if g is not None]
    return max(found, key=lambda g: g["high_water"]) if found else None


def _newest_kept(path: Path, name: dict) -> dict | None:
    """The newest accounting kept by an earlier round of this run, over every rank's file, with the attempt
    that kept it ({"attempt", "accounting"}; collective after a restart; a first attempt only removes this
    rank's file, an earlier launch's)."""
    if name["attempt"] == 0:  # the same on every rank
        path.unlink(missing_ok=True)
        return None
    mine = _read_kept(path, name)
    gathered: list = [mine]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        collectives.all_gather_object(gathered, mine)
    found = [g for g in gathered if g is not None]
    return max(found, key=lambda g: (g["attempt"], g["accounting"]["high_water"])) if found else None


def _read_kept(path: Path, name: dict) -> dict | None:
    """The record at `path` if it is of this run, of this attempt or an earlier one, and well-formed (else
    None; a record of an older version, which named the attempt "generation", is of another run). A record
    of this attempt was kept by a round that torchrun restarted because a node joined (an elastic job grows
    back): a join does not count as a restart."""
    try:
        record = read_header(path.with_suffix(""))
    except HostMemoryError as e:
        print(f"restart: accounting not carried on: {e}", flush=True)
        return None
    if record is None:
        return None
    kept, era = record.get("accounting"), record.get("attempt")
    fields = (*COUNTERS, "started_unix", "stopped_unix")
    if (
        record.get("run_id") != name["run_id"]
        or not isinstance(era, int)
        or not 0 <= era <= name["attempt"]
        or not isinstance(kept, dict)
        or not all(isinstance(kept.get(k), int | float) and math.isfinite(kept[k]) for k in fields)
    ):
        print(f"restart: accounting not carried on: {path} is of another run or malformed", flush=True)
        return None
    return {"attempt": era, "accounting": kept}
