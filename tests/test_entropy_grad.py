"""The entropy's gradient in the chunked path (issue 12 item 1, kernel part): an objective of the log-probs *and*
the full-vocabulary entropies, differentiated through ∂H/∂z_v = −p_v (log p_v + H) in the chunk pass, against
autograd through full logits in float64 (with and without softcapping), and finite differences."""

import pytest
import torch
from _chunked import assert_directional_derivatives, assert_matches_full_logits, random_head_problem

from hf_rlloss import chunked_objective

TEMP = 0.7


def _problem(tokens=19, vocab=40, hidden=6, seed=0):
    h, w, labels, g = random_head_problem(tokens, vocab, hidden, seed)
    a, b = torch.randn(tokens, generator=g, dtype=torch.float64), torch.randn(tokens, generator=g, dtype=torch.float64)

    def objective(lp, sl, entropy):  # non-linear in both, coupled: a policy term and an entropy bonus
        return (a[sl] * lp + b[sl] * entropy + 0.2 * entropy.square() + 0.1 * lp * entropy).sum(), {}

    return h, w, labels, objective


def _with_entropy_grad(h, w, labels, objective, **kwargs):
    """The chunked objective's value with the entropy and its gradient, at temperature `TEMP`."""
    return chunked_objective(
        h, w, labels, objective, temperature=TEMP, with_entropy=True, entropy_grad=True, **kwargs
    )[0]


def _naive(h, w, labels, objective, softcap):
    z = h @ w.t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / TEMP, -1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return objective(log_p.gather(-1, labels[:, None]).squeeze(-1), slice(None), entropy)[0]


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_entropy_gradient_matches_full_logits_float64(softcap):
    h, w, labels, objective = _problem()

    def via_chunks(h, w):
        return _with_entropy_grad(h, w, labels, objective, chunk_size=5, softcap=softcap)

    grads = assert_matches_full_logits(via_chunks, lambda h, w: _naive(h, w, labels, objective, softcap), h, w)
    # without entropy_grad the entropy is a constant: the gradient differs (the test is not vacuous)
    hh2 = h.clone().requires_grad_(True)
    frozen = chunked_objective(
        hh2, w, labels, objective, temperature=TEMP, chunk_size=5, with_entropy=True, softcap=softcap
    )[0]
    assert float((torch.autograd.grad(frozen, hh2)[0] - grads[0]).abs().max()) > 1e-3
    assert_directional_derivatives(via_chunks, h, w, grads, atol=1e-6)


def test_entropy_only_objective_and_bad_flag():
    h, w, labels, _ = _problem(tokens=7)
    hh = h.clone().requires_grad_(True)
    value = _with_entropy_grad(hh, w, labels, lambda lp, sl, e: (e.sum(), {}))
    naive = _naive(hh, w, labels, lambda lp, sl, e: (e.sum(), {}), None)
    torch.testing.assert_close(torch.autograd.grad(value, hh)[0], torch.autograd.grad(naive, hh)[0])
    with pytest.raises(ValueError, match="with_entropy=True"):
        chunked_objective(h, w, labels, lambda lp, sl, e: (lp.sum(), {}), entropy_grad=True)


def test_half_path_entropy_gradient_close_to_float64():
    h, w, labels, objective = _problem(tokens=64, vocab=512, hidden=32)
    h, w = h / 4, w
    runs = []
    for dtype in (torch.bfloat16, torch.float64):
        hh, ww = h.to(dtype).requires_grad_(True), w.to(dtype).requires_grad_(True)
        value = _with_entropy_grad(hh, ww, labels, objective, chunk_size=24, compile_epilogue=False)
        value.backward()
        runs.append((value.double(), hh.grad.double(), ww.grad.double()))
    (v16, gh16, gw16), (v64, gh64, gw64) = runs
    assert abs(float(v16 - v64)) < 2e-2 * abs(float(v64))
    assert float((gh16 - gh64).norm() / gh64.norm()) < 3e-2
    assert float((gw16 - gw64).norm() / gw64.norm()) < 3e-2


