"""Closed-form values and gradients of every policy loss, on hand-made tensors."""

import math

import pytest
import torch

from hf_rlloss import GRPOLossConfig, GRPOLossContext, PolicyLossConfig, get_policy_loss, register_policy_loss


def _run(loss_type, log_ratio, advantages, logprobs=None, **cfg):
    pcfg = PolicyLossConfig(loss_type=loss_type, **cfg)
    log_ratio = torch.tensor(log_ratio, dtype=torch.float64)
    old = torch.zeros_like(log_ratio) if logprobs is None else torch.tensor(logprobs, dtype=torch.float64) - log_ratio
    lp = (old + log_ratio).requires_grad_(True)
    adv = torch.tensor(advantages, dtype=torch.float64)
    spec = pcfg.spec
    seq_mean = None
    if spec.sequence_statistic is not None:  # one sequence: its mean over all tokens
        seq_mean = spec.sequence_statistic(lp.detach(), old, adv, pcfg).mean().expand_as(lp)
    loss, indicators = spec.fn(lp, old, adv, pcfg, seq_mean=seq_mean)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    return loss.detach(), grad, indicators


# (r, A) -> per-token loss for ε_low 0.2, ε_high 0.28, c 3 (XTuner's test vectors, spec §7.4)
@pytest.mark.parametrize(
    "ratio,adv,expected",
    [(0.5, 1, -0.5), (0.9, 1, -0.9), (1.0, -1, 1.0), (1.5, -1, 1.5), (5.0, -1, 3.0), (5.0, 1, -1.28)],
)
def test_vanilla_dual_clip_values(ratio, adv, expected):
    loss, grad, ind = _run("vanilla", [math.log(ratio)], [adv], cliprange_low=0.2, cliprange_high=0.28)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # d loss / d log π = −A·r on the unclipped branch, 0 where a clip is active
    clipped = (adv > 0 and ratio > 1.28) or (adv < 0 and ratio < 0.8) or (adv < 0 and ratio * -adv > 3)
    assert grad.item() == pytest.approx(0.0 if clipped else -adv * ratio, abs=1e-12)
    assert bool(ind["dual_clip"].item()) == (ratio == 5.0 and adv == -1)
    assert bool(ind["clip_high"].item()) == (ratio == 5.0 and adv == 1)


def test_vanilla_log_ratio_clamp_kills_gradient():
    loss, grad, _ = _run("vanilla", [30.0], [-1.0], clip_ratio_c=1e30)
    assert loss.item() == pytest.approx(math.exp(20.0))  # ratio clamped at e^20, −A·r branch
    assert grad.item() == 0.0


def test_gspo_sequence_ratio_and_gradient():
    # log r = [0.1, 0.3] → s = e^0.2; A = 1 inside the clip range → every token's loss is −s, gradient −s per token
    s = math.exp(0.2)
    loss, grad, _ = _run("gspo", [0.1, 0.3], [1.0, 1.0], cliprange_low=0.2, cliprange_high=0.28)
    torch.testing.assert_close(loss, torch.full((2,), -s, dtype=torch.float64))
    torch.testing.assert_close(grad, torch.full((2,), -s, dtype=torch.float64))
    # clip active: s > 1 + 0.1 with A > 0 → constant −1.1, no gradient
    loss, grad, ind = _run("gspo", [0.1, 0.3], [1.0, 1.0], cliprange_low=0.2, cliprange_high=0.1)
    torch.testing.assert_close(loss, torch.full((2,), -1.1, dtype=torch.float64))
    assert grad.abs().max().item() == 0.0 and ind["clip_high"].all()


def test_gspo_defaults_are_the_papers():
    cfg = PolicyLossConfig(loss_type="gspo")
    assert (cfg.cliprange_low, cfg.cliprange_high) == (3e-4, 4e-4)
    assert GRPOLossConfig(policy_loss_cfg={"loss_type": "gspo"}).agg_mode == "seq-mean-token-mean"


def test_cispo_values():
    # r = e^0.5 clipped to 1.2; loss = −1.2·A·logπ; gradient −1.2·A (the weight is a constant)
    loss, grad, ind = _run("cispo", [0.5], [1.0], logprobs=[-1.0], cliprange_low=0.2, cliprange_high=0.2)
    assert loss.item() == pytest.approx(1.2)
    assert grad.item() == pytest.approx(-1.2)
    assert ind["clip_high"].item() and not ind["clip_low"].item()
    loss, grad, _ = _run("cispo", [-0.1], [2.0], logprobs=[-0.5], cliprange_low=0.2, cliprange_high=0.2)
    assert loss.item() == pytest.approx(-math.exp(-0.1) * 2.0 * -0.5)
    assert grad.item() == pytest.approx(-math.exp(-0.1) * 2.0)


def test_gpg_values():
    loss, grad, _ = _run("gpg", [0.3], [2.0], logprobs=[-0.5])
    assert loss.item() == pytest.approx(1.0) and grad.item() == pytest.approx(-2.0)


