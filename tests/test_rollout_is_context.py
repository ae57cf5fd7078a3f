"""Rollout IS inside the loss layer: build-time checks, rejection before the denominator, weights on the policy
term only, non-finite rollout log-probs."""

import math
import os

import pytest
import torch
from _data import IGNORE, make_step, run_step, split

from hf_rlloss import GRPOLossConfig, GRPOLossContext, finalize_train_policy_metrics

LABELS = torch.tensor([[1, 2, 3, IGNORE]])
OLD = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
ROLLOUT = torch.tensor([[-1.0, -1.5, -0.2, 0.0]])  # log ρ = old − rollout = [0, 0.5, −0.8]


def _gpg_cfg(**rollout_is):
    return GRPOLossConfig(
        policy_loss_cfg={"loss_type": "gpg"},
        use_kl_loss=True,
        kl_loss_type="k1",
        kl_loss_coef=1.0,
        rollout_is=rollout_is,
    )


def _ctx(cfg, rollout=ROLLOUT):
    data = {"shifted_labels": LABELS, "advantages": torch.tensor([1.0]), "old_logprobs": OLD}
    data["ref_logprobs"] = OLD - 0.1
    data["rollout_logprobs"] = rollout
    ctx = cfg.build(data)
    ctx.compute_rollout_is()
    GRPOLossContext.build_batches([ctx])
    return ctx


def test_missing_rollout_logprobs_is_a_build_time_error():
    with pytest.raises(ValueError, match="no rollout_logprobs: pass the log-probs of the sampled tokens"):
        _gpg_cfg(upper=2.0).build({"shifted_labels": LABELS, "advantages": torch.ones(1)})
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(1, 3\) but shifted_labels has shape \(1, 4\)"):
        _gpg_cfg(upper=2.0).build(
            {"shifted_labels": LABELS, "advantages": torch.ones(1), "rollout_logprobs": torch.zeros(1, 3)}
        )


def test_truncated_weights_multiply_the_policy_term_only():
    # truncate (upper only): w = min(ρ, 1.5) = [1, 1.5, e^−0.8]; gpg per-token loss −A·logπ = 1; token-mean over 3
    ctx = _ctx(_gpg_cfg(upper=1.5))
    loss, metrics = ctx(logprobs=OLD.clone())
    weights = [1.0, 1.5, math.exp(-0.8)]
    assert metrics["loss/policy"].item() == pytest.approx(sum(weights) / 3, rel=1e-6)
    assert metrics["loss/kl"].item() == pytest.approx(0.1, rel=1e-5)  # k1 = 0.1 on every token, no IS weight
    assert loss.item() == pytest.approx(sum(weights) / 3 + 0.1, rel=1e-6)


