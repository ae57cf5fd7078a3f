"""The default test suite: its size and time (`benchmarks/tools/suite_time.py`)."""

from __future__ import annotations

from .core import figure

SUITE = "test_suite.json"


@figure("suite.passed")
def passed(r) -> str:
    return str(r(SUITE)["counts"]["passed"])


@figure("suite.minutes")
def minutes(r) -> str:
    return f"{r(SUITE)['pytest_s'] / 60:.1f} min"


@figure("suite.wall_minutes")
def wall_minutes(r) -> str:
    return f"{r(SUITE)['wall_s'] / 60:.1f} min"


@figure("suite.machine")
def machine(r) -> str:
    meta = r(SUITE)["meta"]
    return f"{meta['machine']['kind']}, {meta['date']}"
