"""Closed-form values and gradients of the loss terms TRL's GRPO options map onto (issue 12): the two-sided `delta`
clip, no dual clip, CISPO with an absolute cap below 1 and no floor, sequence-level CISPO, VESPO, the off-policy
sequence mask (OPSM), the ratio-weighted KL (token and sequence level), and `step_fraction`."""

import math

import pytest
import torch

from hf_rlloss import GRPOLossConfig, GRPOLossContext, PolicyLossConfig

F64 = torch.float64


def _ctx(cfg: GRPOLossConfig, lengths, advantages, old, **data):
    """A padded micro-batch of sequences of the given lengths (labels 0..V-1), built and normalized."""
    width = max(lengths)
    labels = torch.full((len(lengths), width), -100, dtype=torch.long)
    for i, n in enumerate(lengths):
        labels[i, :n] = torch.arange(n) % 5
    ctx = cfg.build({"shifted_labels": labels, "advantages": torch.tensor(advantages), "old_logprobs": old, **data})
    GRPOLossContext.build_batches([ctx])
    return ctx


def _loss(ctx, lp):
    return ctx(logprobs=lp)[0]


# ------------------------------------------------------------------------------------------------------------------
# Policy losses on token vectors


def _token_loss(loss_type, log_ratio, advantages, logprobs=None, **cfg):
    pcfg = PolicyLossConfig(loss_type=loss_type, **cfg)
    log_ratio = torch.tensor(log_ratio, dtype=F64)
    old = torch.zeros_like(log_ratio) if logprobs is None else torch.tensor(logprobs, dtype=F64) - log_ratio
    lp = (old + log_ratio).requires_grad_(True)
    loss, indicators = pcfg.spec.fn(lp, old, torch.tensor(advantages, dtype=F64), pcfg)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    return loss.detach(), grad, indicators


@pytest.mark.parametrize("ratio", [0.5, 0.95, 1.05, 1.15, 1.3, 2.0])
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_delta_two_sided_clip_is_trls_formula(ratio, adv):
    # TRL: −min(min(r, δ)·A, clip(r, 1−ε_low, 1+ε_high)·A), δ = 1.1, ε = 0.2; no dual clip
    delta, eps = 1.1, 0.2
    loss, grad, _ = _token_loss(
        "vanilla", [math.log(ratio)], [adv], cliprange_low=eps, cliprange_high=eps, clip_ratio_c=None, delta=delta
    )
    unclipped, clipped = min(ratio, delta) * adv, min(max(ratio, 1 - eps), 1 + eps) * adv
    assert loss.item() == pytest.approx(-min(unclipped, clipped), abs=1e-12)
    # d/d log π = −A·r through the branch min() picks, unless that branch's ratio is clamped there (then 0)
    if unclipped < clipped:
        live = ratio < delta
    elif clipped < unclipped:
        live = 1 - eps < ratio < 1 + eps
    else:  # a tie: both branches equal r here (r inside both bounds), so the gradient is −A·r as well
        live = ratio < delta and 1 - eps < ratio < 1 + eps
    assert grad.item() == pytest.approx(-adv * ratio if live else 0.0, abs=1e-12)


def test_delta_changes_the_loss_only_above_delta():
    kwargs = dict(cliprange_low=0.2, cliprange_high=0.5, clip_ratio_c=None)
    plain, _, _ = _token_loss("vanilla", [math.log(1.1), math.log(1.4)], [1.0, -1.0], **kwargs)
    two_sided, _, _ = _token_loss("vanilla", [math.log(1.1), math.log(1.4)], [1.0, -1.0], delta=1.2, **kwargs)
    assert two_sided[0] == plain[0]  # r = 1.1 < δ
    assert two_sided[1].item() == pytest.approx(1.4) and plain[1].item() == pytest.approx(1.4)  # max(−A·δ, −A·clip)
    capped, _, _ = _token_loss("vanilla", [math.log(1.4)], [1.0], delta=1.2, **kwargs)
    assert capped.item() == pytest.approx(-1.2)  # A > 0: min(min(1.4, 1.2), clip(1.4) = 1.4)


def test_no_dual_clip_when_clip_ratio_c_is_none():
    loss, grad, ind = _token_loss("vanilla", [math.log(5.0)], [-1.0], clip_ratio_c=None)
    assert loss.item() == pytest.approx(5.0) and grad.item() == pytest.approx(5.0)  # −A·r, unbounded as TRL
    assert not ind["dual_clip"].any()
    loss, _, ind = _token_loss("vanilla", [math.log(5.0)], [-1.0])
    assert loss.item() == pytest.approx(3.0) and ind["dual_clip"].all()