def _step_loss(cfg, h, w, labels_per_mb, advantages):
    """Sum over the step's micro-batches of the context's loss from hidden states, and its gradients."""
    from hf_rlloss import GRPOLossContext

    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    contexts = [cfg.build({"shifted_labels": labels, "advantages": advantages}) for labels in labels_per_mb]
    GRPOLossContext.build_batches(contexts)
    total, start = 0.0, 0
    for ctx, labels in zip(contexts, labels_per_mb):
        rows = slice(start, start + labels.shape[0] * labels.shape[1])
        start = rows.stop
        loss, metrics = ctx(hidden_states=h[rows].reshape(*labels.shape, -1), head_weight=w, temperature=TEMP)
        total = total + loss
    return total, torch.autograd.grad(total, (h, w))


def test_entropy_bonus_is_minus_coef_times_the_micro_batch_mean_entropy():
    """Closed form: the bonus of a step of M micro-batches is −coef · Σ_mb mean_{t∈mb}(H_t) / M (TRL's per-micro-batch
    mean, so micro-batches of 6 and 4 valid tokens weigh their tokens differently), value and gradient."""
    from hf_rlloss import GRPOLossConfig

    h, w, _, _ = _problem(tokens=12, vocab=30)
    labels = torch.randint(0, 30, (12,), generator=torch.Generator().manual_seed(3))
    mb1, mb2 = labels[:6].reshape(2, 3).clone(), labels[6:].reshape(2, 3).clone()
    mb2[0, 1:] = -100  # 6 valid tokens in mb1, 4 in mb2: the per-micro-batch means differ from the step's mean
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    coef = 0.3
    with_bonus, grads = _step_loss(GRPOLossConfig(entropy_coef=coef, chunk_size=4), h, w, [mb1, mb2], advantages)
    without, grads0 = _step_loss(GRPOLossConfig(chunk_size=4), h, w, [mb1, mb2], advantages)

    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    log_p = torch.log_softmax(hh @ ww.t() / TEMP, -1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    valid = torch.cat([mb1.reshape(-1), mb2.reshape(-1)]) != -100
    bonus = sum(-coef * entropy[rows][valid[rows]].mean() / 2 for rows in (slice(0, 6), slice(6, 12)))
    torch.testing.assert_close(with_bonus - without, bonus)
    for g, g0, want in zip(grads, grads0, torch.autograd.grad(bonus, (hh, ww))):
        torch.testing.assert_close(g - g0, want)
    assert float(bonus) < -1e-2


def test_entropy_bonus_config_and_logprob_path():
    from pydantic import ValidationError

    from hf_rlloss import GRPOLossConfig

    with pytest.raises(ValidationError, match="entropy_coef"):
        GRPOLossConfig(entropy_coef=float("nan"))
    cfg = GRPOLossConfig(entropy_coef=0.1)
    ctx = cfg.build({"shifted_labels": torch.tensor([[1, 2]]), "advantages": torch.tensor([1.0])})
    type(ctx).build_batches([ctx])
    with pytest.raises(ValueError, match="entropy_coef=0.1: the entropy bonus needs"):
        ctx(logprobs=torch.tensor([[-1.0, -2.0]]))


@pytest.mark.parametrize("coef", [0.0, 0.3])
def test_top_entropy_quantile_closed_form(coef):
    """Only tokens with H ≥ the (1 − ρ) quantile (torch.quantile over the micro-batch's valid tokens) keep their policy
    loss; the denominator stays the valid-token count; the bonus is the kept tokens' mean entropy."""
    from hf_rlloss import GRPOLossConfig, GRPOLossContext

    h, w, _, _ = _problem(tokens=12, vocab=30)
    labels = torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(5))
    labels[1, 4:] = -100
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    rho = 0.3
    cfg = GRPOLossConfig(top_entropy_quantile=rho, entropy_coef=coef, chunk_size=4)
    ctx = cfg.build({"shifted_labels": labels, "advantages": advantages})
    GRPOLossContext.build_batches([ctx])
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, _ = ctx(hidden_states=hh.reshape(2, 6, -1), head_weight=ww, temperature=TEMP)
    grads = torch.autograd.grad(loss, (hh, ww))

    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    valid = labels.reshape(-1) != -100
    log_p = torch.log_softmax(h2 @ w2.t() / TEMP, -1)[valid]
    entropy = -(log_p.exp() * log_p).sum(-1)
    lp = log_p.gather(-1, labels.reshape(-1)[valid][:, None]).squeeze(-1)
    keep = entropy.detach() >= torch.quantile(entropy.detach(), 1 - rho)
    assert 0 < int(keep.sum()) < int(valid.sum())  # the mask is not trivial
    adv = advantages.repeat_interleave(6)[valid]
    ratio = (lp - lp.detach()).exp()  # on-policy: old log-probs are the current ones
    naive = (-(adv * ratio) * keep).sum() / valid.sum() - coef * entropy[keep].mean()
    torch.testing.assert_close(loss, naive)
    for got, want in zip(grads, torch.autograd.grad(naive, (h2, w2))):
        torch.testing.assert_close(got, want)


