"""M2PO's second-moment mask (`rollout_is.m2_threshold`): the bound in closed form, the loss by hand, exactness over
micro-batches and processes, its metrics and its validation."""

import math

import pytest
import torch
from _data import IGNORE, assert_equals_one_process, averaged_over_ranks, make_step, run_step, split
from _dist import run_distributed

from hf_rlloss import GRPOLossConfig, GRPOLossContext, finalize_train_policy_metrics
from hf_rlloss.loss.second_moment import m2_keep_bound


@pytest.mark.parametrize(
    "values,threshold,expected",
    [
        ([0.01, 0.04, 0.09, 0.25, 1.0], 0.05, 0.09),  # prefix means .01 .025 .0467 | .0975: keep up to 0.09
        ([1.0, 0.25, 0.01, 0.09, 0.04], 0.05, 0.09),  # the order does not matter
        ([0.01, 0.09, 0.09], 0.04, 0.01),  # tied values are kept or masked together (.05 would need half the tie)
        ([0.01, 0.02], 0.05, math.inf),  # already within the bound: nothing masked
        ([], 0.05, math.inf),
        ([0.5, 0.7], 0.05, -math.inf),  # even the smallest exceeds τ: everything masked
    ],
)
def test_keep_bound_in_closed_form(values, threshold, expected):
    assert m2_keep_bound(torch.tensor(values, dtype=torch.float64), threshold) == pytest.approx(expected)


def test_the_loss_by_hand():
    """GPG (ℓ = −A·log π) with token IS weights exp(δ), five valid tokens; τ keeps the three smallest δ²."""
    labels = torch.tensor([[1, 2, 3], [4, 5, IGNORE]])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]], dtype=torch.float64)
    delta = torch.tensor([[0.1, -0.2, 0.3], [-0.5, 1.0, 0.0]], dtype=torch.float64)  # δ² .01 .04 .09 .25 1
    old = logprobs
    rollout = old - delta
    advantages = torch.tensor([1.0, -2.0])
    cfg = GRPOLossConfig(
        policy_loss_cfg={"loss_type": "gpg"},
        loss_agg_mode="token-mean",
        rollout_is={"level": "token", "upper": 1000.0, "m2_threshold": 0.05},
    )
    data = {"shifted_labels": labels, "advantages": advantages, "old_logprobs": old, "rollout_logprobs": rollout}
    ctx = cfg.build(data)
    ctx.compute_rollout_is()
    GRPOLossContext.build_batches([ctx])
    lp = logprobs.clone().requires_grad_(True)
    loss, metrics = ctx(logprobs=lp)
    # kept: the first row's three tokens (δ² ≤ 0.09); the weights exp(δ); the token mean over the 3 kept tokens
    kept_terms = [math.exp(0.1) * 1.0, math.exp(-0.2) * 2.0, math.exp(0.3) * 0.5]  # w·(−A·log π), A = 1
    assert loss.item() == pytest.approx(sum(kept_terms) / 3)
    (grad,) = torch.autograd.grad(loss, lp)
    expected = torch.tensor([[-math.exp(0.1), -math.exp(-0.2), -math.exp(0.3)], [0.0, 0.0, 0.0]]) / 3
    torch.testing.assert_close(grad, expected.double())
    final = finalize_train_policy_metrics(metrics)
    assert final["rollout_is/m2"] == pytest.approx((0.01 + 0.04 + 0.09 + 0.25 + 1.0) / 5)
    assert final["rollout_is/m2_kept"] == pytest.approx((0.01 + 0.04 + 0.09) / 3)
    assert final["rollout_is/m2_masked_fraction"] == pytest.approx(2 / 5)
    assert final["train_policy/valid_tokens"] == 3


