"""Rollout log-probs under truncated sampling: the HF-generate recorder and the trainer's replay of the truncation,
against log-softmax over the full vocabulary (closed form, float64)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_rlloss.loss.chunked_logprobs import chunked_kept_logmass
from hf_rlloss.trainer.common.rollout_recording import SampledTokenLogprobs

TRUNCATIONS = {
    "none": [],
    "top_k": [TopKLogitsWarper(top_k=5)],
    "top_p": [TopPLogitsWarper(top_p=0.7)],
    "min_p": [MinPLogitsWarper(min_p=0.05)],
    "top_k+top_p+min_p": [TopKLogitsWarper(top_k=12), TopPLogitsWarper(top_p=0.9), MinPLogitsWarper(min_p=0.02)],
}


def _kept_mask(logits: torch.Tensor, warpers: list) -> torch.Tensor:
    return torch.isfinite(LogitsProcessorList(warpers)(None, logits.clone()))


@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_recorder_gives_full_vocabulary_logprobs_and_kept_mass(name):
    """Processors before the truncation (a penalty, the temperature) shape the recorded distribution; the truncation
    only sets the kept mass: log p = log_softmax(penalized z / T), log K = log Σ_{v kept} p(v)."""
    torch.manual_seed(0)
    batch, vocab, steps, temperature = 3, 40, 4, 0.7
    recorder = SampledTokenLogprobs()
    processors = recorder.install(
        LogitsProcessorList(
            [RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(temperature), *TRUNCATIONS[name]]
        )
    )
    assert processors[-1] is recorder
    if TRUNCATIONS[name]:
        assert processors[2] is recorder.before_truncation  # right after the temperature
    ids = torch.randint(0, vocab, (batch, 2))
    expected_logps, expected_kept = [], []
    for _ in range(steps):
        scores = torch.randn(batch, vocab)
        penalized = RepetitionPenaltyLogitsProcessor(1.3)(ids, scores.clone()) / temperature
        full = torch.log_softmax(penalized.double(), dim=-1)
        kept = _kept_mask(penalized, TRUNCATIONS[name])
        final = processors(ids, scores.clone())
        token = torch.multinomial(torch.softmax(final, dim=-1), 1)  # sampled from the truncated distribution
        expected_logps.append(full.gather(-1, token).squeeze(-1))
        expected_kept.append(torch.logsumexp(full.masked_fill(~kept, float("-inf")), dim=-1))
        ids = torch.cat([ids, token], dim=1)
    logps, kept_logmass = recorder.finish(ids[:, -1])
    assert logps.shape == kept_logmass.shape == (batch, steps)
    torch.testing.assert_close(logps.double(), torch.stack(expected_logps, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(kept_logmass.double(), torch.stack(expected_kept, 1), atol=1e-5, rtol=0)
    if name == "none":
        assert kept_logmass.abs().max() < 1e-6
    else:
        assert (kept_logmass < -1e-4).all()


@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_replayed_kept_logmass_equals_full_logits(name):
    torch.manual_seed(1)
    n, hidden_size, vocab, temperature = 150, 8, 50, 0.8  # 150 tokens: several chunks and 64-row blocks
    hidden = torch.randn(n, hidden_size, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64)
    labels = torch.randint(0, vocab, (n,))
    truncation = LogitsProcessorList(TRUNCATIONS[name])
    logps, kept_logmass = chunked_kept_logmass(
        hidden, weight, labels, truncation, temperature=temperature, chunk_size=96
    )
    logits = hidden @ weight.t() / temperature
    full = torch.log_softmax(logits, dim=-1)
    kept = _kept_mask(logits, TRUNCATIONS[name])
    torch.testing.assert_close(logps, full.gather(-1, labels[:, None]).squeeze(-1), atol=1e-12, rtol=0)
    expected = torch.logsumexp(full.masked_fill(~kept, float("-inf")), dim=-1)
    torch.testing.assert_close(kept_logmass, expected, atol=1e-12, rtol=0)
