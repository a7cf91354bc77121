"""The rank shell: what torchrun starts in each slot, so a dead worker is replaced without torchrun noticing.

torchrun restarts every worker of the job when one dies (docs/design/lifecycle/replacement.md). Under torchrun, with a
checkpoint strategy (not "none"), `fault.max_replacements` > 0 and more than one worker, `train.py`
therefore starts as this thin parent, which imports no torch and never touches a GPU. It runs the trainer
as its child and keeps one warm standby child: a second `train.py` with the interpreter started, waiting on
a pipe. Told `prepare` (once the trainer says it trains, or at once: `fault.standby_prepare`), it imports
torch and the project and builds what it can of its rank (`trainer/run/prebuilt.py`), then waits for the
word to start (on a GPU it holds no CUDA context until then).

A standby that dies while it waits is started again at once (one `shell:` line). When the trainer child
dies (SIGKILL, a segfault, the OOM killer, an unexpected exit status), the shell
tells the standby which generation to join and it becomes the same rank on the same device; a new standby
starts behind it. The surviving ranks notice the death themselves (a failed collective), keep their state
in memory and join the same generation (`parallelisms.distributed.join_generation`). torchrun sees nothing.

The shell gives the slot back to torchrun's own restart (exit status of the child) when the child exits
cleanly (0), with a clean error (2), or asks for it (`FALLBACK`: a survivor that could not rejoin in place,
or a replacement that could not join in time); when `fault.max_replacements` replacements are spent; and
when torchrun stops it (SIGTERM, forwarded to the child). It dies with torchrun's agent, and its children
with it (`PR_SET_PDEATHSIG`).

Messages from the trainer child reach the shell on a pipe (`SHELL_FD`), one line each: `alive` every second
from a thread of its own once its imports are done (a trainer silent for longer than the hang bound,
`fault.heartbeat_timeout_s` or a shorter `fault.timeout_s` (`verdict.hang_bound`), is frozen, stopped or
stuck: the shell kills it and its standby replaces it, so a hang is recovered in place like a death, in
about that bound), `generation <g>` when it starts joining generation g, `step <n>` when it begins training
iteration n, `training <step>` once that generation is set up and recovered (the standby is told to prepare
then, not beside a replay), `run <dir>` once it knows the run folder (the shell records its `shell:` lines in
its events.jsonl), `finished <step>` once it knows the job finished (trainer/lifecycle/job_end.py): a trainer
that dies after that is nothing to recover, and the shell exits with success, replacing nobody. What the
shell does when its trainer ends is `verdict.after_child_exit`. The shell beats back to each child, which
ends a shell that stopped beating (`trainer/lifecycle/shell_watch.py`). A standby it activates learns its
generation, the dead trainer's pid, when the fault struck (`fault_unix`: the death the shell saw, or a
frozen trainer's last word), from which the recovery's `detect=` is measured, and the iteration the trainer
had begun (`fault_step`, the recovery's `fault_step=`).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainer.lifecycle import exit_codes, store_keeper
from trainer.lifecycle.exit_codes import describe, exit_status
from trainer.lifecycle.shell_argv import ERRORS, setting
from trainer.lifecycle.shell_lines import (
    AFTER_THE_END,
    FROZEN,
    HANDED_BACK,
    REPLACED,
    STANDBY_LOST,
    STANDBY_RESPAWNED,
    ShellLine,
)
from trainer.lifecycle.shell_watch import BEATS_FD, HANG_BOUND, HEARTBEAT_S, ShellBeats, say, watch_shell
from trainer.lifecycle.verdict import (
    ChildEnd,
    ShellVerdict,
    StandbyEnd,
    StandbyVerdict,
    a_frozen_child,
    after_child_exit,
    after_standby_exit,
    child_end,
    hang_bound,
    runs_a_shell,
)

ROLE = "MOEVEMENT_ROLE"  # "trainer" or "standby" in the shell's children; unset elsewhere
SHELL_FD = "MOEVEMENT_SHELL_FD"  # the trainer child's end of the report pipe
AGENT_PID = "MOEVEMENT_AGENT_PID"  # torchrun's agent, the shell's parent
GENERATION = "MOEVEMENT_GENERATION"  # set in an activated standby: the generation it joins
FAULT_UNIX = "MOEVEMENT_FAULT_UNIX"  # set in an activated standby: when the fault it replaces struck (unix s)
FAULT_STEP = "MOEVEMENT_FAULT_STEP"  # ... and the iteration the dead trainer had begun (unset: none)
PREPARE = b"prepare"  # the shell's word to a standby: import and build now (`await_word_to_prepare`)
_PR_SET_PDEATHSIG = 1
_WATCHING = False  # in a shell's child: it watches the shell's beats (`watch_the_shell`)
_TOLD: dict[str, Path] = {}  # in a shell's trainer child: the run folder it named to its shell (`report`)


def torchrun_agent_pid() -> int:
    """The pid of the torchrun agent that started this worker (its parent, or its shell's parent)."""
    return int(os.environ.get(AGENT_PID) or os.getppid())


def wanted(argv: list[str]) -> bool:
    """Whether this process, started as `train.py argv`, is to be a rank shell (`verdict.runs_a_shell`, from
    torchrun's environment and what the command line and config file say)."""
    env = os.environ
    try:
        strategy = setting(argv, "checkpoint.strategy", str)
        budget = setting(argv, "fault.max_replacements", int)
    except ERRORS:
        return False  # the trainer reports a bad config itself, without a shell
    one_shot = bool({"--dry-run", "--print-config", "-h", "--help"} & set(argv))
    return runs_a_shell("RANK" in env, int(env.get("WORLD_SIZE", "1")), ROLE in env, one_shot, strategy, budget)


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RankShell:
    """One torchrun slot: the trainer child, its standby, and the generation the trainer last joined."""

    def __init__(
        self,
        command: list[str],
        max_replacements: int,
        bound_s: float,
        bound_key: str = "fault.heartbeat_timeout_s",
        prepare_at_once: bool = False,
    ):
        """`bound_s`: the hang bound, set by config key `bound_key` (`verdict.hang_bound`). `prepare_at_once`
        (`fault.standby_prepare` at_once): a standby prepares as soon as it starts, not once the trainer
        trains."""
        self.command, self.max_replacements = command, max_replacements
        self.prepare_at_once = prepare_at_once
        self.training = False  # the trainer said it trains (its generation set up and recovered)
        self.told: set[int] = set()  # standby pids told to prepare
        self.bound_s, self.bound_key = bound_s, bound_key
        self.rank = os.environ.get("RANK", "?")
        self.generation, self.replacements, self.stopping = 0, 0, False
        self.finished_at: int | None = None  # the step the job finished at, once the trainer said so
        self.standbys_lost = 0  # standbys that died idle and were started again
        self.run_dir: Path | None = None  # the run record's folder, once the trainer named it (`run <dir>`)
        self.heard: float | None = None  # when the trainer last said anything (None: not since it started)
        self.frozen_at: float | None = None  # unix time of a trainer killed as frozen's last word
        self.begun: int | None = None  # the iteration the trainer last said it began (`step <n>`)
        self.beats = ShellBeats()
        self.reports, report_end = os.pipe()
        self.env = {**os.environ, AGENT_PID: str(os.getppid()), SHELL_FD: str(report_end)}
        self.env[HANG_BOUND] = f"{bound_key}={bound_s!r}"
        self.keeper = store_keeper.start_if_needed(self.env, _die_with_parent)  # rank 0's own-store round
        self.child = self._spawn("trainer")
        self.standby = self._spawn_standby()
        signal.signal(signal.SIGTERM, self._forward_sigterm)

    def _spawn(self, role: str, **kwargs) -> subprocess.Popen:
        """A child with the report pipe's write end (a standby reports once it is activated) and the read end
        of a beat pipe of its own."""
        beats, beat_end = self.beats.pipe()
        env = {**self.env, ROLE: role, BEATS_FD: str(beats)}
        fds = (int(self.env[SHELL_FD]), beats)
        try:
            child = subprocess.Popen(self.command, env=env, pass_fds=fds, preexec_fn=_die_with_parent, **kwargs)
        finally:
            os.close(beats)
        self.beats.add(child.pid, beat_end)
        return child

    def _spawn_standby(self) -> subprocess.Popen:
        """A new standby, told to prepare at once where the trainer trains already (or `prepare_at_once`)."""
        standby = self._spawn("standby", stdin=subprocess.PIPE)
        if self.prepare_at_once or self.training:
            self._tell_to_prepare(standby)
        return standby

    def _tell_to_prepare(self, standby: subprocess.Popen | None) -> None:
        """Say `prepare` to `standby`, once: it imports torch and the project and builds what it can of its rank
        (`trainer/run/prebuilt.py`). One that died meanwhile is replaced by the loop (`_keep_a_standby`)."""
        if standby is None or standby.pid in self.told:
            return
        self.told.add(standby.pid)
        try:
            standby.stdin.write(PREPARE + b"\n")
            standby.stdin.flush()
        except OSError:
            pass

    def _forward_sigterm(self, signum, _frame) -> None:
        """torchrun stops the job: the child's end is no death to replace. The handler runs between two of
        the shell's own steps, possibly inside its wait for a child (`_stop_standby`), so it only sends
        signals: a wait here would take the lock the interrupted wait holds, and the shell would hang until
        torchrun's SIGKILL. The main loop reaps both children."""
        self.stopping = True
        self.child.send_signal(signum)
        if self.standby is not None:
            self.standby.kill()

    def _stop_standby(self) -> None:
        if self.standby is not None:
            if self.standby.poll() is None:
                self.standby.kill()
                self.standby.wait()
            self.beats.drop(self.standby.pid)
        self.standby = None

    def _read_reports(self, timeout: float) -> None:
        ready, _, _ = select.select([self.reports], [], [], timeout)
        if not ready:
            return
        data = os.read(self.reports, 4096)
        if data:
            self.heard = time.monotonic()
        for line in data.decode().splitlines():
            word, _, value = line.partition(" ")
            if word == "generation" and value.isdigit():
                self.generation = max(self.generation, int(value))
            elif word == "step" and value.isdigit():
                self.begun = int(value)
            elif word == "finished" and value.isdigit():
                self.finished_at = int(value)
            elif word == "run" and value:
                self.run_dir = Path(value)
            elif word == "training":
                self.training = True
                self._tell_to_prepare(self.standby)

    def _say(self, line: ShellLine) -> None:
        say(line, self.run_dir)

    def run(self) -> int:
        """Supervise until the slot's work ends; returns the exit status for torchrun."""
        while True:
            while (code := self.child.poll()) is None:
                self.beats.beat()
                self._read_reports(0.1)
                self._keep_a_standby()
                self._kill_if_frozen()
            self._read_reports(0)
            verdict = after_child_exit(self._child_end(code))
            if verdict is ShellVerdict.DONE:
                self._say(ShellLine(AFTER_THE_END, self.rank, self.child.pid, describe(code), step=self.finished_at))
                self._stop_standby()
                return exit_codes.DONE
            if verdict is not ShellVerdict.REPLACE:
                if verdict is not ShellVerdict.HAND_BACK:  # a death nobody replaces: say why
                    self._say(ShellLine(HANDED_BACK, self.rank, self.child.pid, describe(code), why=verdict.value))
                self._stop_standby()
                return exit_status(code)
            self._replace(code)

    def _child_end(self, code: int) -> ChildEnd:
        """The facts of the trainer child's end with `code` (`verdict.after_child_exit`)."""
        ready = self.standby is not None and self.standby.poll() is None
        spent = self.replacements >= self.max_replacements
        return child_end(code, self.stopping, self.finished_at is not None, ready, spent)

    def _keep_a_standby(self) -> None:
        """A standby that died while the trainer ran (killed, out of memory) is started again at once, so the
        trainer's next death is still replaced in place; at most `max_replacements` times (then a death goes
        to torchrun's restart, "no standby")."""
        if self.standby is None or self.standby.poll() is None:
            return
        verdict = after_standby_exit(StandbyEnd(self.stopping, self.standbys_lost >= self.max_replacements))
        if verdict is StandbyVerdict.LEAVE:
            return
        dead, code = self.standby.pid, self.standby.returncode
        self.beats.drop(dead)
        if verdict is StandbyVerdict.GIVE_UP:
            self._say(ShellLine(STANDBY_LOST, self.rank, dead, describe(code)))
            self.standby = None
            return
        self.standbys_lost += 1
        self.standby = self._spawn_standby()
        count, limit = self.standbys_lost, self.max_replacements
        self._say(ShellLine(STANDBY_RESPAWNED, self.rank, dead, describe(code), self.standby.pid, count, limit))

    def _kill_if_frozen(self) -> None:
        """A trainer that said nothing, not even its heartbeat, for longer than the hang bound since it first
        spoke (`verdict.a_frozen_child`: stopped, or stuck holding the interpreter) is killed:
        its peers' collectives fail at once, and its end is a death the standby replaces, the fault dated
        from its last word. Counting starts with its first word, once its imports are done
        (`start_heartbeat`)."""
        if self.heard is None:
            return
        silent = time.monotonic() - self.heard
        if a_frozen_child(silent, self.bound_s, self.stopping):
            line = ShellLine(
                FROZEN,
                self.rank,
                self.child.pid,
                "frozen",
                silent_s=silent,
                bound_s=self.bound_s,
                bound_key=self.bound_key,
            )
            self._say(line)
            self.frozen_at = time.time() - silent
            self.child.kill()
            self.child.wait()

    def _replace(self, code: int) -> None:
        """The trainer child died with `code`: start the (live) standby as the same rank in the next generation."""
        how = describe(code)
        dead, self.child, self.generation = self.child.pid, self.standby, self.generation + 1
        self.beats.drop(dead)
        self.heard = None  # the replacement's heartbeat starts once it is activated
        self.replacements += 1
        now, fault, self.frozen_at = time.time(), self.frozen_at, None
        activation = {"generation": self.generation, "died": dead, "fault_unix": fault or now, "fault_step": self.begun}
        self.begun = None
        self.training = False  # until the replacement has recovered
        self._tell_to_prepare(self.child)  # at once, if it was still waiting for the word
        self.child.stdin.write(json.dumps(activation).encode() + b"\n")
        self.child.stdin.close()
        count, limit = self.replacements, self.max_replacements
        line = ShellLine(REPLACED, self.rank, dead, how, self.child.pid, count, limit, self.generation, now)
        self._say(line)
        self.standby = self._spawn_standby()


def run_shell(argv: list[str]) -> int:
    """`train.py argv` as a rank shell (see the module docstring). The shell dies with torchrun's agent (and
    its children with it): a slot whose agent is gone has no store to rejoin and nobody to report to."""
    agent = os.getppid()
    _die_with_parent()
    if os.getppid() != agent:  # the agent died before the request took effect
        return 1
    budget = setting(argv, "fault.max_replacements", int)
    key, bound_s = hang_bound(
        setting(argv, "fault.heartbeat_timeout_s", float), setting(argv, "fault.timeout_s", float)
    )
    at_once = setting(argv, "fault.standby_prepare", str) == "at_once"
    return RankShell([sys.executable, *sys.argv[:1], *argv], budget, bound_s, key, at_once).run()


def await_word_to_prepare() -> None:
    """In a standby, before its imports: block until the shell says `prepare` (`RankShell._tell_to_prepare`);
    exit with success when the shell ends first (its pipe closes). The shell's beats are watched meanwhile."""
    watch_the_shell()
    line = sys.stdin.buffer.readline()
    if line.strip() != PREPARE:
        sys.exit(exit_codes.DONE)


def await_activation() -> dict | None:
    """In a standby: block until the shell activates it; the activation ({"generation", "died", "fault_unix",
    "fault_step"}), or None when the shell ends without needing it (its pipe closes)."""
    line = sys.stdin.buffer.readline()
    while line.strip() == PREPARE:  # said before the activation to a standby that had not prepared yet
        line = sys.stdin.buffer.readline()
    if not line:
        return None
    activation = json.loads(line)
    os.environ[GENERATION] = str(activation["generation"])
    os.environ[FAULT_UNIX] = repr(float(activation["fault_unix"]))
    if activation.get("fault_step") is not None:
        os.environ[FAULT_STEP] = str(int(activation["fault_step"]))
    os.environ[ROLE] = "trainer"
    return activation


def shell_fault() -> tuple[float, int | None] | None:
    """In an activated standby: when the fault it replaces struck, by its shell's clock, and the iteration the
    dead trainer had begun (None if none); None elsewhere."""
    unix, step = os.environ.get(FAULT_UNIX), os.environ.get(FAULT_STEP)
    return (float(unix), int(step) if step else None) if unix else None


def report(message: str) -> None:
    """In a shell's trainer child: one line to the shell (nothing outside a shell). The run folder it names
    (`run <dir>`) is kept, for a line about the shell (`watch_the_shell`)."""
    fd = os.environ.get(SHELL_FD)
    if fd is not None and os.environ.get(ROLE) == "trainer":
        if message.startswith("run "):
            _TOLD["run"] = Path(message[4:])
        try:
            os.write(int(fd), (message + "\n").encode())
        except OSError:
            pass  # the shell is gone: this process dies with it


def watch_the_shell() -> None:
    """In a shell's child (trainer or standby): end the shell if it stops beating
    (`trainer/lifecycle/shell_watch.py`; nothing outside a shell). Once per process."""
    global _WATCHING
    if ROLE in os.environ and not _WATCHING:
        _WATCHING = True
        watch_shell(lambda: os.environ.get(ROLE, ""), lambda: _TOLD.get("run"))


def start_heartbeat() -> None:
    """In a shell's trainer child, once its imports are done: say `alive` to the shell every `HEARTBEAT_S`
    from a daemon thread, so that the shell tells a frozen trainer from a busy or waiting one (nothing
    outside a shell)."""
    if os.environ.get(ROLE) != "trainer" or SHELL_FD not in os.environ:
        return

    def beat() -> None:
        while True:
            report("alive")
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="moevement-heartbeat", daemon=True).start()
