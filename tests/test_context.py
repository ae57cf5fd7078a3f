"""The context's contract: layouts, the chunked hidden-state path, bad input, empty micro-batches."""

import sys

import pytest
import torch
import yaml
from _chunked import assert_directional_derivatives
from _data import IGNORE, logprobs_of, make_step, run_step
from pydantic import ValidationError

from hf_rlloss import (
    GRPOLossConfig,
    GRPOLossContext,
    accumulate_metrics,
    chunked_logprobs,
    chunked_objective,
    finalize_train_policy_metrics,
)


def _ctx(cfg=None, **data):
    cfg = cfg or GRPOLossConfig()
    ctx = cfg.build(data)
    GRPOLossContext.build_batches([ctx])
    return ctx


# ---------------------------------------------------------------------------------------------------- layouts


def test_packed_row_equals_padded_batch():
    step = make_step(num_seqs=4, length=5, seed=1)
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "gspo"}, use_kl_loss=True, kl_loss_type="k2")
    padded_loss, _, padded_grad_w, padded_metrics = run_step(cfg, step, [[0, 1, 2, 3]])

    # pack the four rows (with their padding) into one row; per-sequence advantages via num_tokens
    w = step["w"].clone().requires_grad_(True)
    lp = logprobs_of(step["h"], w, step["labels"]).reshape(1, -1)
    ctx = cfg.build(
        {
            "shifted_labels": step["labels"].reshape(1, -1),
            "num_tokens": [5, 5, 5, 5],
            "advantages": step["advantages"],
            "old_logprobs": step["old"].reshape(1, -1),
            "ref_logprobs": step["ref"].reshape(1, -1),
        }
    )
    GRPOLossContext.build_batches([ctx])
    loss, metrics = ctx(logprobs=lp)
    torch.testing.assert_close(loss.detach(), padded_loss)
    torch.testing.assert_close(torch.autograd.grad(loss, w)[0], padded_grad_w)
    assert finalize_train_policy_metrics(metrics) == pytest.approx(finalize_train_policy_metrics(padded_metrics))


def test_per_token_advantages_equal_broadcast_per_sequence_ones():
    labels = torch.tensor([[1, 2, IGNORE], [3, 4, 5]])
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.0, -1.5]])
    a = _ctx(shifted_labels=labels, advantages=torch.tensor([0.5, -1.0]))(logprobs=lp)[0]
    b = _ctx(shifted_labels=labels, advantages=torch.tensor([[0.5] * 3, [-1.0] * 3]))(logprobs=lp)[0]
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------------- hidden path


@pytest.mark.parametrize("loss_type", ["vanilla", "gspo", "cispo", "gpg", "sapo", "geo_mean"])
def test_hidden_path_equals_logprob_path(loss_type):
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": loss_type}, use_kl_loss=True, kl_loss_type="k3+", chunk_size=4)
    step = make_step(seed=2)
    a = run_step(cfg, step, [list(range(8))], "logprobs")
    b = run_step(cfg, step, [list(range(8))], "hidden")
    for x, y in zip(a[:3], b[:3]):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)


def test_chunked_objective_gradcheck_and_temperature():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 9, (7,), generator=g)
    coef = torch.randn(7, dtype=torch.float64, generator=g)

    def objective(lp, sl, entropy):
        return (coef[sl] * lp + 0.3 * lp.square()).sum(), {}

    def via_chunks(h, w):
        return chunked_objective(h, w, labels, objective, temperature=0.7, chunk_size=3)[0]

    def naive(h, w):
        lp = torch.log_softmax(h @ w.t() / 0.7, -1).gather(-1, labels[:, None]).squeeze(-1)
        return objective(lp, slice(None), None)[0]

    torch.testing.assert_close(via_chunks(h, w), naive(h, w))
    grads = torch.autograd.grad(via_chunks(h, w), (h, w))
    torch.testing.assert_close(grads, torch.autograd.grad(naive(h, w), (h, w)))
    assert_directional_derivatives(via_chunks, h, w, grads, atol=1e-7)