def _config(mode="token-mean", level="token"):
    return GRPOLossConfig(
        policy_loss_cfg={"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
        loss_agg_mode=mode,
        rollout_is={"level": level, "upper": 1000.0, "m2_threshold": 0.05},
    )


def test_the_mask_binds_on_the_test_step():
    step = make_step()
    valid = step["labels"] != IGNORE
    delta_sq = (step["old"].double() - step["rollout"].double())[valid].square()
    assert delta_sq.mean() > 0.05 and delta_sq.min() < 0.05  # some tokens masked, not all: the cases below bind
    final = finalize_train_policy_metrics(run_step(_config(), step, [list(range(8))])[3])
    assert 0 < final["rollout_is/m2_masked_fraction"] < 1 and final["rollout_is/m2_kept"] <= 0.05


@pytest.mark.parametrize("mode,level", [("token-mean", "token"), ("seq-mean-token-mean", "sequence")])
@pytest.mark.parametrize("path", ["logprobs", "hidden"])
def test_micro_batch_invariance(mode, level, path):
    cfg, step, rows = _config(mode, level), make_step(), list(range(8))
    reference = run_step(cfg, step, [rows], path)
    reference_metrics = finalize_train_policy_metrics(reference[3])
    for parts in (2, 4, 8):
        loss, grad_h, grad_w, metrics = run_step(cfg, step, split(rows, parts), path)
        torch.testing.assert_close(loss, reference[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad_h, reference[1], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad_w, reference[2], atol=1e-6, rtol=0)
        final = finalize_train_policy_metrics(metrics)
        for key in ("rollout_is/m2", "rollout_is/m2_kept", "rollout_is/m2_masked_fraction"):
            assert final[key] == pytest.approx(reference_metrics[key], abs=1e-12)


def test_a_bound_per_micro_batch_would_keep_other_tokens():
    """The control: each half of the step alone has another bound than the whole step, so a mask taken per
    micro-batch would keep other tokens, and the invariance above is the step-global rule at work."""
    step = make_step()
    delta_sq = (step["old"].double() - step["rollout"].double()).square()
    valid = step["labels"] != IGNORE
    whole = m2_keep_bound(delta_sq[valid], 0.05)
    halves = [m2_keep_bound(delta_sq[rows][valid[rows]], 0.05) for rows in split(list(range(8)), 2)]
    assert all(bound != whole for bound in halves)
    per_half = torch.cat(
        [(delta_sq[rows] <= bound) & valid[rows] for rows, bound in zip(split(list(range(8)), 2), halves)]
    )
    assert not torch.equal(per_half, (delta_sq <= whole) & valid)


def _rank_worker(rank, world_size, out_dir):
    results = {}
    for mode, level in [("token-mean", "token"), ("seq-mean-token-mean", "sequence")]:
        step = make_step()
        mine = list(range(8))[rank::world_size]  # interleaved rows: ranks hold unequal token counts
        loss, _, grad_w, metrics = run_step(_config(mode, level), step, split(mine, 2), "hidden")
        results[(mode, level)] = averaged_over_ranks(loss, grad_w, metrics)
    if rank == 0:
        torch.save(results, f"{out_dir}/results.pt")


@pytest.mark.distributed
def test_two_processes_equal_one(tmp_path):
    run_distributed(_rank_worker, 2, str(tmp_path), timeout=180)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    assert len(results) == 2
    for (mode, level), result in results.items():
        reference = assert_equals_one_process(result, _config(mode, level), make_step(), "hidden", label=(mode,))
        assert 0 < reference["rollout_is/m2_masked_fraction"] < 1


def test_validation():
    with pytest.raises(ValueError, match="m2_threshold.*must be > 0"):
        GRPOLossConfig(rollout_is={"upper": 2.0, "m2_threshold": 0.0})
    with pytest.raises(ValueError, match="m2_threshold set without upper"):
        GRPOLossConfig(rollout_is={"m2_threshold": 0.04})
    cfg = _config()
    ctx = cfg.build(
        {
            "shifted_labels": torch.tensor([[1, 2]]),
            "advantages": torch.tensor([1.0]),
            "rollout_logprobs": -torch.ones(1, 2),
        }
    )
    with pytest.raises(ValueError, match="m2_threshold needs old_logprobs"):
        GRPOLossContext.build_batches([ctx])
