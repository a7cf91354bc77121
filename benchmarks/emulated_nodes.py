"""Nodes emulated on one machine: torchrun agents of one elastic job (c10d rendezvous on localhost), each
starting its own workers, as `torchrun --nnodes MIN:MAX` does on a cluster.

A node is lost for good by SIGKILLing its agent and every one of its workers at once (`Node.lose`); it
comes back by starting its agent again. The rendezvous settings make a lost node's absence known within
seconds (`RDZV_CONF`): a node whose agent said nothing for 3 s is dropped from the next round, and a round
closes 3 s after its smallest size joined. What every node's processes print is gathered in one `Output`,
in arrival order, each line prefixed by nothing: rank 0 may live on either node.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from trainer.records.event_log import RunEvent, run_events

ROOT = Path(__file__).resolve().parent.parent
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=180"
# torch 2.13's agents share the rank-0 agent's rendezvous store with its workers and publish that store's
# address in their first round only: a node joining a later round (one that comes back) waits for it for
# ever. The documented opt-out gives every round's workers a store of their own.
GROWABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass
class Output:
    """Every line the job's nodes printed, in arrival order (appended by one reader thread per node)."""

    lines: list[str] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def add(self, line: str) -> None:
        with self.arrived:
            self.lines.append(line)
            self.arrived.notify_all()

    def text(self) -> str:
        with self.arrived:
            return "".join(self.lines)

    def wait_for(self, pattern: str, after: int = 0, timeout_s: float = 300) -> tuple[re.Match, int]:
        """The first line from index `after` on matching `pattern` (regex, from the line's start), and the
        index after it; AssertionError with everything printed once `timeout_s` passed."""
        regex, deadline, i = re.compile(pattern), time.monotonic() + timeout_s, after
        with self.arrived:
            while True:
                while i < len(self.lines):
                    match = regex.match(self.lines[i])
                    i += 1
                    if match:
                        return match, i
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s:\n{''.join(self.lines)}")
                self.arrived.wait(left)

    def wait_for_record(self, found: Callable[[RunEvent], bool], timeout_s: float = 300) -> int:
        """Wait until the job's run record (the folders its `run: <dir>` lines name) holds an event that
        `found` accepts; the number of lines read by then (an index for `wait_for`). AssertionError with
        everything printed once `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.arrived:
                printed = len(self.lines)
            with suppress(ValueError):  # a line being appended as it is read: read again
                if any(found(event) for event in run_events(self.text(), ROOT)):
                    return printed
            if time.monotonic() > deadline:
                raise AssertionError(f"no such record within {timeout_s} s:\n{self.text()}")
            time.sleep(0.2)


@dataclass
class Node:
    """One emulated node: its torchrun agent (a session of its own) and the thread reading its output."""

    index: int
    proc: subprocess.Popen
    reader: threading.Thread

    def lose(self) -> None:
        """The node is lost for good: its agent and every worker SIGKILLed at once."""
        kill_all(process_tree(self.proc.pid))
        self.proc.wait(timeout=60)
        self.reader.join(timeout=60)

    def wait(self, timeout_s: float) -> int:
        """The agent's exit status once it ends (AssertionError, the node killed, after `timeout_s`)."""
        try:
            status = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.lose()
            raise AssertionError(f"node {self.index} still running after {timeout_s} s") from None
        self.reader.join(timeout=60)
        return status


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(
    index: int,
    port: int,
    job_id: str,
    nproc: int,
    train_args: list[str],
    env: dict[str, str],
    output: Output,
    min_nodes: int = 1,
) -> Node:
    """Node `index`'s agent for the job `job_id` (node 0 hosts the rendezvous store on `port`), running
    `train.py train_args` in `nproc` workers, its output added to `output`; the job runs on `min_nodes` of
    its 2 nodes or more (2: a lost node's survivors wait in the rendezvous until it is back).

    Node 0 holds the lowest ranks, rank 0 among them, in every round: the rendezvous orders nodes by their
    address first, and node 0 gives its agent the address 127.0.0.1, any other node `localhost`."""
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{min_nodes}:2", f"--nproc-per-node={nproc}"),
        *("--max-restarts", "3", "--monitor-interval", "0.5", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", job_id),
        *("--rdzv-conf", f"is_host={int(index == 0)},{RDZV_CONF}"),
        *("--local-addr", "127.0.0.1" if index == 0 else "localhost"),
        *("train.py", *train_args),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**env, **GROWABLE},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )

    def read() -> None:
        for line in proc.stdout:
            output.add(line)

    reader = threading.Thread(target=read, name=f"node{index}-output", daemon=True)
    reader.start()
    return Node(index, proc, reader)


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (torchrun starts each worker in a session of its own)."""
    tree, i = [pid], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").glob("*"):
            with suppress(OSError):
                tree += [int(c) for c in (task / "children").read_text().split()]
        i += 1
    return tree


def kill_all(pids: list[int]) -> None:
    """SIGKILL every process of `pids` at once and wait until none of them runs any more."""
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
