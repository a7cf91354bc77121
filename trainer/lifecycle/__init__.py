"""A process's life: how a trainer starts, what it does when a peer dies, and how it ends.

Start here to follow a death (docs/design/lifecycle/README.md, "One home for a process's life"). Every decision is a
table in `verdict.py` (rows of data, first match wins); the other modules gather facts and carry verdicts
out, with the bounds of `[fault]` derived once (`fault_bounds.FaultBounds`):

- `entry.py`: what `train.py` is (a rank shell, a standby, the trainer), decided before and after the
  imports.
- `rank_shell.py`: one torchrun slot; replaces a dead trainer by its warm standby in the next generation,
  or hands the slot back to torchrun (`verdict.after_child_exit`), and starts a dead standby again
  (`verdict.after_standby_exit`).
- `start_plan.py`: how this process takes its place: torchrun's *attempt* (restarts of every worker) and
  the in-place *generation* it joins; carries `process_state.ProcessState` (what outlives generations).
- `stop_guard.py`: where SIGTERM may stop a rank and which state it then holds (`verdict.on_sigterm`).
- `peer_failure.py`: whether an exception is a peer's death (a failed communication or SIGTERM), told by
  type and origin, never by wording.
- `generations.py`: the loop over generations; takes the verdict after a failure (`verdict.decide`) and
  carries it out with `survival.py` (keep the state in memory and rejoin, or in host memory for torchrun:
  `host_dirs.py`; which state, `verdict.kept_iteration`).
- `job_end.py`: the job's end, recorded on torchrun's store: a death after it is nothing to recover; and
  when a generation a rank waits for cannot form (`verdict.cannot_form`; a lost node: `node_presence.py`).
- `process.py`: how the process ended, as its exit status (`exit_codes.py`) and at most one line
  (`process.ENDINGS`, `verdict.Ending`).

Which state a rejoining or restarted rank then starts from (its own kept state, a persisted window, a
re-laid window, a dense checkpoint) is one table, `moevement/recovery/start_source.py` (its facts gathered in
`trainer/run/start_facts.py`); the strategy restores from the source it chose (`CheckpointStrategy.resume`).
"""
