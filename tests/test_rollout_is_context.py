"""Rollout IS inside the loss layer: build-time checks, rejection before the denominator, weights on the policy
term only, non-finite rollout log-probs."""

import math

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
