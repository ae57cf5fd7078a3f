"""KL estimators: closed-form values (spec §7.5 vectors) and gradients, including the straight-through kX+."""

import pytest
import torch

from hf_rlloss import KL_TYPES, compute_kl_loss_weight, kl_penalty

DIFF = [0.1, -0.1, 0.5, -0.5, 2.0, -30.0]  # log π_θ − log π_ref
EXPECTED = {
    "k1": DIFF,
    "abs": [abs(d) for d in DIFF],
    "k2": [0.5 * d * d for d in DIFF],
    "k3": [0.0048374180, 0.0051709181, 0.1065306597, 0.1487212707, 1.1353352832, 10.0],
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "k1+": "k1", "k3+": "k3"}


def _eval(kl_type):
    ref = torch.zeros(len(DIFF), dtype=torch.float64)
    lp = torch.tensor(DIFF, dtype=torch.float64, requires_grad=True)
    value = kl_penalty(lp, ref, kl_type)
    (grad,) = torch.autograd.grad(value.sum(), lp)
    return value.detach(), grad


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_values(kl_type):
    value, _ = _eval(kl_type)
    expected = EXPECTED[ALIASES.get(kl_type, kl_type)]
    torch.testing.assert_close(value, torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=1e-8)


@pytest.mark.parametrize(
    "kl_type,expected_grad",
    [
        ("k1", [1.0] * 6),
        ("abs", [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]),
        ("k2", DIFF),
        # k3 = e^Δ − Δ − 1 with Δ = −d: ∂/∂d = 1 − e^−d, zero where a clamp is active (d = −30)
        ("k3", [1 - 2.718281828459045 ** (-d) if d > -20 else 0.0 for d in DIFF[:-1]] + [0.0]),
        ("k1+", DIFF),  # straight-through: the gradient of k2
        ("k3+", DIFF),
    ],
)
def test_gradients(kl_type, expected_grad):
    _, grad = _eval(kl_type)
    if kl_type == "k3":  # d = 2.0 is inside both clamps; check the closed form there too
        expected_grad[4] = 1 - 2.718281828459045**-2.0
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), atol=1e-9, rtol=1e-8)


def test_k3_gradcheck_inside_clamps():
    ref = torch.tensor([0.2, -0.4, 1.0], dtype=torch.float64)
    lp = torch.tensor([0.1, 0.3, -0.5], dtype=torch.float64, requires_grad=True)
    for kl_type in ("k1", "abs", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda x, t=kl_type: kl_penalty(x, ref, t), (lp,))


def test_unknown_type_is_rejected():
    with pytest.raises(ValueError, match="allowed"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_compute_kl_loss_weight():
    labels = torch.tensor([[5, -100, 7], [-100, 1, 2]])
    w = compute_kl_loss_weight(labels, torch.tensor(8), 0.5)
    torch.testing.assert_close(w, torch.tensor([[1 / 16, 0, 1 / 16], [0, 1 / 16, 1 / 16]]))
    torch.testing.assert_close(compute_kl_loss_weight(labels, 4, 1.0, ignore_idx=5)[0], torch.tensor([0, 0.25, 0.25]))


def test_compute_kl_loss_weight_is_the_layers_token_mean_weight():
    # The layer's KL weights (aggregation weights × coefficient, set by build_batches) equal XTuner's helper in
    # token-mean, on every micro-batch of a step; in a sequence mode they differ (per-sequence weights).
    from hf_rlloss import GRPOLossConfig, GRPOLossContext

    labels = [torch.tensor([[1, 2, -100], [3, -100, -100]]), torch.tensor([[1, 1, 1, 2]])]
    for mode in ("token-mean", "seq-mean-token-mean"):
        cfg = GRPOLossConfig(use_kl_loss=True, kl_loss_type="k1", kl_loss_coef=0.3, loss_agg_mode=mode)
        contexts = [
            cfg.build(
                {"shifted_labels": lab, "advantages": torch.ones(lab.shape[0]), "ref_logprobs": torch.zeros(lab.shape)}
            )
            for lab in labels
        ]
        GRPOLossContext.build_batches(contexts)
        for ctx, lab in zip(contexts, labels):
            kwargs = ctx.loss_kwargs
            helper = compute_kl_loss_weight(lab, kwargs.global_grad_tokens, 0.3)
            assert float(kwargs.global_grad_tokens) == 7
            if mode == "token-mean":
                torch.testing.assert_close(kwargs.kl_loss_weight, helper)
            else:
                assert not torch.allclose(kwargs.kl_loss_weight, helper)
