"""Checks shared by the tests of the chunked kernel (`chunked_objective`) against full logits in float64."""

from __future__ import annotations

import torch


def random_head_problem(tokens: int, vocab: int, hidden: int, seed: int = 0, scale: float = 2.0):
    """Float64 hidden states `(tokens, hidden)` × `scale`, an LM head `(vocab, hidden)` and labels `(tokens,)`, with
    the generator they were drawn from (for the test's own objective coefficients)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64) * scale
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, labels, g


def assert_matches_full_logits(via_chunks, naive, h, w) -> tuple[torch.Tensor, torch.Tensor]:
    """`via_chunks(h, w)` equals `naive(h, w)` (autograd through the full logits) in value (1e-12) and in both
    gradients (1e-11 absolute, 1e-10 relative); returns the chunked gradients."""
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    value = via_chunks(hh, ww)
    grads = torch.autograd.grad(value, (hh, ww))
    expected = naive(hh, ww)
    torch.testing.assert_close(value, expected, atol=1e-12, rtol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(expected, (hh, ww))):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-10)
    return grads


def assert_directional_derivatives(fn, h, w, grads, atol: float, rtol: float = 1e-6) -> None:
    """Central finite differences of `fn(h, w)` along 3 random directions equal the directional derivatives from
    `grads` = (∂/∂h, ∂/∂w). `gradcheck` itself cannot be used: it calls backward twice per forward, which the chunked
    function refuses (it hands its precomputed gradients over once)."""
    eps = 1e-6
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        dh, dw = torch.randn(h.shape, generator=g, dtype=h.dtype), torch.randn(w.shape, generator=g, dtype=w.dtype)
        with torch.no_grad():
            numeric = (fn(h + eps * dh, w + eps * dw) - fn(h - eps * dh, w - eps * dw)) / (2 * eps)
        analytic = (grads[0] * dh).sum() + (grads[1] * dw).sum()
        torch.testing.assert_close(numeric, analytic, atol=atol, rtol=rtol)
