"""Accuracy under failures (eval/accuracy_under_failure.py): fault schedule, parsing, table, plot, end to end.

The end-to-end case trains none / moevement / moc (pp=2, 12 iterations, failures at 5 and 10)
under torchrun and scores 30 PIQA items per checkpoint: MoEvement's checkpoint gives the
fault-free PIQA results (acc, acc_norm and every per-item log-likelihood) and state digest
exactly; MoC's validation loss and digest differ (Gemini's exactness is tested in test_baselines).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from eval import accuracy_under_failure as acc
from tests.helpers import CHILD_ENV, DEBUG_CONFIG, ROOT, recoveries
from trainer.event_writer import append_event
from trainer.records.accounting_line import AccountingLine
from trainer.records.event_lines import FinalLine, StepLine, ValidationLine

STRATEGY_LINE = re.compile(
    r"^strategy=(\w+) val_loss=(\S+) piqa_acc=(\S+) piqa_acc_norm=(\S+) "
    r"digest_equal=(true|false)$",
    re.M,
)


def test_fault_schedule_every_k_iterations_alternating_ranks():
    assert acc.fault_schedule(12, 5, 2) == [(5, 1), (10, 0)]
    assert acc.fault_schedule(20, 4, 2) == [(4, 1), (8, 0), (12, 1), (16, 0)]
    assert acc.fault_schedule(10, 5, 2) == [(5, 1)]  # only iterations before the last
    assert acc.fault_schedule(5, 5, 2) == []
    assert [r for _, r in acc.fault_schedule(12, 2, 4)] == [3, 2, 1, 0, 3]  # wraps around
    assert acc.fault_flag(acc.fault_schedule(12, 5, 2)) == "5:1,10:0"
    assert acc.fault_flags([(5, 1), (10, 0)], "wipe") == ["--fault.at", "5:1,10:0"]
    assert acc.fault_flags([(5, 1), (10, 0)], "kill") == ["--fault.kill", "5:1:backward,10:0:backward"]
    with pytest.raises(acc.RunError, match="fail-every"):
        acc.fault_schedule(12, 0, 2)


def test_arguments_defaults_and_errors(capsys):
    args, extra = acc.parse_args(
        [
            "--config",
            DEBUG_CONFIG,
            "--steps",
            "12",
            "--fail-every",
            "5",
            "--strategies",
            "moc,moevement",
            "--checkpoint.interval",
            "2",
        ]
    )
    assert args.val_every == 2 and args.pp == 2 and extra == ["--checkpoint.interval", "2"]
    strategies, schedule = acc.check_args(args, extra)
    assert strategies == ["none", "moc", "moevement"] and schedule == [(5, 1), (10, 0)] and args.world == 2
    base = ["--config", DEBUG_CONFIG, "--steps", "12", "--fail-every", "5"]
    for extra_args, message in [
        (["--fail-every", "12"], "leaves no failure"),
        (["--strategies", "none,foo"], "unknown foo"),
        (["--fault.at", "3:1"], "--fault.at is set by this tool: use --fail-every"),
        (["--fault.kill", "3:1"], "--fault.kill is set by this tool: use --fail-every"),
        (["--checkpoint.interval", "often"], "checkpoint.interval"),
        (["--pp", "4"], "parallelism.pp"),
    ]:
        assert acc.main([*base, *extra_args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_parse_training_keeps_the_rerun_validation_and_builds_table_and_plot(tmp_path):
    for event in [
        StepLine(1, (("loss", 5.0),)),
        ValidationLine(2, 4.5),
        ValidationLine(4, 4.2),
        ValidationLine(4, 4.25),  # run again after a rollback
        ValidationLine(6, 4.0),
        AccountingLine(4.5, 6, 3.0, 0.5, 1.0, 0.0, 1, 2, 2.0, 123, 1.0, 0.0),
        FinalLine(6, 3.9, "ab" * 32),
    ]:
        append_event(tmp_path, event)
    run = acc.parse_training(f"run: {tmp_path}\n", "moc")
    assert run["val"] == {2: 4.5, 4: 4.25, 6: 4.0}  # the record after the rollback wins
    assert (run["failures"], run["lost_tokens"], run["train_loss"], run["digest"]) == (1, 123, 3.9, "ab" * 32)
    with pytest.raises(acc.RunError, match="no 'final'"):
        acc.parse_training(f"run: {tmp_path / 'none'}\n", "moc")
    ref = {
        **run,
        "val": {2: 4.5, 4: 4.2, 6: 3.95},
        "failures": 0,
        "lost_tokens": 0,
        "acc": 0.5,
        "acc_norm": 0.52,
        "items": 2,
        "digest_equal": True,
        "lls_differ": 0,
    }
    rows = {
        "none": ref,
        "moc": {**run, "acc": 0.5, "acc_norm": 0.5, "items": 2, "digest_equal": False, "lls_differ": 2},
    }
    table = acc.markdown_table(rows, 6).splitlines()
    assert table[0].startswith("| strategy | failures | final train loss | val loss (step 6) | PIQA acc |")
    assert table[2] == "| none | 0 | 3.900000 | 3.950000 | 0.5000 | 0.5200 | yes | yes | 0 |"
    assert table[3] == "| moc | 1 | 3.900000 | 4.000000 | 0.5000 | 0.5000 | no | no (2/2 items differ) | 123 |"
    acc.plot(tmp_path / "val_loss.png", rows, [(5, 1)])
    assert (tmp_path / "val_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_moevement_checkpoint_scores_like_fault_free_and_moc_does_not(tmp_path):
    out = tmp_path / "accuracy"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "eval.accuracy_under_failure",
            "--config",
            DEBUG_CONFIG,
            "--steps",
            "12",
            "--fail-every",
            "5",
            "--val-every",
            "2",
            "--limit",
            "30",
            "--out",
            str(out),
            "--strategies",
            "moevement,moc",
            "--checkpoint.interval",
            "2",
            "--checkpoint.moc_experts",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=CHILD_ENV,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = {m[1]: m for m in STRATEGY_LINE.finditer(proc.stdout)}
    assert list(lines) == ["none", "moevement", "moc"]
    assert [f"[{i}/3] {s}: trained in" in proc.stdout for i, s in enumerate(lines, 1)] == [True] * 3
    rows = json.loads((out / "accuracy.json").read_text())["rows"]
    none, moev, moc = (rows[s] for s in ("none", "moevement", "moc"))
    assert json.loads((out / "accuracy.json").read_text())["schedule"] == [[5, 1], [10, 0]]
    log = (out / "moevement" / "train.log").read_text()
    assert [(r.step, r.ranks) for r in recoveries(log)] == [(5, (1,)), (10, (0,))]

    lls = {s: json.loads((out / s / "piqa_loglikelihoods.json").read_text()) for s in rows}
    assert len(lls["none"]) == 30 and all(len(pair) == 2 for pair in lls["none"])
    # exact recovery: same trajectory, same model, same scores, bit for bit
    assert moev["failures"] == 2 and moev["digest"] == none["digest"] and moev["digest_equal"]
    assert moev["val"] == none["val"] and moev["train_loss"] == none["train_loss"]
    assert (moev["acc"], moev["acc_norm"]) == (none["acc"], none["acc_norm"]) and moev["lls_differ"] == 0
    assert lls["moevement"] == lls["none"]
    assert lines["moevement"].groups()[1:] == lines["none"].groups()[1:]

    assert moc["failures"] == 2 and moc["lost_tokens"] > 0 and not moc["digest_equal"]
    assert moc["val"]["12"] != none["val"]["12"] and lines["moc"][5] == "false"
    assert lls["moc"] != lls["none"]

    table = (out / "accuracy.md").read_text()
    assert "| strategy | failures | final train loss | val loss (step 12) |" in table
    assert re.search(r"^\| moevement \| 2 \| .* \| yes \| yes \| 0 \|$", table, re.M)
    assert re.search(r"^\| moc \| 2 \| .* \| no \| no \(\d+/30 items differ\) \| [1-9]\d* \|$", table, re.M)
    assert (out / "val_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "moevement" / "checkpoint" / "meta.json").is_file()
