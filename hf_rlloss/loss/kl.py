"""KL-to-reference estimators, per token, on the sampled tokens.

With ``Δ = log π_ref − log π_θ`` (tokens sampled from π_θ), following Schulman's "Approximating KL Divergence"
(http://joschu.net/blog/kl-approx.html) and verl's ``kl_penalty``:

| name | value | note |
|---|---|---|
| ``kl`` / ``k1`` | ``−Δ`` | unbiased, high variance, can be negative |
| ``abs`` | ``|Δ|`` | |
| ``mse`` / ``k2`` | ``½Δ²`` | its gradient is the on-policy gradient of KL(π_θ‖π_ref) |
| ``low_var_kl`` / ``k3`` | ``e^Δ − Δ − 1`` | unbiased, ≥ 0; Δ clamped to ±20 and the result to ±10 (as verl) |
| ``k1+`` / ``k3+`` | value of k1/k3, gradient of k2 | straight-through: ``k2 − sg(k2) + sg(kX)`` |
"""

from __future__ import annotations

import torch

KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+")

_DELTA_CLAMP = 20.0
_K3_CLAMP = 10.0


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    delta = (-log_ratio).clamp(-_DELTA_CLAMP, _DELTA_CLAMP)
    return (delta.exp() - delta - 1).clamp(-_K3_CLAMP, _K3_CLAMP)


_ESTIMATORS = {
    "kl": _k1,
    "k1": _k1,
    "abs": lambda log_ratio: log_ratio.abs(),
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate between the current policy and the reference.

    Args:
        logprobs (`torch.Tensor`): log π_θ of the sampled tokens, any shape; carries the gradient.
        ref_logprobs (`torch.Tensor`): log π_ref of the same tokens, same shape; treated as a constant.
        kl_type (`str`): one of `KL_TYPES`.

    Returns:
        `torch.Tensor`: the estimate, same shape as `logprobs`.
    """
    log_ratio = logprobs - ref_logprobs.detach()  # log π_θ − log π_ref = −Δ
    if kl_type.endswith("+"):
        base = kl_type[:-1]
        if base not in _ESTIMATORS:
            raise ValueError(f"kl_type={kl_type!r}: unknown estimator; allowed: {', '.join(KL_TYPES)}")
        k2 = _k2(log_ratio)
        return k2 - k2.detach() + _ESTIMATORS[base](log_ratio).detach()
    if kl_type not in _ESTIMATORS:
        raise ValueError(f"kl_type={kl_type!r}: unknown estimator; allowed: {', '.join(KL_TYPES)}")
    return _ESTIMATORS[kl_type](log_ratio)


def compute_kl_loss_weight(
    shifted_labels: torch.Tensor, global_grad_tokens: torch.Tensor | float, kl_loss_coef: float, ignore_idx: int = -100
) -> torch.Tensor:
    """Token-mean KL weights: ``kl_loss_coef / global_grad_tokens`` at valid labels, 0 at ``ignore_idx``.

    XTuner's helper, kept as part of its API. The loss layer does not call it: `GRPOLossContext.build_batches` sets
    every micro-batch's `kl_loss_weight` to ``aggregation_weights(...) × kl_loss_coef`` (`hf_rlloss.loss.aggregation`),
    the KL sharing the policy loss's aggregation. With ``loss_agg_mode="token-mean"`` that is ``m / N × coef``,
    exactly this function's weights (`tests/test_kl.py::test_compute_kl_loss_weight_is_the_layers_token_mean_weight`);
    in the sequence modes the layer's weights are ``m / (n_i·S)``, ``m / S`` or ``m / (S·C)`` times the coefficient
    (``n_i`` the tokens of a token's sequence, ``S`` the step's sequences, ``C`` = `loss_scale_factor`), which this
    function does not compute.

    Args:
        shifted_labels (`torch.Tensor`): `(B, T)` labels.
        global_grad_tokens (`torch.Tensor` or `float`): valid tokens of the whole optimizer step, all ranks.
        kl_loss_coef (`float`): the KL coefficient.
        ignore_idx (`int`, *optional*, defaults to `-100`): label of positions without loss.

    Returns:
        `torch.Tensor`: float32 weights with the labels' shape.
    """
    valid = (shifted_labels != ignore_idx).to(torch.float32)
    return valid * (kl_loss_coef / torch.as_tensor(global_grad_tokens, dtype=torch.float32).clamp(min=1.0))
