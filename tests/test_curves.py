"""The demo's training-curve panels: what moves, non-negative mismatch, a moving average on the reward."""

from __future__ import annotations

import pytest

from hf_rlloss.recipe_support.callbacks import CURVES, SMOOTHED, logged_panels, moving_average, plot_curves


def test_moving_average_is_trailing():
    assert moving_average([1.0, 2.0, 3.0, 4.0, 10.0], 2) == pytest.approx([1.0, 1.5, 2.5, 3.5, 7.0])
    assert moving_average([2.0, 4.0], 8) == pytest.approx([2.0, 3.0])  # fewer values than the window at the start


def test_panels_plot_what_moves_and_a_non_negative_mismatch(tmp_path):
    keys = [key for panel in CURVES.values() for key in panel]
    assert "completions/mean_length" in keys and "reward" in SMOOTHED
    assert not any("clip_frac" in key for key in keys)  # flat zero on-policy
    assert "mismatch/mismatch_kl" not in keys  # the k1 estimate goes negative
    history = [
        {"step": s, "reward": 0.1 * s, "completions/mean_length": 20 - s, "mismatch/mismatch_logprob_abs_diff": 0.01}
        for s in range(1, 11)
    ]
    path = plot_curves(history, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and path.endswith("curves.png")


def test_a_panel_nobody_logs_is_left_out(tmp_path):
    """The asynchronous trainer logs no completion length: its plot has three panels, none of them empty."""
    history = [
        {"step": s, "reward": 0.1 * s, "train_policy/kl3": 0.01, "completions/mean_length": float("nan")}
        for s in (1, 2)
    ]
    assert list(logged_panels(history)) == ["reward", "KL to reference / old policy"]
    history[0]["mismatch/mismatch_logprob_abs_diff"] = 0.02
    assert len(logged_panels(history)) == 3
    assert plot_curves(history, str(tmp_path / "three.png")) and (tmp_path / "three.png").stat().st_size > 10_000
