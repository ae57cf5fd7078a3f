"""The gradient-fidelity diagnostic against exact expectations on a policy small enough to enumerate every completion
(`benchmarks/experiments/gradient_fidelity_exact.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.experiments import gradient_fidelity_exact as exact

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy():
    return exact.tiny_policy(0)


def test_every_completion_is_enumerated_once_with_its_probability(policy):
    e = exact.Enumeration(policy, exact.perturbed(policy, 1, 0.15), exact.perturbed(policy, 2, 0.3), sketch_dim=256)
    assert len(e.completions) == len({tuple(c) for c in e.completions}) == 7
    for key, p in e.prob.items():
        assert p.sum() == pytest.approx(1.0, abs=1e-6), key
        assert e.tuple_prob[key].sum() == pytest.approx(1.0, abs=1e-6), key


def test_without_staleness_every_correction_is_exactly_unbiased(policy):
    """The behaviour policy is the policy: every IS weight is 1, each correction's expected gradient is the
    on-policy one, and the exact relative bias is 0."""
    e = exact.Enumeration(policy, policy, exact.perturbed(policy, 2, 0.3), sketch_dim=256)
    for prompt in range(len(exact.PROMPTS)):
        on = e.tuple_prob[(prompt, "on")] @ e.group_vectors(prompt, "on")[:, 0]
        stale = np.einsum("t,tnk->nk", e.tuple_prob[(prompt, "stale")], e.group_vectors(prompt, "stale"))
        for k, name in enumerate(exact.NAMES):
            assert exact.relative_bias(stale[k], on) < 1e-6, name


def test_the_diagnostics_intervals_hold_the_exact_relative_biases(policy):
    """B, C and sequence IS: the diagnostic's estimate from sampled groups (four on-policy, two stale per prompt, as
    it measures them) brackets the exact relative bias of each, at a staleness where they differ."""
    e = exact.Enumeration(policy, exact.perturbed(policy, 1, 0.15), exact.perturbed(policy, 2, 0.3), sketch_dim=1024)
    result = exact.agreement(e, replicates=300, seed=0, resamples=2000)["corrections"]
    for name, entry in result.items():
        assert entry["ci_low"] <= entry["exact"] <= entry["ci_high"], (name, entry)
    assert result["token_tis"]["exact"] < result["none"]["exact"] < result["sequence_tis"]["exact"]