def test_cispo_absolute_cap_below_one_and_no_floor():
    # TRL's ε_max = 0.5: cliprange_high = −0.5; cliprange_low = 1: floor 0, so a ratio of 1e-9 keeps its weight
    ratios = [1e-9, 0.3, 0.8, 2.0]
    logprobs = [-0.5, -1.0, -2.0, -0.1]
    loss, grad, ind = _token_loss(
        "cispo", [math.log(r) for r in ratios], [1.0, -1.0, 2.0, 1.0], logprobs, cliprange_low=1.0, cliprange_high=-0.5
    )
    weights = torch.tensor([min(r, 0.5) for r in ratios], dtype=F64)
    advantages = torch.tensor([1.0, -1.0, 2.0, 1.0], dtype=F64)
    torch.testing.assert_close(loss, -weights * advantages * torch.tensor(logprobs, dtype=F64))
    torch.testing.assert_close(grad, -weights * advantages)
    assert ind["clip_high"].tolist() == [False, False, True, True] and not ind["clip_low"].any()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"loss_type": "cispo", "cliprange_high": -1.0}, r"cliprange_high=-1.0 must be > -1"),
        ({"loss_type": "cispo", "cliprange_low": 0.2, "cliprange_high": -0.5}, r"not below the floor"),
        ({"loss_type": "cispo", "cliprange_low": 1.5}, r"cliprange_low=1.5 must be in \[0, 1\]"),
        ({"loss_type": "vanilla", "cliprange_high": -0.1}, r"cliprange_high=-0.1 must be >= 0"),
        ({"loss_type": "vanilla", "cliprange_low": 1.0}, r"cliprange_low=1.0 must be in \[0, 1\)"),
        ({"loss_type": "vanilla", "delta": 1.0}, r"delta=1.0 must be > 1"),
        ({"loss_type": "cispo", "delta": 2.0}, r"does not use it"),
        ({"loss_type": "vespo", "vespo_lambda_pos": 0.0}, r"vespo_lambda_pos"),
        ({"loss_type": "vespo", "vespo_k_neg": -1.0}, r"vespo_k_neg"),
    ],
)
def test_policy_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kl_bias_correction": "token"}, r"needs use_kl_loss=True"),
        ({"use_kl_loss": True, "kl_loss_type": "k3", "kl_bias_correction": "tok"}, r"kl_bias_correction"),
        ({"off_policy_mask_threshold": -0.1}, r"off_policy_mask_threshold"),
        ({"off_policy_mask_threshold": float("nan")}, r"off_policy_mask_threshold"),
        (
            {"policy_loss_cfg": {"loss_type": "vespo"}, "rollout_is": {"level": "sequence", "upper": 2.0}},
            r"rollout_is.level='sequence' with loss_type='vespo'",
        ),
    ],
)
def test_loss_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOLossConfig(**kwargs)


# ------------------------------------------------------------------------------------------------------------------
# Sequence-level terms through the context (token-mean over 5 valid tokens: weight 1/5)

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]], dtype=F64)
SHIFT = torch.tensor([[0.3, 0.1, -0.2], [-0.4, 0.2, 0.0]], dtype=F64)  # log r; the last token of row 2 is padding
LENGTHS = [3, 2]


def _lp():
    return (OLD + SHIFT).requires_grad_(True)


def test_cispo_seq_weight_is_the_clipped_sequence_ratio():
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "cispo_seq", "cliprange_low": 1.0, "cliprange_high": 0.05})
    ctx = _ctx(cfg, LENGTHS, [1.0, -2.0], OLD.float())
    lp = _lp()
    loss = _loss(ctx, lp)
    s = [math.exp(0.2 / 3), math.exp(-0.1)]  # exp(mean log r) per sequence
    w = [min(s[0], 1.05), min(s[1], 1.05)]
    expected = -(w[0] * 1.0 * lp[0, :3].sum() + w[1] * -2.0 * lp[1, :2].sum()) / 5
    torch.testing.assert_close(loss, expected)
    grad = torch.autograd.grad(loss, lp)[0]
    torch.testing.assert_close(grad[0, :3], torch.full((3,), -w[0] / 5, dtype=F64))
    torch.testing.assert_close(grad[1, :2], torch.full((2,), 2.0 * w[1] / 5, dtype=F64))
    assert grad[1, 2] == 0


