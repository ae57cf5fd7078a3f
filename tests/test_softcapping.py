"""Final-logit softcapping (Gemma 2's `final_logit_softcapping`) in the chunked path: values and gradients against
full logits ``c·tanh(z/c)/T`` in float64, the half path against float64, and the loss-config field (issue 12,
item 6). Parity with stock TRL on a tiny Gemma 2: tests/test_trl_parity.py::test_gemma2_softcapping."""

import pytest
import torch
from _chunked import assert_directional_derivatives, assert_matches_full_logits, random_head_problem
from pydantic import ValidationError

from hf_rlloss import GRPOLossConfig, chunked_kept_logmass, chunked_logprobs, chunked_objective

CAP, TEMP = 5.0, 0.7


def _problem(tokens=23, vocab=40, hidden=6, seed=0, scale=2.0):
    # logits of std ≈ 5·scale: tanh(z/c) is far from linear, so a missing 1 − t² factor would show
    h, w, labels, g = random_head_problem(tokens, vocab, hidden, seed, scale)
    coef = torch.randn(tokens, generator=g, dtype=torch.float64)

    def objective(lp, sl, entropy):
        lp = lp.double()
        return (coef[sl] * lp + 0.3 * lp.square()).sum(), {}

    return h, w, labels, objective


def _full_log_probs(h, w, cap=CAP, temperature=TEMP):
    """`(N, V)` log-probs as transformers' Gemma 2 (softcap) then TRL (temperature) compute them."""
    return torch.log_softmax(cap * torch.tanh((h @ w.t()) / cap) / temperature, dim=-1)


def _naive_objective(h, w, labels, objective):
    lp = _full_log_probs(h, w).gather(-1, labels[:, None]).squeeze(-1)
    return objective(lp, slice(None), None)[0]


def test_logprobs_entropy_and_kept_mass_match_full_logits():
    h, w, labels, _ = _problem()
    log_p = _full_log_probs(h, w)
    lp, entropy = chunked_logprobs(h, w, labels, temperature=TEMP, chunk_size=5, with_entropy=True, softcap=CAP)
    torch.testing.assert_close(lp, log_p.gather(-1, labels[:, None]).squeeze(-1), atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1), atol=1e-12, rtol=0)
    # the softcap changes the distribution (the test is not vacuous)
    plain, _ = chunked_logprobs(h, w, labels, temperature=TEMP, chunk_size=5)
    assert float((plain - lp).abs().max()) > 0.5

    def top_k(_, scores, k=5):  # keep the 5 highest scores, as TopKLogitsWarper
        threshold = scores.topk(k, dim=-1).values[:, -1:]
        return scores.masked_fill(scores < threshold, -float("inf"))

    lp_k, kept = chunked_kept_logmass(h, w, labels, top_k, temperature=TEMP, chunk_size=5, softcap=CAP)
    torch.testing.assert_close(lp_k, lp, atol=1e-12, rtol=0)
    scaled = CAP * torch.tanh((h @ w.t()) / CAP) / TEMP
    torch.testing.assert_close(kept, torch.logsumexp(top_k(None, scaled), -1) - torch.logsumexp(scaled, -1))


@pytest.mark.parametrize("compile_epilogue", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_objective_and_gradients_match_full_logits_float64(compile_epilogue):
    """Value and both gradients equal autograd through full softcapped logits; directional finite differences
    (gradcheck itself backs through twice, which the chunked function refuses) confirm the 1 − tanh² factor."""
    h, w, labels, objective = _problem()

    def via_chunks(h, w):
        return chunked_objective(
            h, w, labels, objective, temperature=TEMP, chunk_size=5, softcap=CAP, compile_epilogue=compile_epilogue
        )[0]

    grads = assert_matches_full_logits(via_chunks, lambda h, w: _naive_objective(h, w, labels, objective), h, w)
    if compile_epilogue:
        return
    assert_directional_derivatives(via_chunks, h, w, grads, atol=1e-6)


def test_half_path_matches_float64():
    """bf16 GEMMs with softcapping: the error bound of the unsoftcapped half path (|Δ log π| ≤ 2⁻⁸·max|logit|, here
    max |c·tanh/T| ≤ c/T) and gradients within the half path's relative tolerance."""
    h, w, labels, objective = _problem(tokens=96, vocab=512, hidden=32, scale=1.0)
    ref_h, ref_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref_value, _ = chunked_objective(ref_h, ref_w, labels, objective, temperature=TEMP, chunk_size=40, softcap=CAP)
    ref_value.backward()
    ref_lp, _ = chunked_logprobs(h, w, labels, temperature=TEMP, softcap=CAP)
    hb, wb = h.bfloat16().requires_grad_(True), w.bfloat16().requires_grad_(True)
    value, _ = chunked_objective(
        hb, wb, labels, objective, temperature=TEMP, chunk_size=40, softcap=CAP, compile_epilogue=False
    )
    value.backward()
    lp, _ = chunked_logprobs(hb.detach(), wb.detach(), labels, temperature=TEMP, softcap=CAP, compile_epilogue=False)
    assert lp.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16
    # the bf16 inputs themselves are rounded: compare with float64 on the rounded inputs for the kernel's own error
    exact_lp, _ = chunked_logprobs(hb.detach().double(), wb.detach().double(), labels, temperature=TEMP, softcap=CAP)
    assert float((lp.double() - exact_lp).abs().max()) < 2**-8 * CAP / TEMP
    assert float((lp.double() - ref_lp).abs().max()) < 0.2  # and the inputs' rounding on top stays small
    exact_h, exact_w = hb.detach().double().requires_grad_(True), wb.detach().double().requires_grad_(True)
    exact, _ = chunked_objective(exact_h, exact_w, labels, objective, temperature=TEMP, chunk_size=40, softcap=CAP)
    exact.backward()
    assert abs(float(value) - float(exact)) < 1e-3 * abs(float(exact))
    for grad, ref in ((hb.grad, exact_h.grad), (wb.grad, exact_w.grad)):
        assert float((grad.double() - ref).norm() / ref.norm()) < 1e-2


def test_config_field_and_context_path():
    assert GRPOLossConfig().logit_softcapping is None
    for bad in (0.0, -30.0, float("inf")):
        with pytest.raises(ValidationError, match="logit_softcapping"):
            GRPOLossConfig(logit_softcapping=bad)
    # the context's hidden-state path softcaps; the log-prob path is given log-probs already softcapped
    h, w, labels, _ = _problem(tokens=8, vocab=30)
    cfg = GRPOLossConfig(logit_softcapping=CAP, chunk_size=3)
    data = {"shifted_labels": labels.reshape(2, 4), "advantages": torch.tensor([1.0, -0.5])}
    losses = []
    for inputs in ("hidden", "logprobs"):
        ctx = cfg.build(data)
        type(ctx).build_batches([ctx])
        ww = w.clone().requires_grad_(True)
        if inputs == "hidden":
            loss, _ = ctx(hidden_states=h.reshape(2, 4, -1), head_weight=ww, temperature=TEMP)
        else:
            lp = _full_log_probs(h, ww).gather(-1, labels[:, None]).squeeze(-1).reshape(2, 4)
            loss, _ = ctx(logprobs=lp)
        losses.append((loss.detach(), torch.autograd.grad(loss, ww)[0]))
    torch.testing.assert_close(losses[0], losses[1])
