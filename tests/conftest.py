"""pytest's hooks for the suite: `--runslow`, and the removal of the suite's run records at the end. What the
tests share is in tests/helpers.py (and tests/tiny_moe.py)."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import RUN_OUTPUTS


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow multi-process tests")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(RUN_OUTPUTS, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