def test_mask_rejection_happens_before_the_denominator_and_keeps_caller_labels():
    labels_before = LABELS.clone()
    ctx = _ctx(_gpg_cfg(mode="mask", lower=0.5, upper=1.5))  # ρ = e^0.5 = 1.65 and e^−0.8 = 0.45 are rejected
    assert ctx.loss_kwargs.shifted_labels.tolist() == [[1, IGNORE, IGNORE, IGNORE]]
    assert ctx.loss_kwargs.global_grad_tokens.item() == 1  # the denominator counts only the kept token
    assert torch.equal(LABELS, labels_before)  # the caller's labels are untouched
    loss, metrics = ctx(logprobs=OLD.clone())
    assert metrics["loss/policy"].item() == pytest.approx(1.0)  # ρ = 1 on the kept token, −A·logπ = 1, over 1
    final = finalize_train_policy_metrics(metrics)
    assert final["train_policy/valid_tokens"] == 1
    assert final["rollout_is/masked_fraction"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_rollout_logprobs_are_rejected_and_counted(bad):
    rollout = ROLLOUT.clone()
    rollout[0, 1] = bad
    for is_cfg in ({}, {"upper": 2.0}, {"level": "sequence", "mode": "both", "upper": 5.0}):
        ctx = _ctx(_gpg_cfg(**is_cfg), rollout)
        lp = OLD.clone().requires_grad_(True)
        loss, metrics = ctx(logprobs=lp)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        final = finalize_train_policy_metrics(metrics)
        assert final["rollout_is/nonfinite_tokens"] == 1
        assert all(math.isfinite(v) for v in final.values()), final


def test_metrics_only_mode_reports_mismatch_without_changing_the_loss():
    step = make_step(seed=11)
    plain = run_step(GRPOLossConfig(), step, [list(range(8))])
    cfg = GRPOLossConfig(rollout_is={})
    contexts = []
    for rows in split(list(range(8)), 2):
        ctx = cfg.build(
            {
                "shifted_labels": step["labels"][rows],
                "advantages": step["advantages"][rows],
                "old_logprobs": step["old"][rows],
                "rollout_logprobs": step["rollout"][rows],
            }
        )
        ctx.compute_rollout_is()
        contexts.append(ctx)
    GRPOLossContext.build_batches(contexts)
    assert all(c.loss_kwargs.rollout_is_weights is None for c in contexts)
    mask = step["labels"] != IGNORE
    delta = (step["rollout"] - step["old"])[mask].double()
    from _data import logprobs_of

    from hf_rlloss import accumulate_metrics

    acc, total = {}, 0.0
    for rows, ctx in zip(split(list(range(8)), 2), contexts):
        loss, m = ctx(logprobs=logprobs_of(step["h"][rows], step["w"], step["labels"][rows]))
        total += loss.item()
        accumulate_metrics(acc, m)
    assert total == pytest.approx(plain[0].item(), rel=1e-6)
    final = finalize_train_policy_metrics(acc)
    assert final["mismatch/mismatch_kl"] == pytest.approx(delta.mean().item(), rel=1e-5)


def test_compute_rollout_is_after_build_batches_is_an_error_naming_the_order():
    cfg = _gpg_cfg(mode="mask", lower=0.5, upper=1.5)
    data = {"shifted_labels": LABELS, "advantages": torch.ones(1), "old_logprobs": OLD, "rollout_logprobs": ROLLOUT}
    ctx = cfg.build(data)
    ctx.loss_kwargs.ref_logprobs = OLD - 0.1
    GRPOLossContext.build_batches([ctx])
    labels = ctx.loss_kwargs.shifted_labels.clone()
    with pytest.raises(RuntimeError, match=r"after build_batches\(\).*then ctx.compute_rollout_is\(\) on each"):
        ctx.compute_rollout_is()
    assert torch.equal(ctx.loss_kwargs.shifted_labels, labels)  # nothing was rejected behind the denominator's back


@pytest.mark.parametrize("micro_batch", [3, None])
def test_nonfinite_old_logprobs_from_build_name_the_micro_batch(micro_batch):
    old = OLD.clone()
    old[0, 2] = float("nan")
    data = {"shifted_labels": LABELS, "advantages": torch.ones(1), "old_logprobs": old, "rollout_logprobs": ROLLOUT}
    ctx = _gpg_cfg().build(data, micro_batch=micro_batch)
    name = "micro-batch 3" if micro_batch is not None else r"this micro-batch \(pass micro_batch=i to cfg.build"
    with pytest.raises(ValueError, match=rf"old_logprobs of {name}.* has 1 non-finite value\(s\) at valid tokens"):
        ctx.compute_rollout_is()
    # without rollout IS, build_batches names it the same way (its index, else the position in the list)
    ctx = GRPOLossConfig().build({"shifted_labels": LABELS, "advantages": torch.ones(1), "old_logprobs": old}, None, 3)
    with pytest.raises(ValueError, match=r"old_logprobs of micro-batch 3 has 1 non-finite"):
        GRPOLossContext.build_batches([ctx])


def test_old_kept_logmass_renormalizes_pi_old_over_the_sampled_support():
    """δ = (log π_old − log K_π) − log μ on the sampled support; the policy ratio keeps the full-vocabulary π_old; the
    kept mass is reported (the rollout's when given, else π_old's)."""
    kept_old = torch.tensor([[-0.5, -0.2, -1.0, 0.0]])  # log K_π per token
    rollout = OLD - kept_old + torch.tensor([[0.0, 0.1, -0.3, 0.0]])  # μ on the support, with a numeric mismatch
    base = {"shifted_labels": LABELS, "advantages": torch.ones(1), "old_logprobs": OLD, "rollout_logprobs": rollout}
    for kept_rollout in (None, torch.tensor([[-0.4, -0.3, -0.9, 0.0]])):
        data = {**base, "old_kept_logmass": kept_old}
        if kept_rollout is not None:
            data["rollout_kept_logmass"] = kept_rollout
        ctx = _gpg_cfg(upper=5.0).build(data)
        ctx.compute_rollout_is()
        weights = ctx.loss_kwargs.rollout_is_weights[0, :3].tolist()
        assert weights == pytest.approx([1.0, math.exp(-0.1), math.exp(0.3)])
        assert torch.equal(ctx.loss_kwargs.old_logprobs, OLD)  # the policy ratio's π_old is untouched
        ctx.loss_kwargs.ref_logprobs = OLD
        GRPOLossContext.build_batches([ctx])
        final = finalize_train_policy_metrics(ctx(logprobs=OLD.clone())[1])
        assert final["mismatch/mismatch_logprob_abs_diff"] == pytest.approx(0.4 / 3)
        reported = (kept_old if kept_rollout is None else kept_rollout)[0, :3]
        assert final["mismatch/kept_mass_mean"] == pytest.approx(reported.exp().mean().item())
        assert final["mismatch/kept_mass_min"] == pytest.approx(reported.exp().min().item())


def test_ppl_ratio_is_training_ppl_over_rollout_ppl_in_code_and_docs():
    import hf_rlloss.loss.rollout_is as module

    ctx = _gpg_cfg().build(
        {"shifted_labels": LABELS, "advantages": torch.ones(1), "old_logprobs": OLD, "rollout_logprobs": ROLLOUT}
    )
    ctx.compute_rollout_is()
    ctx.loss_kwargs.ref_logprobs = OLD
    GRPOLossContext.build_batches([ctx])
    final = finalize_train_policy_metrics(ctx(logprobs=OLD.clone())[1])
    ratio = final["mismatch/mismatch_training_ppl"] / final["mismatch/mismatch_rollout_ppl"]  # one sequence
    assert ratio == pytest.approx(math.exp(1.0) / math.exp(0.9))  # mean log π_old = −1, mean log μ = −0.9
    assert final["mismatch/mismatch_ppl_ratio"] == pytest.approx(ratio)
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "rollout_is.md"), encoding="utf8").read()
    row = next(line for line in page.splitlines() if line.startswith("| `mismatch/mismatch_ppl_ratio`"))
    for text in (row, next(line for line in module.__doc__.splitlines() if "mismatch_ppl_ratio" in line)):
        assert "training ppl / rollout ppl" in text and "rollout ppl / training ppl" not in text, text


