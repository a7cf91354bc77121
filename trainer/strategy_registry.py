"""The checkpoint strategies `checkpoint.strategy` names, one entry each (as TorchTitan's `TrainSpec`s).

An entry says what the strategy can restore a starting rank from (`moevement.recovery.start_source`: the
start-source table chooses among them), where it persists, what else of the config it needs (`check`), and
which function builds it on a rank from the trainer's wiring (`trainer/run/strategy_factory.py`:
`StrategyWiring`). Its recovery is the strategy's own (`CheckpointStrategy.recover` and `resume`).

Adding a strategy touches its own file and this one: `docs/guide.md` ("Adding a strategy") walks through
`baselines/every_n.py`. The builder is named as `"module:function"` and imported when a rank builds the
strategy, so the config (which checks names and capabilities here) imports no strategy code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from moevement.recovery.start_source import Source

# where a strategy persists: checkpoint.persist_dir (if set), a folder beside the run records
# (`<output_dir>/<name>-checkpoints`, or persist_dir if set), or nowhere (host memory only)
Persists = Literal["persist_dir", "beside_records", "nowhere"]


@dataclass(frozen=True)
class StrategyEntry:
    name: str
    build: str | None  # "module:function" taking a `StrategyWiring`; None: the strategy needs nothing (none)
    restores: frozenset[Source] = frozenset()  # what a starting rank's state may come from (start_source.choose)
    persists: Persists = "nowhere"
    window_profile: bool = False  # writes `metrics.profile` (MoEvement's Algorithm 1 plan): `planned_window()`
    # what else of the config it needs: (key, what is wrong with it), or None when the config is fine
    check: Callable[[Any], tuple[str, str] | None] | None = None

    @property
    def recovers(self) -> bool:
        """Whether it recovers from failures at all (`none` does not: the config refuses failures with it)."""
        return self.build is not None

    def builder(self) -> Callable[..., Any]:
        """The function that builds it on a rank (imported now)."""
        module, function = self.build.split(":")
        return getattr(importlib.import_module(module), function)


_FACTORY = "trainer.run.strategy_factory"
_BASELINE = f"{_FACTORY}:build_interval_baseline"  # gemini, checkfreq, moc: an interval policy, a global rollback
_RELAID_DENSE = frozenset({Source.RELAID_WINDOW})  # checkpoints of every operator re-lay in an elastic round

STRATEGIES: dict[str, StrategyEntry] = {
    entry.name: entry
    for entry in (
        StrategyEntry("none", None),
        StrategyEntry(
            "moevement",
            f"{_FACTORY}:build_moevement",
            frozenset({Source.LIVE_STATE, Source.PERSISTED_WINDOW, Source.RELAID_WINDOW}),
            "persist_dir",
            window_profile=True,
        ),
        StrategyEntry("gemini", _BASELINE, _RELAID_DENSE | {Source.HOST_CHECKPOINT}),
        StrategyEntry("checkfreq", _BASELINE, _RELAID_DENSE | {Source.DISK_CHECKPOINT}, "beside_records"),
        StrategyEntry("moc", _BASELINE, frozenset({Source.DISK_CHECKPOINT}), "beside_records"),
        StrategyEntry(
            "every_n",
            "baselines.every_n:build",
            frozenset({Source.HOST_CHECKPOINT}),
            check=lambda cfg: (
                None
                if cfg.checkpoint.interval.isdigit()
                else ("checkpoint.interval", f"must be N (iterations) for every_n, got {cfg.checkpoint.interval!r}")
            ),
        ),
    )
}


def strategy_entry(name: str) -> StrategyEntry:
    """The entry `checkpoint.strategy = name` selects (the config has checked the name)."""
    return STRATEGIES[name]