def test_sapo_seq_equals_trls_sequence_level_sapo_with_gradcheck():
    # TRL: −σ(τ·(s − 1))·(4/τ)·A per token, s = exp(mean log r) with the gradient through s; per-sequence mean
    old = OLD[0]
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "sapo_seq"})
    assert cfg.agg_mode == "seq-mean-token-mean"
    labels = torch.zeros(1, 3, dtype=torch.long)
    ctx = cfg.build({"shifted_labels": labels, "advantages": torch.tensor([-0.7]), "old_logprobs": old[None].float()})
    GRPOLossContext.build_batches([ctx])

    def reference(x):
        s = (x - old).mean().exp()
        return -torch.sigmoid(1.05 * (s - 1)) * (4 / 1.05) * -0.7  # A ≤ 0: τ_neg = 1.05

    lp = (old + SHIFT[0]).requires_grad_(True)
    layer = _loss(ctx, lp[None])
    torch.testing.assert_close(layer, reference(lp))
    torch.testing.assert_close(torch.autograd.grad(layer, lp)[0], torch.autograd.grad(reference(lp), lp)[0])
    assert torch.autograd.gradcheck(lambda x: _loss(ctx, x[None]), (lp,))


def _vespo_phi(log_w, adv, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    k, lam = (k_pos, lam_pos) if adv >= 0 else (k_neg, lam_neg)
    w = math.exp(log_w)
    return math.exp(lam) * w**k * math.exp(-lam * w)


def test_vespo_gamma_weight_of_the_summed_log_ratio_and_folded_rollout_is():
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "vespo"})
    is_weights = torch.tensor([[2.0, 1.0, 1.0], [0.5, 1.0, 1.0]])
    for weights in (None, is_weights):
        extra = {} if weights is None else {"rollout_is_weights": weights}
        ctx = _ctx(cfg, LENGTHS, [1.0, -2.0], OLD.float(), **extra)
        lp = _lp()
        loss = _loss(ctx, lp)
        log_w = [0.2, -0.2]  # Σ_t log r_t over the valid tokens, not the mean
        if weights is not None:  # folded into w (TRL's vLLM IS with vespo), not multiplied into the loss
            log_w = [0.2 + math.log(2.0), -0.2 + math.log(0.5)]
        phi = [_vespo_phi(log_w[0], 1.0), _vespo_phi(log_w[1], -2.0)]
        expected = -(phi[0] * 1.0 * lp[0, :3].sum() + phi[1] * -2.0 * lp[1, :2].sum()) / 5
        torch.testing.assert_close(loss, expected)
        grad = torch.autograd.grad(loss, lp)[0]  # φ is a constant: gradient −φ·A·(1/5) per token
        torch.testing.assert_close(grad[0, :3], torch.full((3,), -phi[0] / 5, dtype=F64))
        torch.testing.assert_close(grad[1, :2], torch.full((2,), 2.0 * phi[1] / 5, dtype=F64))
    assert _vespo_phi(0.0, 1.0) == pytest.approx(1.0)  # φ(1) = 1: on-policy VESPO is REINFORCE


@pytest.mark.parametrize("use_rollout", [False, True])
def test_off_policy_sequence_mask(use_rollout):
    # 3 sequences of 2 tokens; mean (behaviour − current) per sequence: 0.5, 0.5, 0.05; A = +1, −1, −1; δ = 0.1.
    # Sequence 1: A ≥ 0, kept; sequence 2: A < 0 and 0.5 > δ, dropped; sequence 3: 0.05 ≤ δ, kept.
    current = torch.tensor([[-1.0, -1.0], [-2.0, -1.0], [-1.0, -0.5]], dtype=F64)
    behaviour = current + torch.tensor([[0.4, 0.6], [0.5, 0.5], [0.0, 0.1]], dtype=F64)
    data = {"rollout_logprobs": behaviour.float()} if use_rollout else {}
    old = (current if use_rollout else behaviour).float()  # OPSM prefers the rollout log-probs when given
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "gpg"}, off_policy_mask_threshold=0.1)
    ctx = _ctx(cfg, [2, 2, 2], [1.0, -1.0, -1.0], old, **data)
    lp = current.clone().requires_grad_(True)
    loss, metrics = ctx(logprobs=lp)
    expected = -(lp[0].sum() - lp[2].sum()) / 6  # GPG: −A·log π, token-mean over all 6 tokens (denominator kept)
    torch.testing.assert_close(loss, expected)
    grad = torch.autograd.grad(loss, lp)[0]
    assert grad[1].abs().max() == 0
    assert metrics["train_policy/opsm_masked_count"].item() == 2.0


def test_off_policy_mask_without_old_logprobs_drops_nothing():
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "gpg"}, off_policy_mask_threshold=0.0)
    ctx = cfg.build({"shifted_labels": torch.zeros(2, 2, dtype=torch.long), "advantages": torch.tensor([-1.0, -1.0])})
    GRPOLossContext.build_batches([ctx])
    _, metrics = ctx(logprobs=torch.full((2, 2), -1.0))
    assert metrics["train_policy/opsm_masked_count"].item() == 0.0


# ------------------------------------------------------------------------------------------------------------------
# Ratio-weighted KL (TRL's use_bias_correction_kl)

