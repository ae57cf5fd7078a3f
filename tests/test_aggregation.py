"""Aggregation modes: closed-form values, and invariance to how a step is split into micro-batches and ranks."""

import pytest
import torch
from _data import IGNORE, assert_equals_one_process, averaged_over_ranks, make_step, run_step, split
from _dist import run_distributed

from hf_rlloss import AGG_MODES, GRPOLossConfig, GRPOLossContext, finalize_train_policy_metrics

# GPG (ℓ = −A·logπ) on three sequences: lengths 2 and 3, and one without valid tokens (it must not count).
LABELS = torch.tensor([[1, 2, IGNORE], [3, 4, 5], [IGNORE, IGNORE, IGNORE]])
LOGPROBS = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.0, -1.5], [0.0, 0.0, 0.0]], dtype=torch.float64)
ADVANTAGES = torch.tensor([1.0, -2.0, 5.0])  # per-token losses: [1, 2] and [−1, −2, −3]
CLOSED_FORM = {
    "token-mean": (1 + 2 - 1 - 2 - 3) / 5,
    "seq-mean-token-mean": ((1 + 2) / 2 + (-1 - 2 - 3) / 3) / 2,
    "seq-mean-token-sum": (3 - 6) / 2,
    "seq-mean-token-sum-norm": (3 - 6) / 2 / 4,
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_closed_form(mode):
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "gpg"}, loss_agg_mode=mode, loss_scale_factor=4)
    lp = LOGPROBS.clone().requires_grad_(True)
    ctx = cfg.build({"shifted_labels": LABELS, "advantages": ADVANTAGES})
    GRPOLossContext.build_batches([ctx])
    loss, metrics = ctx(logprobs=lp)
    assert loss.item() == pytest.approx(CLOSED_FORM[mode])
    # the gradient of a weighted sum is −A·w per token: check the token-mean case exactly
    (grad,) = torch.autograd.grad(loss, lp)
    if mode == "token-mean":
        expected = torch.tensor([[-1, -1, 0], [2, 2, 2], [0, 0, 0]], dtype=torch.float64) / 5
        torch.testing.assert_close(grad, expected)
    assert grad[2].abs().sum() == 0 and grad[0, 2] == 0
    assert finalize_train_policy_metrics(metrics)["train_policy/valid_tokens"] == 5


# With count_empty_sequences the empty third sequence counts in S (3 instead of 2), as TRL's grpo/dr_grpo count rows.
EMPTY_COUNTED = {
    "seq-mean-token-mean": ((1 + 2) / 2 + (-1 - 2 - 3) / 3) / 3,
    "seq-mean-token-sum": (3 - 6) / 3,
    "seq-mean-token-sum-norm": (3 - 6) / 3 / 4,
}


@pytest.mark.parametrize("mode", list(EMPTY_COUNTED))
@pytest.mark.parametrize("count_empty", [False, True])
def test_closed_form_counting_empty_sequences(mode, count_empty):
    cfg = GRPOLossConfig(
        policy_loss_cfg={"loss_type": "gpg"},
        loss_agg_mode=mode,
        loss_scale_factor=4,
        count_empty_sequences=count_empty,
    )
    lp = LOGPROBS.clone().requires_grad_(True)
    ctx = cfg.build({"shifted_labels": LABELS, "advantages": ADVANTAGES})
    GRPOLossContext.build_batches([ctx])
    sequences = 3 if count_empty else 2
    # the weights in closed form: m / (n_i·S), m / S, m / (S·C)
    per_token = {
        "seq-mean-token-mean": torch.tensor([[1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3], [0, 0, 0]]),
        "seq-mean-token-sum": torch.tensor([[1.0, 1, 0], [1, 1, 1], [0, 0, 0]]),
        "seq-mean-token-sum-norm": torch.tensor([[1.0, 1, 0], [1, 1, 1], [0, 0, 0]]) / 4,
    }[mode] / sequences
    torch.testing.assert_close(ctx.loss_kwargs.policy_loss_weight, per_token)
    loss, _ = ctx(logprobs=lp)
    assert loss.item() == pytest.approx(EMPTY_COUNTED[mode] if count_empty else CLOSED_FORM[mode])
    (grad,) = torch.autograd.grad(loss, lp)  # GPG: ∂ℓ/∂logπ = −A, times the weight
    torch.testing.assert_close(grad, -ADVANTAGES.double()[:, None] * per_token.double())


def test_count_empty_sequences_needs_a_sequence_mode():
    with pytest.raises(ValueError, match="count_empty_sequences=True.*token-mean"):
        GRPOLossConfig(loss_agg_mode="token-mean", count_empty_sequences=True)
    assert GRPOLossConfig(loss_agg_mode="token-mean").count_empty_sequences is False  # the default: today's S