def test_chunked_loss_refuses_a_second_backward():
    h = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    value, _ = chunked_objective(h, w, torch.tensor([0, 1, 2]), lambda lp, sl, e: (lp.sum(), {}))
    value.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="hands them over once"):
        value.backward()


def test_chunked_logprobs_and_entropy_match_naive():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(10, 6, generator=g), torch.randn(50, 6, generator=g)
    labels = torch.randint(0, 50, (10,), generator=g)
    lp, entropy = chunked_logprobs(h, w, labels, chunk_size=4, with_entropy=True, temperature=1.3)
    log_p = torch.log_softmax(h @ w.t() / 1.3, -1)
    torch.testing.assert_close(lp, log_p.gather(-1, labels[:, None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1))


def test_entropy_metric_is_the_full_vocabulary_entropy():
    step = make_step(seed=4)
    _, _, _, metrics = run_step(GRPOLossConfig(chunk_size=5), step, [list(range(8))], "hidden")
    mask = step["labels"] != IGNORE
    log_p = torch.log_softmax(step["h"] @ step["w"].t(), -1)
    expected = (-(log_p.exp() * log_p).sum(-1))[mask].mean().item()
    assert finalize_train_policy_metrics(metrics)["train_policy/entropy"] == pytest.approx(expected)


def test_bf16_hidden_states_train():
    step = make_step(seed=5, dtype=torch.float32)
    h = step["h"].bfloat16().requires_grad_(True)
    w = step["w"].bfloat16().requires_grad_(True)
    ctx = _ctx(shifted_labels=step["labels"], advantages=step["advantages"])
    loss, _ = ctx(hidden_states=h, head_weight=w)
    loss.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    reference = run_step(
        GRPOLossConfig(),
        {**step, "old": logprobs_of(step["h"], step["w"], step["labels"])},
        [list(range(8))],
        "hidden",
    )
    torch.testing.assert_close(loss.detach().double(), reference[0].double(), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------------- on-policy


def test_on_policy_first_iteration_has_unit_ratio():
    step = make_step(seed=6)
    cfg = GRPOLossConfig()
    ctx = cfg.build({"shifted_labels": step["labels"], "advantages": step["advantages"]})  # no old log-probs
    GRPOLossContext.build_batches([ctx])
    _, metrics = ctx(hidden_states=step["h"], head_weight=step["w"])
    final = finalize_train_policy_metrics(metrics)
    assert final["train_policy/ratio_abs_dev_mean"] < 1e-6
    assert abs(final["train_policy/kl1"]) < 1e-6
    assert final["train_policy/ratio_max"] == pytest.approx(1.0) and final["train_policy/ratio_min"] == pytest.approx(
        1
    )


# ---------------------------------------------------------------------------------------------------- empty input


@pytest.mark.parametrize("path", ["logprobs", "hidden"])
def test_all_masked_micro_batch_gives_connected_zero_loss(path):
    labels = torch.full((2, 4), IGNORE)
    h = torch.randn(2, 4, 3, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    ctx = _ctx(
        GRPOLossConfig(use_kl_loss=True, kl_loss_type="k3"),
        shifted_labels=labels,
        advantages=torch.tensor([1.0, float("nan")]),
        ref_logprobs=torch.zeros(2, 4),
    )
    if path == "logprobs":
        loss, metrics = ctx(logprobs=logprobs_of(h, w, labels))
    else:
        loss, metrics = ctx(hidden_states=h, head_weight=w)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.all(w.grad == 0) and torch.all(h.grad == 0)
    final = finalize_train_policy_metrics(accumulate_metrics({}, metrics))
    assert all(v == v and abs(v) != float("inf") for v in final.values()), final  # no NaN / inf anywhere
    assert final["train_policy/valid_tokens"] == 0 and final["train_policy/ratio_max"] == 0.0


def test_mixed_empty_and_full_micro_batches():
    step = make_step(seed=7)
    cfg = GRPOLossConfig()
    full = run_step(cfg, step, [list(range(8))])
    empty_step = {**step, "labels": torch.cat([step["labels"], torch.full((2, 6), IGNORE)])}
    for key in ("h", "old", "ref", "advantages"):
        empty_step[key] = torch.cat([step[key], step[key][:2]])
    split = run_step(cfg, empty_step, [[8, 9], list(range(8))])
    torch.testing.assert_close(split[0], full[0])
    torch.testing.assert_close(split[2], full[2])


# ---------------------------------------------------------------------------------------------------- bad input


def test_shape_mismatches_name_the_field_and_both_shapes():
    labels = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\).*sequence \(2\)"):
        GRPOLossConfig().build({"shifted_labels": labels, "advantages": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 4\) but shifted_labels has shape \(2, 3\)"):
        GRPOLossConfig().build(
            {"shifted_labels": labels, "advantages": torch.zeros(2), "old_logprobs": torch.zeros(2, 4)}
        )
    ctx = GRPOLossConfig().build({"shifted_labels": labels, "advantages": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(1, 3\) but shifted_labels has shape \(2, 3\)"):
        ctx.loss_kwargs.ref_logprobs = torch.zeros(1, 3)
    assert ctx.loss_kwargs.ref_logprobs is None  # the rejected assignment changed nothing
    GRPOLossContext.build_batches([ctx])
    with pytest.raises(ValueError, match=r"logprobs has shape \(2, 2\) but shifted_labels has shape \(2, 3\)"):
        ctx(logprobs=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"hidden_states has shape \(2, 4, 5\)"):
        ctx(hidden_states=torch.zeros(2, 4, 5), head_weight=torch.zeros(7, 5))
    with pytest.raises(ValueError, match=r"head_weight has shape \(7, 4\); expected \(V, 5\)"):
        ctx(hidden_states=torch.zeros(2, 3, 5), head_weight=torch.zeros(7, 4))
    with pytest.raises(ValueError, match=r"shifted_labels must be a 2-D \(B, T\) tensor; got \(3,\)"):
        GRPOLossConfig().build({"shifted_labels": torch.zeros(3, dtype=torch.long), "advantages": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"num_tokens \[2, 2\] must .* sum to the packed length 5"):
        GRPOLossConfig().build(
            {"shifted_labels": torch.zeros(1, 5, dtype=torch.long), "num_tokens": [2, 2], "advantages": torch.zeros(2)}
        )
    with pytest.raises(ValueError, match=r"unknown data key\(s\) \['old_logprob'\]"):
        GRPOLossConfig().build({"shifted_labels": labels, "advantages": torch.zeros(2), "old_logprob": labels})


def test_missing_required_keys_return_none():
    assert GRPOLossConfig().build({"shifted_labels": torch.zeros(1, 2, dtype=torch.long)}) is None


@pytest.mark.parametrize("field", ["advantages", "old_logprobs", "ref_logprobs", "rollout_is_weights"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_inputs_error_names_field_and_micro_batch(field, bad):
    labels = torch.tensor([[1, 2, IGNORE]])
    data = {
        "shifted_labels": labels,
        "advantages": torch.ones(1, 3),
        "old_logprobs": -torch.ones(1, 3),
        "ref_logprobs": -torch.ones(1, 3),
        "rollout_is_weights": torch.ones(1, 3),
    }
    data[field] = data[field].clone()
    data[field][0, 1] = bad
    cfg = GRPOLossConfig(use_kl_loss=True, kl_loss_type="k1")
    good = cfg.build({**data, field: torch.ones(1, 3) * (1 if field in ("advantages", "rollout_is_weights") else -1)})
    with pytest.raises(ValueError, match=rf"{field} of micro-batch 1 has 1 non-finite value"):
        GRPOLossContext.build_batches([good, cfg.build(data)])

    # a bad value at an ignored position is harmless
    data[field][0, 1], data[field][0, 2] = 1.0 if field in ("advantages", "rollout_is_weights") else -1.0, bad
    _ctx(cfg, **data)(logprobs=-torch.ones(1, 3))

    # mask mode: the token is dropped before the denominator and counted; the caller's labels are untouched
    data[field][0, 1] = bad
    cfg = GRPOLossConfig(use_kl_loss=True, kl_loss_type="k1", nonfinite_inputs="mask")
    ctx = _ctx(cfg, **data)
    loss, metrics = ctx(logprobs=-torch.ones(1, 3, requires_grad=True))
    assert torch.isfinite(loss)
    assert labels.tolist() == [[1, 2, IGNORE]]
    final = finalize_train_policy_metrics(metrics)
    assert final["train_policy/nonfinite_masked_tokens"] == 1 and final["train_policy/valid_tokens"] == 1
    assert ctx.loss_kwargs.global_grad_tokens.item() == 1


def test_nonfinite_current_logprobs_raise():
    ctx = _ctx(shifted_labels=torch.tensor([[1, 2]]), advantages=torch.ones(1))
    with pytest.raises(FloatingPointError, match="logprobs has 1 non-finite"):
        ctx(logprobs=torch.tensor([[-1.0, float("nan")]]))


def test_nonfinite_loss_raises_before_backward_with_metrics():
    # a finite but huge advantage overflows the float32 loss: the error carries the metrics that led to it
    ctx = _ctx(
        shifted_labels=torch.tensor([[1]]), advantages=torch.tensor([3e38]), old_logprobs=torch.tensor([[-9.0]])
    )
    with pytest.raises(FloatingPointError, match="not finite.*train_policy/ratio_max"):
        ctx(logprobs=torch.tensor([[0.0]]))


def test_call_before_build_batches_and_wrong_arguments():
    ctx = GRPOLossConfig().build({"shifted_labels": torch.zeros(1, 2, dtype=torch.long), "advantages": torch.ones(1)})
    with pytest.raises(RuntimeError, match="build_batches"):
        ctx(logprobs=torch.zeros(1, 2))
    GRPOLossContext.build_batches([ctx])
    with pytest.raises(ValueError, match="exactly one"):
        ctx()
    with pytest.raises(ValueError, match="head_weight"):
        ctx(hidden_states=torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="empty list"):
        GRPOLossContext.build_batches([])


def test_kl_without_ref_logprobs_fails_at_build_batches():
    ctx = GRPOLossConfig(use_kl_loss=True, kl_loss_type="k3").build(
        {"shifted_labels": torch.zeros(1, 2, dtype=torch.long), "advantages": torch.ones(1)}
    )
    with pytest.raises(ValueError, match="micro-batch 0 has no ref_logprobs"):
        GRPOLossContext.build_batches([ctx])


# ---------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"policy_loss_cfg": {"loss_type": "ppo2"}}, r"loss_type='ppo2' is not registered; allowed: vanilla, gspo"),
        ({"policy_loss_cfg": {"cliprange_low": 1.0}}, r"cliprange_low=1.0 must be in \[0, 1\)"),
        ({"policy_loss_cfg": {"cliprange_low": -0.1}}, r"cliprange_low=-0.1 must be in \[0, 1\)"),
        ({"policy_loss_cfg": {"cliprange_high": -0.1}}, r"cliprange_high=-0.1 must be >= 0"),
        ({"policy_loss_cfg": {"clip_ratio_c": 0.5}}, r"clip_ratio_c=0.5 must be > 1"),
        ({"policy_loss_cfg": {"log_prob_diff_min": 1, "log_prob_diff_max": 0}}, "log_prob_diff_min=1.0 must be <"),
        ({"policy_loss_cfg": {"cliprange": 0.2}}, r"unknown key\(s\) \['cliprange'\] for loss_type='vanilla'"),
        ({"policy_loss_cfg": {"loss_type": "no_such_pkg.fn"}}, "cannot import"),
        ({"use_kl_loss": True}, "use_kl_loss=True needs kl_loss_type, one of: kl, k1, abs"),
        ({"kl_loss_type": "k4"}, "kl_loss_type"),
        ({"kl_loss_coef": -1}, "kl_loss_coef"),
        ({"loss_agg_mode": "token-sum"}, "loss_agg_mode"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "needs loss_scale_factor"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"nonfinite_inputs": "ignore"}, "nonfinite_inputs"),
        ({"mode": "chunk"}, "mode"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        GRPOLossConfig(**kwargs)


def test_config_validates_assignment():
    cfg = GRPOLossConfig()
    with pytest.raises(ValidationError, match="kl_loss_coef"):
        cfg.kl_loss_coef = -1.0
    with pytest.raises(ValidationError, match="cliprange_low"):
        cfg.policy_loss_cfg.cliprange_low = 2.0


def test_config_round_trips_through_yaml():
    cfg = GRPOLossConfig(
        policy_loss_cfg={"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28, "clip_ratio_c": 10},
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_scale_factor=1024,
    )
    text = yaml.safe_dump(cfg.to_dict())
    again = GRPOLossConfig(**yaml.safe_load(text))
    assert again == cfg and again.to_dict() == cfg.to_dict()
    assert cfg.policy_loss_cfg["loss_type"] == "vanilla"  # XTuner-style access


def test_default_chunk_size_keeps_the_block_near_128_mb():
    from hf_rlloss.loss.chunked_logprobs import default_chunk_size

    assert [default_chunk_size(v) for v in (49152, 151936, 32000, 64, 10**7)] == [512, 256, 1024, 2048, 64]
    assert [default_chunk_size(v, torch.bfloat16) for v in (49152, 151936)] == [1024, 512]  # half the bytes
    assert GRPOLossConfig().chunk_size is None  # resolved from the head weight's vocabulary at call time


# ---------------------------------------------------------------------------------------------------- half precision

_HALF_CASES = {
    # name: (input dtype, matmul dtype, log-prob tolerance as a fraction of max |logit / T|, gradient tolerance
    # (relative, in norm)). Rounding a logit z to bf16 (fp16) moves it by at most 2⁻⁸|z| (2⁻¹¹|z|), and the
    # log-normalizer is a softmax-weighted mean of those moves; float32 weights add their own rounding to bf16.
    "bf16": (torch.bfloat16, None, 2**-8, 1e-2),
    "fp16": (torch.float16, None, 2**-11, 2e-3),
    "fp32 weights, bf16 GEMMs": (torch.float32, torch.bfloat16, 2 * 2**-8, 1.2e-2),
}


def _half_problem(tokens=192, vocab=2048, hidden=64, seed=0):
    """Realistic logits (std ≈ 3.5 at T = 0.8): the bf16 rounding of the logits grows with their magnitude."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g) / hidden**0.5
    w = torch.randn(vocab, hidden, generator=g) * 2.8
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    coef = torch.randn(tokens, generator=g, dtype=torch.float64)

    def objective(lp, sl, entropy):  # policy-gradient-like, sensitive to the log-probs' values
        lp = lp.double()
        return (coef[sl] * lp + 0.05 * lp.square()).sum() / tokens, {}

    return h, w, labels, objective


def _run_chunked(h, w, labels, objective, **kwargs):
    h, w = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    value, _ = chunked_objective(h, w, labels, objective, temperature=0.8, chunk_size=80, **kwargs)
    value.backward()
    kwargs.pop("with_entropy", None)
    lp, entropy = chunked_logprobs(
        h.detach(), w.detach(), labels, temperature=0.8, chunk_size=80, with_entropy=True, **kwargs
    )
    return value.detach(), lp, entropy, h.grad, w.grad


@pytest.mark.parametrize("case", list(_HALF_CASES))
def test_half_path_matches_float64(case):
    """bf16/fp16 GEMMs: float32 statistics and outputs, gradients in the inputs' dtypes, errors against float64 on
    the same inputs within the tolerances stated in `hf_rlloss.loss.chunked_logprobs`."""
    dtype, matmul_dtype, lp_rel, grad_tol = _HALF_CASES[case]
    h, w, labels, objective = _half_problem()
    h, w = h.to(dtype), w.to(dtype)
    lp_tol = lp_rel * float((h.double() @ w.double().t()).abs().max()) / 0.8 + 1e-5
    value, lp, entropy, grad_h, grad_w = _run_chunked(
        h, w, labels, objective, matmul_dtype=matmul_dtype, compile_epilogue=False
    )
    ref = _run_chunked(h.double(), w.double(), labels, objective)
    assert lp.dtype == entropy.dtype == torch.float32 and (grad_h.dtype, grad_w.dtype) == (dtype, dtype)
    assert float((lp.double() - ref[1]).abs().max()) < lp_tol
    assert float((entropy.double() - ref[2]).abs().max()) < 2 * lp_tol
    assert abs(float(value) - float(ref[0])) < 1e-3 * abs(float(ref[0]))
    for grad, ref_grad in ((grad_h, ref[3]), (grad_w, ref[4])):
        assert float((grad.double() - ref_grad).norm() / ref_grad.norm()) < grad_tol
    # float32 is unchanged: tight
    f32 = _run_chunked(h.float(), w.float(), labels, objective)
    torch.testing.assert_close(f32[1].double(), ref[1], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_epilogue_equals_the_eager_one(dtype):
    h, w, labels, objective = _half_problem(tokens=200)  # 200 = 2 full chunks + a partial one: dynamic rows
    eager = _run_chunked(h.to(dtype), w.to(dtype), labels, objective, compile_epilogue=False)
    compiled = _run_chunked(h.to(dtype), w.to(dtype), labels, objective, compile_epilogue=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the gradient block is rounded after different math
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a.double(), b.double(), atol=tol * float(a.abs().max()), rtol=0)


@pytest.mark.slow
def test_compiled_epilogue_is_dynamic_in_rows_and_specialized_to_the_vocabulary(monkeypatch):
    # Inductor picks a kernel's vector width and parallelism from the sizes it first compiles for: a kernel compiled
    # dynamic in the vocabulary from a tiny test problem ran 5x slower at 49k. The rows must stay dynamic (the last,
    # shorter chunk must not recompile), the vocabulary of the first compile static.
    kernel = sys.modules["hf_rlloss.loss.chunked_logprobs"]
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    monkeypatch.setattr(kernel, "_compiled", {})
    counters.clear()
    block = torch.randn(64, 96).bfloat16()
    for rows in (64, 40, 17):
        stats, _ = kernel._run_epilogue("stats", True, block[:rows].clone(), 0.5, True)
        torch.testing.assert_close(stats, torch.logsumexp(block[:rows].float() * 0.5, -1), atol=1e-5, rtol=0)
    assert counters["stats"]["unique_graphs"] == 1
    kernel._run_epilogue("stats", True, torch.randn(16, 80).bfloat16(), 0.5, True)
    assert counters["stats"]["unique_graphs"] == 2  # a new vocabulary compiled anew: the first one was specialized
    assert kernel._compile_failed is None


def test_compiled_epilogue_default_by_dtype_and_vocabulary():
    use = sys.modules["hf_rlloss.loss.chunked_logprobs"]._use_compiled
    assert use(None, torch.bfloat16, 1000) and use(None, torch.float16, 49152)  # half: always
    assert use(None, torch.float32, 151936) and not use(None, torch.float32, 49152)  # float32: from 100k
    assert not use(None, torch.float64, 151936)  # float64 references stay eager
    assert not use(False, torch.bfloat16, 151936) and use(True, torch.float32, 100)  # an explicit choice wins


def test_compile_failure_falls_back_to_the_eager_epilogue(monkeypatch):
    kernel = sys.modules["hf_rlloss.loss.chunked_logprobs"]

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(kernel, "_compiled", {})
    monkeypatch.setattr(kernel, "_compile_failed", None)
    monkeypatch.setattr(kernel.torch, "compile", broken_compile)
    h, w, labels, objective = _half_problem(tokens=64, vocab=512)
    h, w = h.bfloat16(), w.bfloat16()
    with pytest.warns(UserWarning, match="torch.compile of the chunked-loss epilogue failed"):
        fallback = _run_chunked(h, w, labels, objective, compile_epilogue=True)
    assert "no C++ compiler" in kernel._compile_failed
    eager = _run_chunked(h, w, labels, objective, compile_epilogue=False)
    for a, b in zip(fallback, eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------- on-policy IS


@pytest.mark.parametrize("path", ["logprobs", "hidden"])
def test_deferred_rollout_is_equals_compute_rollout_is_with_the_detached_logprobs(path):
    """On-policy, metrics-only rollout IS from the loss's own log-probs (defer_rollout_is) = compute_rollout_is with
    old_logprobs set to those log-probs; non-finite rollout log-probs are rejected before build_batches in both."""
    step = make_step(seed=3)
    labels = step["labels"]
    rollout = logprobs_of(step["h"], step["w"], labels).detach() + 0.1 * torch.randn(labels.shape, dtype=torch.float64)
    rollout[0, 1], rollout[2, 0] = float("nan"), float("-inf")
    cfg = GRPOLossConfig(use_kl_loss=True, kl_loss_type="k3")
    data = {"shifted_labels": labels, "advantages": step["advantages"], "ref_logprobs": step["ref"]}
    results = []
    for deferred in (True, False):
        w = step["w"].clone().requires_grad_(True)
        lp = logprobs_of(step["h"], w, labels)
        ctx = cfg.build({**data, "rollout_logprobs": rollout})
        if deferred:
            ctx.defer_rollout_is()
        else:
            ctx.loss_kwargs.old_logprobs = lp.detach()
            ctx.compute_rollout_is()
        GRPOLossContext.build_batches([ctx])
        if path == "logprobs":
            loss, metrics = ctx(logprobs=lp)
        else:
            loss, metrics = ctx(hidden_states=step["h"], head_weight=w)
        results.append((loss.detach(), torch.autograd.grad(loss, w)[0], finalize_train_policy_metrics(metrics)))
    (loss_a, grad_a, m_a), (loss_b, grad_b, m_b) = results
    assert m_a["rollout_is/nonfinite_tokens"] == 2 and "mismatch/mismatch_kl" in m_a
    assert m_a.keys() == m_b.keys()
    for key in m_a:
        assert m_a[key] == pytest.approx(m_b[key], rel=1e-9, abs=1e-12), key
    torch.testing.assert_close(loss_a, loss_b, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(grad_a, grad_b, atol=1e-12, rtol=1e-12)


def test_defer_rollout_is_needs_metrics_only_is_and_no_old_logprobs():
    step = make_step(seed=4)
    data = {"shifted_labels": step["labels"], "advantages": step["advantages"], "rollout_logprobs": step["old"]}
    with pytest.raises(ValueError, match="needs old_logprobs before build_batches"):
        GRPOLossConfig(rollout_is={"upper": 2.0}).build(data).defer_rollout_is()
    with pytest.raises(ValueError, match="call compute_rollout_is"):
        GRPOLossConfig().build({**data, "old_logprobs": step["old"]}).defer_rollout_is()
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        GRPOLossConfig().build({k: v for k, v in data.items() if k != "rollout_logprobs"}).defer_rollout_is()
