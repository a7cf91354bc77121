"""The `recovery step=` console line (docs/design.md §5): one formatter for every strategy, whose bytes the
tests' and benchmarks' parsers read."""

from __future__ import annotations

import re

from benchmarks.ablation import recovery_seconds
from benchmarks.variants import RECOVERY_LINE
from moevement.recovery.report import RecoveryReport, quoted, rank_list, stage_ranges
from tests.test_baselines import RECOVERY as BASELINE_RECOVERY
from tests.test_recovery import RECOVERY as LOCALIZED_RECOVERY


def test_localized_recovery_line():
    report = RecoveryReport(10, rank_list({3, 1}), stage_ranges({5, 0, 1, 2}), 7, 3, 1.23456, 0.1, 0.2049, 0.3)
    line = report.line()
    assert line == (
        "recovery step=10 ranks=1+3 scope=0-2,5 rollback_to=7 replayed=3 seconds=1.235 "
        "(fetch=0.100 convert=0.205 catchup=0.300)"
    )
    assert LOCALIZED_RECOVERY.match(line).groups() == ("10", "1+3", "0-2,5", "7", "3")
    assert RECOVERY_LINE.match(line).groups() == ("1.235", "fetch=0.100 convert=0.205 catchup=0.300")


def test_rejoin_line_puts_the_restart_stages_before_fetch():
    report = RecoveryReport(
        step=9,
        ranks=rank_list([1]),
        scope=stage_ranges([1]),
        rollback_to=4,
        replayed=5,
        seconds=6.0,
        fetch=0.5,
        convert=3.0,
        catchup=1.0,
        restart_seconds="keep=0.250 restart=0.500 setup=0.750",
        fields=("restart=local", quoted("detected_by", ["rank0: SIGTERM", "rank2: gloo error"])),
    )
    line = report.line()
    assert line == (
        "recovery step=9 ranks=1 scope=1 rollback_to=4 replayed=5 seconds=6.000 (keep=0.250 restart=0.500 "
        'setup=0.750 fetch=0.500 convert=3.000 catchup=1.000) restart=local detected_by="rank0: SIGTERM; '
        'rank2: gloo error"'
    )
    assert (
        RECOVERY_LINE.match(line).groups()[1]
        == "keep=0.250 restart=0.500 setup=0.750 fetch=0.500 convert=3.000 catchup=1.000"
    )
    assert re.search(r"^recovery step=9 .* restart=local ", line)
    assert recovery_seconds({"recoveries": [line, line.replace("seconds=6.000", "seconds=8.000")]}) == (7.0, 3.0, 1.0)


def test_baseline_line_with_no_failed_rank_and_lost_tokens():
    fields = ("strategy=moc", quoted("snapshots_from", []), "lost_tokens=12 plt=0.0100 k_pec=2", "restart=global")
    report = RecoveryReport(6, rank_list([]) or "none", "0-0", 4, 2, 0.5, 0.25, 0.0, fields=fields)
    line = report.line()
    assert line == (
        "recovery step=6 ranks=none scope=0-0 rollback_to=4 replayed=2 seconds=0.500 "
        '(fetch=0.250 convert=0.000 catchup=0.000) strategy=moc snapshots_from="" '
        "lost_tokens=12 plt=0.0100 k_pec=2 restart=global"
    )
    found = BASELINE_RECOVERY.match(line).groups()
    assert found == ("6", "none", "0-0", "4", "2", "moc", "", " lost_tokens=12 plt=0.0100 k_pec=2 restart=global")


def test_range_lists():
    assert [stage_ranges(s) for s in ([], [3], [2, 0, 1], [0, 1, 3, 5, 6])] == ["", "3", "0-2", "0-1,3,5-6"]
    assert [rank_list(r) for r in ([], [0], range(4), {7, 2})] == ["", "0", "0+1+2+3", "2+7"]
