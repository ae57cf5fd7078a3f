"""Pinned outputs (`benchmarks/shared/pins.py`): each pin's case gives its recorded outputs at the checkout, and a
results file is vouched for only where every path changed since its commit is covered by a pin verified at that
commit, and never for a timed benchmark."""

from __future__ import annotations

import pytest

from benchmarks.figures import _age
from benchmarks.shared import pin_cases, pins


@pytest.mark.parametrize("case", sorted(pins.load_pins()))
def test_each_pinned_case_gives_its_recorded_outputs_at_the_checkout(case):
    pin = pins.load_pins()[case]
    assert pin["case"] == case and pin["verified_at"] and pin["measures"]
    assert pin_cases.CASES[case]() == pin["outputs"], (
        f"the outputs pinned in benchmarks/shared/pins/{case}.json changed: the results files it vouched for are "
        f"stale again; re-pin with `python -m benchmarks.tools.pin_outputs {case}` once the change is meant"
    )


PIN = {"case": "loss_layer", "measures": ["hf_rlloss/loss"], "verified_at": ["abc1234"], "outputs": {}}
FAKE = {"loss_layer": PIN}
EXPERIMENT = ["benchmarks/experiments/demo_seeds.py"]


def test_a_pin_vouches_for_covered_changes_at_a_verified_commit_only(monkeypatch):
    monkeypatch.setattr(pins, "changed_paths", lambda commit, modules: ("hf_rlloss/loss/kl.py",))
    assert pins.vouching("abc1234def", ("hf_rlloss",), EXPERIMENT, FAKE) == ["loss_layer"]
    assert pins.vouching("0123456", ("hf_rlloss",), EXPERIMENT, FAKE) == []  # not verified at that commit
    timed = ["benchmarks/performance/loss_step.py"]
    assert pins.vouching("abc1234", ("hf_rlloss/loss",), timed, FAKE) == []  # the same outputs say nothing of time
    assert pins.vouching("abc1234", ("hf_rlloss",), [], FAKE) == []  # no script: nothing known of what it measures
    changed = ("hf_rlloss/loss/kl.py", "hf_rlloss/trainer/grpo_trainer.py")
    monkeypatch.setattr(pins, "changed_paths", lambda commit, modules: changed)
    assert pins.vouching("abc1234", ("hf_rlloss",), EXPERIMENT, FAKE) == []  # a change the pin does not cover


def test_a_vouched_results_file_is_current_and_its_source_line_says_why(monkeypatch):
    monkeypatch.setattr(_age, "changed_since", lambda commit, modules: ("f00",))
    monkeypatch.setattr(pins, "changed_paths", lambda commit, modules: ("hf_rlloss/loss/kl.py",))
    command = "python -m benchmarks.experiments.demo_seeds"
    meta = {"git_commit": "abc1234", "command": command, "measures": ["hf_rlloss"]}
    monkeypatch.setattr(pins, "load_pins", lambda: FAKE)
    words, stale = _age.age(meta)
    assert not stale and "the measured code changed since, its outputs on the recorded inputs did not" in words
    assert "`benchmarks/shared/pins/loss_layer.json`" in words
    monkeypatch.setattr(pins, "load_pins", lambda: {})
    assert _age.age(meta) == ("measured at `abc1234`; the measured code changed since", True)
