"""Tests outside the default suite: the rest of the engine and family matrix, and the slowest launches. They run
with `HF_RLLOSS_FULL_MATRIX=1`; `.ci/run` runs them after the default suite (`-m ci_launch` for the slow launches)."""

import os

import pytest

ENABLED = os.environ.get("HF_RLLOSS_FULL_MATRIX") == "1"


def full_matrix(what: str) -> pytest.MarkDecorator:
    """Skip unless `HF_RLLOSS_FULL_MATRIX=1`, saying what is skipped."""
    return pytest.mark.skipif(not ENABLED, reason=f"{what}: set HF_RLLOSS_FULL_MATRIX=1")


#: The marks of a slow launch kept out of the default suite (which stays near 10 minutes on 2 cores): selected by
#: `.ci/run` with `-m ci_launch`, skipped without `HF_RLLOSS_FULL_MATRIX=1`.
SLOW_LAUNCH = (pytest.mark.ci_launch, full_matrix("a slow launch, run by .ci/run"))


def slow_launch(test):
    """Decorate a test with `SLOW_LAUNCH`."""
    for mark in SLOW_LAUNCH:
        test = mark(test)
    return test
