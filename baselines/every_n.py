"""`checkpoint.strategy = "every_n"`: a dense checkpoint every N iterations, a global rollback to it.

The smallest strategy, and the example of adding one (docs/guide.md, "Adding a strategy"): this file and
its entry in `trainer/strategy_registry.py` (which checks that `checkpoint.interval` is N and says what it
restores a starting rank from: its newest replicated checkpoint in host memory after a death of the run).
It reuses the interval baselines' machinery: the snapshot of every operator (`SparseCheckpointer` driven
by a fixed `IntervalPolicy`, replicated to `checkpoint.replicas` peers), the rollback of every rank
(`GlobalRollback`) and the loop's interface (`IntervalBaseline`). A failure before iteration T rolls every
rank back to the newest checkpoint t_c and the loop runs t_c..T-1 again: the same bits as without it.
"""

from __future__ import annotations

from baselines.global_rollback import GlobalRollback
from baselines.intervals import IntervalPolicy
from baselines.strategy import IntervalBaseline

NAME = "every_n"


def build(w) -> IntervalBaseline:
    """The strategy on this rank, from the trainer's wiring `w` (`trainer.run.strategy_factory.StrategyWiring`:
    its config, model, optimizer, host state, start and checkpointer factory)."""
    w.clear_rank_dir()  # what the start restores from is loaded: the directory starts empty
    names = [op.name for op in w.operators()]
    policy = IntervalPolicy(NAME, w.cfg.checkpoint.interval, 0.0, lambda: names)  # N: a fixed interval
    checkpointer = w.new_checkpointer(w.cfg.checkpoint, policy=policy)
    rollback = GlobalRollback(NAME, checkpointer, policy, w.model.n_stages, w.initial_parameters, w.line)
    return IntervalBaseline(checkpointer, rollback, None, w.lock, w.start.rejoin, w.restart_state())