# GMPO's objective is per sequence, so its rollout IS weight is one per sequence: the geometric mean of the token
# weights over the sequence's valid tokens (verl's `compute_policy_loss_geo_mean`), not one weight per token.
GMPO_LABELS = torch.tensor([[1, 2, 3], [4, 5, IGNORE]])
GMPO_OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, 0.0]], dtype=torch.float64)
GMPO_STEP = torch.tensor([[0.1, -0.2, 0.5], [0.3, -0.1, 0.0]], dtype=torch.float64)  # log r; 0.5 is clipped at 0.4
GMPO_ADV = torch.tensor([0.8, -0.5])


def _gmpo_reference(lp, weights):
    """seq-mean-token-mean of ``−A_i·exp(mean_t clip(log r_t))·exp(mean_t log w_t)``, the sequence objective."""
    losses = []
    for i, n in enumerate((3, 2)):
        log_r = lp[i, :n] - GMPO_OLD[i, :n]
        clipped = log_r.clamp(-0.4, 0.4)
        q = torch.minimum(log_r, clipped) if GMPO_ADV[i] > 0 else torch.maximum(log_r, clipped)
        losses.append(-GMPO_ADV[i] * q.mean().exp() * weights[i, :n].log().mean().exp())
    return torch.stack(losses).mean()


def _gmpo_loss(data_extra, **rollout_is):
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "geo_mean"}, rollout_is=rollout_is)
    data = {"shifted_labels": GMPO_LABELS, "advantages": GMPO_ADV, "old_logprobs": GMPO_OLD, **data_extra}
    ctx = cfg.build(data)
    if rollout_is:
        ctx.compute_rollout_is()
    GRPOLossContext.build_batches([ctx])
    lp = (GMPO_OLD + GMPO_STEP).requires_grad_(True)
    loss, _ = ctx(logprobs=lp)
    return loss, torch.autograd.grad(loss, lp)[0], ctx