@pytest.mark.parametrize("adv,tau", [(1.0, 1.0), (-1.0, 1.05)])
def test_sapo_values_at_ratio_one(adv, tau):
    # σ(0)·4/τ = 2/τ; gradient at r = 1 equals the unclipped PPO gradient −A
    loss, grad, _ = _run("sapo", [0.0], [adv])
    assert loss.item() == pytest.approx(-adv * 2 / tau)
    assert grad.item() == pytest.approx(-adv)


def test_sapo_value_away_from_one():
    x = math.log(1.5)
    loss, grad, _ = _run("sapo", [x], [1.0])
    sig = 1 / (1 + math.exp(-0.5))
    assert loss.item() == pytest.approx(-sig * 4)
    assert grad.item() == pytest.approx(-4 * sig * (1 - sig) * 1.5)


@pytest.mark.parametrize(
    "adv,expected_mean,grad_mask",
    [(1.0, 0.25, [1.0, 0.0]), (-1.0, 0.35, [1.0, 1.0])],  # A>0 clips 0.6 to 0.4; A<0 keeps max(x, clip(x))
)
def test_geo_mean_values(adv, expected_mean, grad_mask):
    loss, grad, _ = _run("geo_mean", [0.1, 0.6], [adv, adv])
    big_r = math.exp(expected_mean)
    torch.testing.assert_close(loss, torch.full((2,), -adv * big_r, dtype=torch.float64))
    # per-token gradient −A·R·∂q_t; with seq-mean-token-mean weights 1/n this is ∂(−A·R)/∂logπ_t
    torch.testing.assert_close(grad, -adv * big_r * torch.tensor(grad_mask, dtype=torch.float64))


def _seq_mean_loss(loss_type, logprobs, old, adv, **cfg):
    """The layer's loss for one sequence under seq-mean-token-mean (one micro-batch, one process)."""
    config = GRPOLossConfig(policy_loss_cfg={"loss_type": loss_type, **cfg}, loss_agg_mode="seq-mean-token-mean")
    labels = torch.zeros(1, logprobs.shape[-1], dtype=torch.long)
    ctx = config.build({"shifted_labels": labels, "advantages": torch.tensor([adv]), "old_logprobs": old[None]})
    GRPOLossContext.build_batches([ctx])
    return ctx(logprobs=logprobs[None])[0]


def test_gspo_equals_sequence_level_objective_with_gradcheck():
    old = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    lp = (old + torch.tensor([0.01, -0.02, 0.015], dtype=torch.float64)).requires_grad_(True)

    def reference(x):  # GSPO paper: −min(s·A, clip(s)·A) with s = exp(mean log r), full gradient through s
        s = (x - old).mean().exp()
        return torch.maximum(-s * 0.7, -s.clamp(1 - 0.2, 1 + 0.28) * 0.7)

    layer = _seq_mean_loss("gspo", lp, old, 0.7, cliprange_low=0.2, cliprange_high=0.28)
    torch.testing.assert_close(layer, reference(lp))
    torch.testing.assert_close(torch.autograd.grad(layer, lp)[0], torch.autograd.grad(reference(lp), lp)[0])
    assert torch.autograd.gradcheck(
        lambda x: _seq_mean_loss("gspo", x, old, 0.7, cliprange_low=0.2, cliprange_high=0.28), (lp,)
    )


def test_geo_mean_equals_sequence_level_objective_with_gradcheck():
    old = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    lp = (old + torch.tensor([0.1, -0.2, 0.05], dtype=torch.float64)).requires_grad_(True)

    def reference(x):  # GMPO: −A·exp(mean_t sgn(A)·min(sgn(A)·x, sgn(A)·clip(x)))
        log_r = x - old
        return 0.5 * log_r.clamp(-0.4, 0.4).maximum(log_r).mean().exp()  # A = −0.5: sgn −1 → max(x, clip x)

    layer = _seq_mean_loss("geo_mean", lp, old, -0.5)
    torch.testing.assert_close(layer, reference(lp))
    torch.testing.assert_close(torch.autograd.grad(layer, lp)[0], torch.autograd.grad(reference(lp), lp)[0])
    assert torch.autograd.gradcheck(lambda x: _seq_mean_loss("geo_mean", x, old, -0.5), (lp,))


# CISPO is left out on purpose: its weight is a stop-gradient, so finite differences see a different function.
@pytest.mark.parametrize("loss_type", ["vanilla", "gpg", "sapo"])
def test_token_losses_gradcheck(loss_type):
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    pcfg = PolicyLossConfig(loss_type=loss_type)
    lp = (old + torch.tensor([0.05, -0.03, 0.4, -0.5], dtype=torch.float64)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: pcfg.spec.fn(x, old, adv, pcfg)[0].sum(), (lp,))


def test_registry_extension_by_name_and_dotted_path():
    @register_policy_loss("test_double_pg")
    def double_pg(logprobs, old_logprobs, advantages, cfg, seq_mean=None):
        return -2 * advantages * logprobs, {}

    assert get_policy_loss("test_double_pg").fn is double_pg
    spec = get_policy_loss("hf_rlloss.loss.policy_losses.gpg_loss")
    assert spec.fn(torch.tensor([-1.0]), None, torch.tensor([3.0]), None)[0].item() == 3.0
    cfg = PolicyLossConfig(loss_type="hf_rlloss.loss.policy_losses.gpg_loss", my_extra_param=3)
    assert cfg.my_extra_param == 3