def test_kl_uses_the_same_aggregation():
    cfg = GRPOLossConfig(
        policy_loss_cfg={"loss_type": "gpg"},
        loss_agg_mode="seq-mean-token-mean",
        use_kl_loss=True,
        kl_loss_type="k1",
        kl_loss_coef=0.5,
    )
    ref = LOGPROBS - torch.tensor([[0.2, 0.4, 0.0], [0.3, 0.3, 0.6], [0.0, 0.0, 0.0]], dtype=torch.float64)
    ctx = cfg.build({"shifted_labels": LABELS, "advantages": ADVANTAGES, "ref_logprobs": ref})
    GRPOLossContext.build_batches([ctx])
    loss, metrics = ctx(logprobs=LOGPROBS)
    kl = 0.5 * ((0.2 + 0.4) / 2 + (0.3 + 0.3 + 0.6) / 3) / 2
    assert metrics["loss/kl"].item() == pytest.approx(kl)
    assert loss.item() == pytest.approx(CLOSED_FORM["seq-mean-token-mean"] + kl)


CASES = [
    ("vanilla", "token-mean", False),
    ("vanilla", "seq-mean-token-mean", True),
    ("vanilla", "seq-mean-token-sum", False),
    ("vanilla", "seq-mean-token-sum-norm", True),
    ("gspo", None, True),
    ("geo_mean", None, False),
    ("cispo", "token-mean", True),
    ("sapo", None, False),
]


# ... and with count_empty_sequences (make_step has an empty sequence; split 8 ways it is a micro-batch of its own)
EMPTY_COUNTED_CASES = [("vanilla", "seq-mean-token-mean", True), ("sapo", "seq-mean-token-sum-norm", False)]


def _config(loss_type, mode, kl, count_empty=False):
    return GRPOLossConfig(
        policy_loss_cfg={"loss_type": loss_type, "cliprange_low": 0.1, "cliprange_high": 0.15},
        loss_agg_mode=mode,
        loss_scale_factor=6,
        use_kl_loss=kl,
        kl_loss_type="k3",
        kl_loss_coef=0.1,
        count_empty_sequences=count_empty,
    )


@pytest.mark.parametrize("loss_type,mode,kl", CASES)
@pytest.mark.parametrize("path", ["logprobs", "hidden"])
def test_micro_batch_invariance(loss_type, mode, kl, path):
    cfg = _config(loss_type, mode, kl)
    step = make_step()
    rows = list(range(8))
    reference = run_step(cfg, step, [rows], path)
    for parts in (2, 4, 8):
        loss, grad_h, grad_w, _ = run_step(cfg, step, split(rows, parts), path)
        torch.testing.assert_close(loss, reference[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad_h, reference[1], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad_w, reference[2], atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss_type,mode,kl", EMPTY_COUNTED_CASES)
def test_micro_batch_invariance_counting_empty_sequences(loss_type, mode, kl):
    step = make_step()
    assert int((step["labels"] != IGNORE).any(-1).sum()) == 7  # one of the 8 sequences is empty
    rows = list(range(8))
    reference = run_step(_config(loss_type, mode, kl, count_empty=True), step, [rows], "hidden")
    for parts in (2, 8):
        loss, grad_h, grad_w, _ = run_step(_config(loss_type, mode, kl, True), step, split(rows, parts), "hidden")
        torch.testing.assert_close(loss, reference[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad_h, reference[1], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad_w, reference[2], atol=1e-6, rtol=0)
    # S = 8 instead of 7: the policy gradient (and the KL's) is 7/8 of the one without the empty sequence counted
    without = run_step(_config(loss_type, mode, kl), step, [rows], "hidden")
    torch.testing.assert_close(reference[2], without[2] * 7 / 8, atol=1e-9, rtol=1e-6)  # float32 weights


def test_permuting_sequences_leaves_the_loss_unchanged():
    cfg = _config("gspo", None, True)
    step = make_step(seed=3)
    loss = run_step(cfg, step, [list(range(8))])[0]
    permuted = run_step(cfg, step, split([5, 2, 7, 0, 3, 6, 1, 4], 2))[0]
    torch.testing.assert_close(loss, permuted, atol=1e-6, rtol=0)


def _rank_split_worker(rank, world_size, out_dir):
    results = {}
    cases = [(*case, False) for case in CASES] + [(*case, True) for case in EMPTY_COUNTED_CASES]
    for loss_type, mode, kl, count_empty in cases:
        for path in ("logprobs", "hidden"):
            cfg = _config(loss_type, mode, kl, count_empty)
            step = make_step()
            mine = list(range(8))[rank::world_size]  # interleaved rows: ranks hold unequal token counts
            loss, _, grad_w, metrics = run_step(cfg, step, split(mine, 2), path)
            results[(loss_type, mode, kl, count_empty, path)] = averaged_over_ranks(loss, grad_w, metrics)
    if rank == 0:
        torch.save(results, f"{out_dir}/results.pt")


@pytest.mark.distributed
def test_two_process_invariance(tmp_path):
    run_distributed(_rank_split_worker, 2, str(tmp_path), timeout=180)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    assert len(results) == 2 * (len(CASES) + len(EMPTY_COUNTED_CASES))
    for (loss_type, mode, kl, count_empty, path), result in results.items():
        assert_equals_one_process(result, _config(loss_type, mode, kl, count_empty), make_step(), path)