REF = torch.tensor([[-1.2, -1.7, -0.9], [-1.0, -0.9, 0.0]], dtype=F64)


def _kl_ctx(level, loss_type="gpg"):
    cfg = GRPOLossConfig(
        policy_loss_cfg={"loss_type": loss_type},
        use_kl_loss=True,
        kl_loss_type="k3",
        kl_loss_coef=0.5,
        kl_bias_correction=level,
    )
    return _ctx(cfg, LENGTHS, [0.0, 0.0], OLD.float(), ref_logprobs=REF.float())  # A = 0: the KL term alone


def _kl_reference(lp, level):
    """TRL: per_token_kl = k3 · coef_1 (differentiable), coef_1 the token or sequence ratio; token-mean × beta."""
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=F64)
    delta = REF - lp
    k3 = delta.exp() - delta - 1
    log_ratio = lp - OLD
    if level == "token":
        coef = log_ratio.exp()
    else:
        coef = ((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).exp()
    return 0.5 * (k3 * coef * mask).sum() / mask.sum()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_value_gradient_and_gradcheck(level):
    ctx = _kl_ctx(level)
    lp = _lp()
    loss = _loss(ctx, lp)
    reference = _kl_reference(lp, level)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(reference, lp)[0])
    # the sequence ratio couples the tokens of a sequence: finite differences see the whole function
    assert torch.autograd.gradcheck(lambda x: _loss(ctx, x), (_lp(),))


def test_bias_correction_changes_the_gradient_even_on_policy():
    # at r = 1 the value is unchanged but the gradient gains k3·∇log π (TRL's documented behaviour)
    lp = OLD.clone().requires_grad_(True)
    plain = _loss(_kl_ctx(None), lp)
    corrected = _loss(_kl_ctx("token"), lp)
    torch.testing.assert_close(plain, corrected)
    g_plain, g_corrected = (torch.autograd.grad(x, lp)[0] for x in (plain, corrected))
    delta = REF - OLD
    k3 = delta.exp() - delta - 1
    torch.testing.assert_close(g_corrected - g_plain, 0.5 * k3 * torch.tensor([[1.0, 1, 1], [1, 1, 0]]) / 5)


# ------------------------------------------------------------------------------------------------------------------
# The hidden-state path computes the same sequence terms (its no-grad pre-pass)


def test_hidden_state_path_matches_logprob_path_for_sequence_terms():
    torch.manual_seed(0)
    hidden = torch.randn(2, 3, 8, dtype=F64, requires_grad=True)
    head = torch.randn(5, 8, dtype=F64, requires_grad=True)
    cfg = GRPOLossConfig(
        policy_loss_cfg={"loss_type": "vespo"},
        use_kl_loss=True,
        kl_loss_type="k3",
        kl_bias_correction="sequence",
        off_policy_mask_threshold=0.0,
        chunk_size=2,
    )
    ctx = _ctx(cfg, LENGTHS, [1.0, -2.0], OLD.float(), ref_logprobs=REF.float())
    labels = ctx.loss_kwargs.shifted_labels.clamp(min=0)
    logprobs = torch.log_softmax(hidden @ head.T, -1).gather(-1, labels[..., None]).squeeze(-1)  # full logits: a test
    from_logprobs = ctx(logprobs=logprobs)[0]
    g_ref = torch.autograd.grad(from_logprobs, (hidden, head))
    from_hidden = ctx(hidden_states=hidden, head_weight=head)[0]
    g_hidden = torch.autograd.grad(from_hidden, (hidden, head))
    torch.testing.assert_close(from_hidden, from_logprobs)
    for a, b in zip(g_hidden, g_ref):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------------------------
# step_fraction: a group of a step spanning two generation batches


def test_step_fraction_scales_loss_and_gradient():
    cfg = GRPOLossConfig(use_kl_loss=True, kl_loss_type="k3")
    full = _ctx(cfg, LENGTHS, [1.0, -2.0], OLD.float(), ref_logprobs=REF.float())
    labels = full.loss_kwargs.shifted_labels
    data = {"shifted_labels": labels, "advantages": torch.tensor([1.0, -2.0]), "old_logprobs": OLD.float()}
    third = cfg.build({**data, "ref_logprobs": REF.float()})
    GRPOLossContext.build_batches([third], step_fraction=1 / 3)
    lp = _lp()
    a, b = _loss(full, lp), _loss(third, lp)
    torch.testing.assert_close(b, a / 3)
    torch.testing.assert_close(torch.autograd.grad(b, lp)[0], torch.autograd.grad(a, lp)[0] / 3)
    with pytest.raises(ValueError, match="step_fraction=0"):
        GRPOLossContext.build_batches([third], step_fraction=0)