def test_gmpo_token_level_is_weights_fold_into_their_geometric_mean_per_sequence():
    weights = torch.tensor([[0.5, 2.0, 1.5], [0.8, 1.25, 1.0]], dtype=torch.float64)
    loss, grad, ctx = _gmpo_loss({"rollout_is_weights": weights})
    # Closed form: w_0 = (0.5·2·1.5)^(1/3) = 1.5^(1/3), w_1 = (0.8·1.25)^(1/2) = 1; one weight on all of a sequence
    folded = ctx.loss_kwargs.rollout_is_weights
    torch.testing.assert_close(folded[0], torch.full((3,), 1.5 ** (1 / 3)), rtol=1e-6, atol=0)
    torch.testing.assert_close(folded[1, :2], torch.ones(2), rtol=1e-6, atol=0)
    r0 = math.exp((0.1 - 0.2 + 0.4) / 3)  # A > 0: log r = 0.5 is clipped to 0.4
    r1 = math.exp((0.3 - 0.1) / 2)
    assert loss.item() == pytest.approx((-0.8 * r0 * 1.5 ** (1 / 3) + 0.5 * r1) / 2, rel=1e-6)
    lp = (GMPO_OLD + GMPO_STEP).requires_grad_(True)
    reference = _gmpo_reference(lp, weights)
    torch.testing.assert_close(grad, torch.autograd.grad(reference, lp)[0], rtol=1e-6, atol=1e-7)
    # ... and it is not the per-token product (the old behaviour, 1.3e-2 off verl's gradient in issue 24)
    per_token = -(0.8 * r0 * (0.5 + 2.0 + 1.5) / 3) / 2 + 0.5 * r1 * (0.8 + 1.25) / 2 / 2
    assert abs(loss.item() - per_token) > 1e-2


def test_gmpo_token_level_rollout_is_matches_verl_geometric_mean():
    rollout = GMPO_OLD - torch.tensor([[0.3, -0.6, 0.9], [-0.2, 0.4, 0.0]], dtype=torch.float64)  # log ρ = old − μ
    loss, grad, _ = _gmpo_loss({"rollout_logprobs": rollout}, level="token", upper=2.0)
    token_weights = (GMPO_OLD - rollout).exp().clamp(max=2.0)  # truncated token ratios; e^0.9 = 2.46 → 2
    lp = (GMPO_OLD + GMPO_STEP).requires_grad_(True)
    reference = _gmpo_reference(lp, token_weights)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(grad, torch.autograd.grad(reference, lp)[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_gmpo_sequence_level_is_weights_are_unchanged(level):
    rollout = GMPO_OLD - torch.tensor([[0.3, -0.6, 0.9], [-0.2, 0.4, 0.0]], dtype=torch.float64)
    loss, grad, ctx = _gmpo_loss({"rollout_logprobs": rollout}, level=level, upper=2.0)
    delta = [0.3 - 0.6 + 0.9, -0.2 + 0.4]
    seq_w = [min(math.exp(d if level == "sequence" else d / n), 2.0) for d, n in zip(delta, (3, 2))]
    expected = torch.tensor([[seq_w[0]] * 3, [seq_w[1]] * 2 + [0.0]], dtype=torch.float32)
    torch.testing.assert_close(ctx.loss_kwargs.rollout_is_weights * ctx.mask, expected, rtol=1e-6, atol=0)
    lp = (GMPO_OLD + GMPO_STEP).requires_grad_(True)
    reference = _gmpo_reference(lp, expected.double().masked_fill(~ctx.mask, 1.0))
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(grad, torch.autograd.grad(reference, lp)[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("path", ["logprobs", "hidden"])
def test_gmpo_token_level_is_is_micro_batch_invariant(path):
    cfg = GRPOLossConfig(
        policy_loss_cfg={"loss_type": "geo_mean"}, rollout_is={"level": "token", "mode": "both", "upper": 2.0}
    )
    step = make_step()
    rows = list(range(8))
    reference = run_step(cfg, step, [rows], path)
    for parts in (2, 4):
        loss, grad_h, grad_w, _ = run_step(cfg, step, split(rows, parts), path)
        torch.testing.assert_close(loss, reference[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad_h, reference[1], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad_w, reference[2], atol=1e-6, rtol=0)
