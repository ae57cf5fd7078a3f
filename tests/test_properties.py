"""Property-based tests (hypothesis) of the invariants users get burned by: normalization across micro-batches,
permutation invariance, masks, SP split/gather, metric definitions."""

import math

import torch
from _data import IGNORE, logprobs_of, run_step
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_rlloss import (
    AGG_MODES,
    GRPOLossConfig,
    GRPOLossContext,
    accumulate_metrics,
    finalize_train_policy_metrics,
    sp_split,
)

LOSSES = ["vanilla", "gspo", "cispo", "gpg", "sapo", "geo_mean"]
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)


@st.composite
def steps(draw):
    """A random optimizer step: shapes, ragged masks (possibly empty rows), advantages, old/ref log-probs."""
    num_seqs = draw(st.integers(1, 6))
    length = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    vocab, hidden = 11, 4
    labels = torch.randint(0, vocab, (num_seqs, length), generator=g)
    keep = torch.rand(num_seqs, length, generator=g) < draw(st.floats(0.0, 1.0))
    labels = labels.masked_fill(~keep, IGNORE)
    h = torch.randn(num_seqs, length, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    lp = logprobs_of(h, w, labels).detach()
    step = {
        "labels": labels,
        "advantages": torch.randn(num_seqs, generator=g),
        "old": (lp + 0.2 * torch.randn(lp.shape, generator=g, dtype=torch.float64)).float(),
        "ref": (lp + 0.2 * torch.randn(lp.shape, generator=g, dtype=torch.float64)).float(),
        "rollout": lp.float(),
        "h": h,
        "w": w,
    }
    return step


def _config(loss_type, mode, kl=True):
    return GRPOLossConfig(
        policy_loss_cfg={"loss_type": loss_type},
        loss_agg_mode=mode,
        loss_scale_factor=7,
        use_kl_loss=kl,
        kl_loss_type="k3",
        chunk_size=3,
    )


@SETTINGS
@given(steps(), st.sampled_from(LOSSES), st.sampled_from(AGG_MODES), st.data())
def test_global_normalization_is_invariant_to_the_micro_batch_split(step, loss_type, mode, data):
    rows = list(range(step["labels"].shape[0]))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(rows) - 1, 1)), max_size=len(rows) - 1)))
    parts = [rows[a:b] for a, b in zip([0, *cuts], [*cuts, len(rows)]) if rows[a:b]]
    path = data.draw(st.sampled_from(["logprobs", "hidden"]))
    cfg = _config(loss_type, mode)
    whole = run_step(cfg, step, [rows], path)
    split = run_step(cfg, step, parts, path)
    for a, b in zip(whole[:3], split[:3]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@SETTINGS
@given(steps(), st.sampled_from(LOSSES), st.sampled_from(AGG_MODES), st.randoms(use_true_random=False))
def test_permuting_sequences_leaves_loss_and_metrics_unchanged(step, loss_type, mode, rnd):
    rows = list(range(step["labels"].shape[0]))
    permuted = rows[:]
    rnd.shuffle(permuted)
    cfg = _config(loss_type, mode)
    a, b = run_step(cfg, step, [rows]), run_step(cfg, step, [permuted])
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-6)
    fa, fb = finalize_train_policy_metrics(a[3]), finalize_train_policy_metrics(b[3])
    assert fa.keys() == fb.keys() and all(math.isclose(fa[k], fb[k], rel_tol=1e-5, abs_tol=1e-6) for k in fa)


@SETTINGS
@given(steps(), st.sampled_from(LOSSES))
def test_gradient_is_zero_where_the_mask_is_zero(step, loss_type):
    cfg = _config(loss_type, None)
    lp = logprobs_of(step["h"], step["w"], step["labels"]).detach().requires_grad_(True)
    ctx = cfg.build(
        {
            "shifted_labels": step["labels"],
            "advantages": step["advantages"],
            "old_logprobs": step["old"],
            "ref_logprobs": step["ref"],
        }
    )
    GRPOLossContext.build_batches([ctx])
    loss, _ = ctx(logprobs=lp)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.all(grad[step["labels"] == IGNORE] == 0)
    assert torch.isfinite(grad).all()


class _FakeMesh:
    """Just enough of a 1-D DeviceMesh for sp_split on one process: every rank's shard can be taken in turn."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 17), st.integers(-100, 100))
def test_sp_split_then_gather_is_identity_after_trimming(sp, batch, length, pad):
    x = torch.arange(batch * length).reshape(batch, length)
    shards = [sp_split(x, _FakeMesh(sp, r), 1, pad) for r in range(sp)]
    assert len({s.shape for s in shards}) == 1  # equal shards, as all_gather needs
    gathered = torch.cat(shards, dim=1)
    assert torch.equal(gathered[:, :length], x)
    assert torch.all(gathered[:, length:] == pad)


@SETTINGS
@given(steps())
def test_metrics_equal_their_definition_in_float64(step):
    cfg = _config("vanilla", None, kl=False)
    _, _, _, metrics = run_step(cfg, step, [list(range(step["labels"].shape[0]))])
    final = finalize_train_policy_metrics(accumulate_metrics({}, metrics))
    mask = step["labels"] != IGNORE
    lp = logprobs_of(step["h"], step["w"], step["labels"]).double()[mask]
    old = step["old"].double()[mask]
    log_r = (lp - old).clamp(-20, 20)
    r = log_r.exp()
    n = int(mask.sum())
    assert final["train_policy/valid_tokens"] == n
    if n == 0:
        assert all(v == 0.0 for k, v in final.items() if k.startswith("train_policy/")), final
        return
    expected = {
        "train_policy/ratio_abs_dev_mean": (r - 1).abs().mean(),
        "train_policy/kl1": -(lp - old).mean(),
        "train_policy/kl3": (r - 1 - log_r).mean(),
        "train_policy/ratio_max": r.max(),
        "train_policy/ratio_min": r.min(),
    }
    for key, value in expected.items():
        assert math.isclose(final[key], value.item(), rel_tol=1e-4, abs_tol=1e-6), (key, final[key], value.item())