def _quantile_worker(rank, world_size, out_dir):
    """Each rank holds one row of the micro-batch: the quantile is taken over both ranks' tokens (TRL's gather)."""
    from hf_rlloss import GRPOLossContext
    from hf_rlloss.parallel.collectives import all_reduce

    h, w, labels, advantages, cfg = _quantile_problem()
    ctx = cfg.build({"shifted_labels": labels[rank : rank + 1], "advantages": advantages[rank : rank + 1]})
    GRPOLossContext.build_batches([ctx])
    ww = w.clone().requires_grad_(True)
    loss, _ = ctx(hidden_states=h.reshape(2, 6, -1)[rank : rank + 1], head_weight=ww, temperature=TEMP)
    grad = torch.autograd.grad(loss, ww)[0]
    all_reduce(grad)  # DDP: the mean over ranks of the rank losses' gradients (each multiplied by grad_scale=2)
    total = loss.detach().clone()
    all_reduce(total)
    if rank == 0:
        torch.save((total / world_size, grad / world_size), f"{out_dir}/quantile.pt")


def _quantile_problem():
    from hf_rlloss import GRPOLossConfig

    h, w, _, _ = _problem(tokens=12, vocab=30)
    labels = torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(5))
    labels[1, 4:] = -100
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    return h, w, labels, advantages, GRPOLossConfig(top_entropy_quantile=0.5, chunk_size=4)


@pytest.mark.distributed
def test_top_entropy_quantile_is_gathered_over_ranks(tmp_path):
    from _dist import run_distributed

    from hf_rlloss import GRPOLossContext

    run_distributed(_quantile_worker, 2, str(tmp_path), timeout=300)
    loss, grad = torch.load(tmp_path / "quantile.pt")
    h, w, labels, advantages, cfg = _quantile_problem()
    ctx = cfg.build({"shifted_labels": labels, "advantages": advantages})
    GRPOLossContext.build_batches([ctx])
    ww = w.clone().requires_grad_(True)
    ref, _ = ctx(hidden_states=h.reshape(2, 6, -1), head_weight=ww, temperature=TEMP)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, torch.autograd.grad(ref, ww)[0])
    # a per-rank quantile would keep other tokens: the test is not vacuous
    log_p = torch.log_softmax(h @ w.t() / TEMP, -1)
    entropy = -(log_p.exp() * log_p).sum(-1).reshape(2, 6)
    valid = labels != -100
    everywhere = torch.quantile(entropy[valid], 0.5)
    per_rank = [torch.quantile(entropy[r][valid[r]], 0.5) for r in range(2)]
    assert any(
        not torch.equal(entropy[r][valid[r]] >= everywhere, entropy[r][valid[r]] >= per_rank[r]) for r in range(2)
    )
