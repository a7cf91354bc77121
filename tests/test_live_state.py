"""A survivor's live state (`moevement/recovery/live_state.py`): kept and written as the strategy's
`keep_live_state` does (`keep_in_memory`, then `save_kept`), read back bit for bit, and refused (one reason, no
traceback) when it is another run's, not older than this generation, or malformed."""

from __future__ import annotations

import torch

from moevement.recovery.live_state import LIVE, keep_in_memory, load_live_state, save_kept
from moevement.recovery.upstream_log import UpstreamLog
from moevement.storage.host_memory import read_header
from moevement.storage.private_files import write_json_atomic
from tests.helpers import DEBUG_CONFIG, stepped_operators
from trainer.config import load_config

JOB = {"run_id": "run-a", "job": "debug"}


def saved(tmp_path, name: dict | None = None):
    """A rank's state after one step with its upstream log and scalars of iterations 3..5, kept as state_6 with
    the logs from 4 on and saved in `tmp_path`, as `MoEvement.keep_live_state` does; returns copies of the FP32
    master tensors saved."""
    ops, optimizer = stepped_operators(load_config(DEBUG_CONFIG, []))
    log = UpstreamLog([], [], 2)
    for it in (3, 4, 5):
        log.put("act", it, 0, 1, torch.full((2, 3), float(it)))
    scalars = {t: {"lr": 0.1 * t} for t in (3, 4, 5)}
    meta, detected = {**JOB, "rank": 0, **(name or {"attempt": 1})}, {"how": "SIGTERM", "time": 1.5}
    save_kept(tmp_path, keep_in_memory(ops, optimizer, log, scalars, 6, 4, detected, meta))
    masters = {("master", name): t.clone() for op in ops for name, t in op.master_tensors(optimizer)}
    return masters


def test_a_saved_live_state_reads_back_bit_for_bit(tmp_path):
    masters = saved(tmp_path)
    header = read_header(tmp_path / LIVE)
    assert (header["iteration"], header["log_from"]) == (6, 4) and "window_start" not in header
    live, why = load_live_state(tmp_path, JOB, attempt=2)
    assert why == "" and (live.next_iteration, live.log_from) == (6, 4)
    assert live.scalars == {4: {"lr": 0.4}, 5: {"lr": 0.5}}
    assert live.detected["how"] == "SIGTERM" and live.survival() == (6, 4, live.detected)
    logs = {name: t for (role, name), t in live.tensors.items() if role == "log"}
    assert sorted(logs) == ["act.4.0.1", "act.5.0.1"] and torch.equal(logs["act.5.0.1"], torch.full((2, 3), 5.0))
    kept = {key: t for key, t in live.tensors.items() if key[0] == "master"}
    assert kept.keys() == masters.keys()
    assert all(torch.equal(kept[key], masters[key]) for key in masters)


def test_another_run_or_attempt_is_refused(tmp_path):
    saved(tmp_path)
    assert load_live_state(tmp_path, {**JOB, "run_id": "run-b"}, attempt=2) == (
        None,
        f"{tmp_path / LIVE}.json belongs to another run or attempt (run_id)",
    )
    live, why = load_live_state(tmp_path, JOB, attempt=1)  # kept by this very attempt
    assert live is None and why.endswith("(attempt)")
    assert load_live_state(tmp_path / "elsewhere", JOB, attempt=2) == (None, "no live state")


def test_an_older_versions_live_state_naming_its_attempt_generation_is_refused(tmp_path):
    saved(tmp_path, {"generation": 1})
    live, why = load_live_state(tmp_path, JOB, attempt=2)
    assert live is None and why == f"{tmp_path / LIVE}.json belongs to another run or attempt (attempt)"


def test_a_malformed_or_corrupted_live_state_is_refused(tmp_path):
    saved(tmp_path)
    path = tmp_path / LIVE
    header = read_header(path)
    write_json_atomic(path.with_suffix(".json"), {k: v for k, v in header.items() if k != "log_from"})
    live, why = load_live_state(tmp_path, JOB, attempt=2)
    assert live is None and why.startswith(f"{path}: unusable (malformed live state header"), why
    write_json_atomic(path.with_suffix(".json"), header)
    with open(path.with_suffix(".bin"), "r+b") as f:
        f.seek(header["entries"][0]["offset"])
        byte = f.read(1)
        f.seek(header["entries"][0]["offset"])
        f.write(bytes([byte[0] ^ 1]))
    live, why = load_live_state(tmp_path, JOB, attempt=2)
    assert live is None and "checksum mismatch" in why and f"{path}.bin" in why, why
