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
