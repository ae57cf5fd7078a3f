"""The gradient-fidelity diagnostic: the sketch against full gradients, the statistics in closed form and on known
biases, and the controls on a tiny model (noise floor, lag 0 within the floor, an inverted IS weight detected as
worse)."""

import json

import numpy as np
import pytest
import torch
from _trainer_utils import make_model, make_tokenizer

from hf_rlloss.recipe_support.fidelity_stats import (
    DROP,
    FLOOR,
    bootstrap_p,
    bootstrap_p_error,
    drop_terms,
    fidelity_statistics,
    floor_terms,
    floor_with_independent_cross_term,
    prompt_terms,
    zero_advantage_bias_share,
)
from hf_rlloss.recipe_support.grad_sketch import CountSketch
from hf_rlloss.recipe_support.gradient_fidelity import (
    CORRECTIONS,
    GradientFidelity,
    Settings,
    build_parser,
    fidelity_report,
    format_report,
    trl_group_advantages,
    zero_advantage_prompts,
)


def _full_and_sketched(model, losses, sketch):
    params = [p for p in model.parameters() if p.requires_grad]
    full, sketched = [], []
    for loss in losses:
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        full.append(torch.cat([g.reshape(-1) for g in grads]).double())
        sketched.append(sketch(grads))
    return full, sketched


def test_the_sketch_preserves_cosines_and_norms_of_full_gradients():
    tok = make_tokenizer()
    model = make_model(tok, seed=0, hidden_size=64)
    sketch = CountSketch([(n, p.numel()) for n, p in model.named_parameters()], dim=8192, seed=0)
    torch.manual_seed(0)
    ids = torch.randint(3, len(tok), (6, 10))
    logprobs = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    # losses whose gradients are partly aligned: per-sequence log-likelihoods and mixtures of them
    weights = torch.randn(8, 6)
    losses = [(w[:, None] * logprobs).mean() for w in weights]
    full, sketched = _full_and_sketched(model, losses, sketch)
    assert sum(p.numel() for p in model.parameters()) > 3 * 8192  # the sketch compresses: buckets collide
    for i in range(len(losses)):
        assert sketched[i].norm() / full[i].norm() == pytest.approx(1.0, abs=0.05)
        for j in range(i):
            cos_full = torch.nn.functional.cosine_similarity(full[i], full[j], dim=0)
            cos_sketch = torch.nn.functional.cosine_similarity(sketched[i], sketched[j], dim=0)
            assert abs(float(cos_sketch - cos_full)) < 0.05, (i, j, float(cos_full), float(cos_sketch))


def test_the_sketch_is_linear_and_fixed_by_its_seed():
    shapes = [("a", 1000), ("b", 300)]
    grads = [torch.randn(1000), torch.randn(300)]
    others = [torch.randn(1000), torch.randn(300)]
    sketch = CountSketch(shapes, dim=64, seed=3)
    summed = sketch([g + o for g, o in zip(grads, others)])
    torch.testing.assert_close(summed, sketch(grads) + sketch(others), atol=1e-5, rtol=1e-5)  # float32 buckets
    torch.testing.assert_close(CountSketch(shapes, dim=64, seed=3)(grads), sketch(grads))
    assert not torch.allclose(CountSketch(shapes, dim=64, seed=4)(grads), sketch(grads))
    with pytest.raises(ValueError, match="2 parameters"):
        sketch(grads[:1])


def test_the_per_prompt_terms_in_closed_form():
    on = [np.array(v, dtype=float) for v in ([1, 0], [1, 1], [0, 1], [2, 0])]
    stale = [np.array([2.0, 1.0]), np.array([1.0, 2.0])]
    terms = prompt_terms(on, stale)
    assert terms == {
        "n": 1.0,  # ⟨o¹, o²⟩
        "b": (np.array([1, 1]) @ np.array([0, 1])),  # ⟨x¹ − o¹, x² − o²⟩ = 1
        "c": (1 + 2) / 2,  # (⟨x¹, o³⟩ + ⟨x², o⁴⟩) / 2
        "s": 4.0,  # ⟨x¹, x²⟩
        "v": 1.0,  # ‖x¹ − x²‖² / 2
    }


def test_the_statistics_in_closed_form():
    """Three prompts' terms: every statistic is a ratio of prompt means."""
    rows = [
        dict(n=2.0, b=0.5, c=1.0, s=3.0, v=4.0),
        dict(n=1.0, b=-0.2, c=0.5, s=1.0, v=2.0),
        dict(n=3.0, b=0.3, c=2.0, s=2.0, v=3.0),
    ]
    stats = fidelity_statistics({"x": rows}, batch_groups=2, resamples=10)["estimators"]["x"]
    n, b, c, s, v = 2.0, 0.2, 3.5 / 3, 2.0, 3.0  # prompt means
    assert stats["relative_bias_sq"]["value"] == pytest.approx(b / n)
    assert stats["relative_bias"]["value"] == pytest.approx(np.sqrt(b / n))
    assert stats["cosine"]["value"] == pytest.approx(c / np.sqrt(s * n))
    assert stats["relative_variance"]["value"] == pytest.approx(v / n)
    assert stats["relative_mse"]["value"] == pytest.approx((b + v / 2) / n)


def test_the_statistics_recover_a_known_bias_and_the_floor_holds_none():
    """Synthetic per-prompt gradients g_p, a known per-prompt bias of relative size 0.3, group noise of half a
    gradient coordinate: the bias is inside its interval, the floor's interval holds 0, the paired difference is
    detected."""
    rng = np.random.default_rng(0)
    prompts, dim = 300, 40
    g = rng.normal(size=(prompts, dim))
    bias = 0.3 * rng.normal(size=(prompts, dim))

    def group(mean):
        return mean + 0.5 * rng.normal(size=dim)

    floor, biased, unbiased = [], [], []
    for p in range(prompts):
        on = [group(g[p]) for _ in range(4)]
        floor.append(prompt_terms(on, on[2:]))
        stale = [group(g[p]) for _ in range(2)]  # both estimators read the same stale samples, as corrections do
        biased.append(prompt_terms(on, [x + bias[p] for x in stale]))
        unbiased.append(prompt_terms(on, stale))
    result = fidelity_statistics(
        {FLOOR: floor, "biased": biased, "unbiased": unbiased}, resamples=2000,
        differences={"biased - unbiased": ("biased", "unbiased")},
    )  # fmt: skip
    expected = np.sqrt((bias**2).sum() / (g**2).sum())
    estimate = result["estimators"]["biased"]["relative_bias"]
    assert estimate["ci_low"] < expected < estimate["ci_high"] and estimate["ci_low"] > 0.15
    for name in (FLOOR, "unbiased"):
        interval = result["estimators"][name]["relative_bias_sq"]
        assert interval["ci_low"] < 0 < interval["ci_high"], name
    assert result["differences"]["biased - unbiased"]["relative_bias_sq"]["ci_low"] > 0
    assert bootstrap_p(np.array([1.0, 2.0, -1.0, 3.0])) == pytest.approx(0.5)
    # one resample of ten below 0: q = 0.1, p = 0.2, its Monte-Carlo error 2 √(q (1 − q) / 10)
    tenth = np.array([-1.0] + [1.0] * 9)
    assert bootstrap_p(tenth) == pytest.approx(0.2) and bootstrap_p_error(tenth) == pytest.approx(2 * np.sqrt(0.009))


def test_the_noise_floors_terms_pair_only_independent_groups_and_its_cosine_reads_1():
    """The floor's cross term pairs o³ with o² and o⁴ with o¹ (never a group with itself): in closed form on fixed
    vectors, and on simulated groups (mean g, noise as large as g) its cosine's interval holds the known answer 1,
    where pairing o³ with itself reads far above 1 (the group's own variance in the numerator)."""
    o = [np.array([1.0, 0.0]), np.array([0.0, 2.0]), np.array([3.0, 1.0]), np.array([1.0, 1.0])]
    assert floor_terms(o) == pytest.approx(
        {"n": 0.0, "b": (3 - 1) * (1 - 0) + (1 - 0) * (1 - 2), "c": (2 + 1) / 2, "s": 4.0, "v": (4 + 0) / 2}
    )  # fmt: skip
    rng = np.random.default_rng(0)
    independent, self_paired = [], []
    for _ in range(3000):
        g = rng.normal(size=8)
        on = [g + rng.normal(size=8) for _ in range(4)]
        independent.append(floor_terms(on))
        self_paired.append(prompt_terms(on, on[2:]))
    stats = fidelity_statistics({"floor": independent, "self": self_paired}, resamples=1000)["estimators"]
    assert stats["floor"]["cosine"]["ci_low"] < 1 < stats["floor"]["cosine"]["ci_high"]
    assert stats["self"]["cosine"]["ci_low"] > 1.5  # E‖o³‖² = 2‖g‖² here: the old pairing read about 2


def test_the_zero_update_scores_relative_bias_and_mse_1_in_closed_form():
    """Not training on the stale batch: x¹ = x² = 0, so b = ⟨o¹, o²⟩ = n and v = 0 prompt by prompt: relative bias and
    relative MSE exactly 1 at any batch size, in every resample; its terms equal `prompt_terms` with zero vectors."""
    rng = np.random.default_rng(3)
    floor, zero = [], []
    for _ in range(20):
        on = [rng.normal(size=6) + 1.0 for _ in range(4)]
        floor.append(prompt_terms(on, on[2:]))
        zero.append(prompt_terms(on, [np.zeros(6), np.zeros(6)]))
        assert drop_terms(floor[-1]) == pytest.approx(zero[-1])
    for groups in (1, 2, 16):
        stats = fidelity_statistics({DROP: [drop_terms(f) for f in floor]}, batch_groups=groups, resamples=200)
        entry = stats["estimators"][DROP]
        for key in ("relative_bias", "relative_bias_sq", "relative_mse"):
            assert (entry[key]["value"], entry[key]["ci_low"], entry[key]["ci_high"]) == pytest.approx((1, 1, 1)), key
        assert entry["relative_variance"]["value"] == 0 and np.isnan(entry["cosine"]["value"])


def test_the_verdict_keeps_a_correction_only_where_its_mse_lies_below_dropping_after_holm():
    """Two lags, two corrections: `good` has a small bias at lag 1 (MSE far below 1: kept); at lag 16 it carries no
    signal (the zero update's bias plus noise: MSE about 1, not kept), and `bad` doubles the gradient everywhere (its
    bias is the gradient: MSE above 1)."""
    from hf_rlloss.recipe_support.gradient_fidelity import fidelity_report, format_verdicts, verdicts

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        g = rng.normal(size=8) + 1.0
        on = [g + 0.1 * rng.normal(size=8) for _ in range(4)]
        near = [g + 0.05 * rng.normal(size=8) for _ in range(2)]
        far = [0.3 * rng.normal(size=8) for _ in range(2)]  # no signal: the zero update's bias, and some variance
        double = [2 * g + 0.05 * rng.normal(size=8) for _ in range(2)]
        bad = prompt_terms(on, double)
        terms = {"1": {"none": bad, "good": prompt_terms(on, near), "bad": bad},
                 "16": {"none": bad, "good": prompt_terms(on, far), "bad": bad}}  # fmt: skip
        rows.append({"floor": floor_terms(on), "terms": terms,
                     "weights": {k: {n: [1.0, 1.0, 1.0] for n in v} for k, v in terms.items()}})  # fmt: skip
    result = verdicts(fidelity_report(rows, ["none", "good", "bad"], resamples=2000))
    assert result["1"]["good"]["keep"] and result["1"]["good"]["value"] < -0.9
    assert not result["16"]["good"]["keep"] and not result["1"]["bad"]["keep"] and not result["16"]["bad"]["keep"]
    assert result["1"]["bad"]["value"] > 0  # doubling the gradient scores 1 (its bias is the gradient): above 0
    # Holm over the six tests: the adjusted p is at least the raw one
    assert all(t["p_holm"] >= t["p"] for lag in result.values() for t in lag.values())
    text = format_verdicts(result)
    assert "- 1: good (" in text and "- 16: no correction is shown to beat dropping" in text


def test_the_zero_advantage_share_counts_the_flagged_prompts_squared_bias():
    assert zero_advantage_bias_share([1.0, 3.0, 0.0, 4.0], [False, True, True, False]) == pytest.approx(3 / 8)
    assert np.isnan(zero_advantage_bias_share([0.0, 0.0], [True, False]))
    rows = [
        {"rewards": {"on1": [1, 0], "on2": [1, 1], "on3": [0, 0], "on4": [1, 1], "8/1": [1, 1], "8/2": [1, 1]}},
        {"rewards": {"on1": [1, 1], "on2": [1, 1], "on3": [1, 1], "on4": [1, 1], "8/1": [1, 1], "8/2": [1, 1]}},
        {"rewards": {"on1": [1, 0], "on2": [1, 0], "on3": [0, 1], "on4": [1, 0], "8/1": [1, 0], "8/2": [1, 1]}},
    ]
    # only the first: both stale groups constant (no advantage) while an on-policy group is not
    assert zero_advantage_prompts(rows, "8") == [True, False, False]
    assert zero_advantage_prompts([{"floor": {}}], "8") is None


def test_trl_group_advantages():
    rewards = np.array([1.0, 0.0, 1.0, np.nan])
    std = np.std([1.0, 0.0, 1.0], ddof=1)
    np.testing.assert_allclose(
        trl_group_advantages(rewards), [1 / 3 / (std + 1e-4), -2 / 3 / (std + 1e-4), 1 / 3 / (std + 1e-4), 0]
    )
    assert not trl_group_advantages(np.ones(4)).any()


def reward_parity(completions, **kwargs):
    return [float(ord(c[0]) % 2) if c else 0.0 for c in completions]


@pytest.fixture(scope="module")
def tiny_report():
    """The diagnostic on a tiny model with a measurable gradient: one-token completions from a sharpened head (few
    likely tokens), a reward on the token's parity, 32 completions a group; behaviours: the policy itself (lag 0)
    and the policy with a perturbed head."""
    tok = make_tokenizer()
    policy = make_model(tok, seed=1, hidden_size=32, tie=False)
    behavior = make_model(tok, seed=1, hidden_size=32, tie=False)
    with torch.no_grad():
        policy.lm_head.weight.mul_(8.0)
        behavior.load_state_dict(policy.state_dict())
        torch.manual_seed(5)
        behavior.lm_head.weight.add_(policy.lm_head.weight.std() * torch.randn_like(behavior.lm_head.weight))
    names = ["none", "sampler_clip", "token_tis", "sequence_tis", "m2po", "inverted_tis"]
    settings = Settings(
        num_generations=32, max_completion_length=1, sketch_dim=2048, corrections={n: CORRECTIONS[n] for n in names}
    )
    fidelity = GradientFidelity(policy, tok, [reward_parity], settings)
    rows = [{"prompt": f"Q{i:02d}: add {i % 7}+{i % 5} ="} for i in range(48)]
    per_prompt = [fidelity.measure(row, {"0": policy, "k": behavior}, index=i) for i, row in enumerate(rows)]
    return per_prompt, fidelity.report(per_prompt, resamples=1000), names


def test_the_noise_floor_is_unbiased(tiny_report):
    _, report, _ = tiny_report
    floor = report["k"]["estimators"][FLOOR]
    assert floor["relative_bias_sq"]["ci_low"] < 0 < floor["relative_bias_sq"]["ci_high"]


def test_at_lag_0_every_estimator_is_the_on_policy_one(tiny_report):
    per_prompt, report, names = tiny_report
    for result in per_prompt:  # μ = π: every weight 1, every clip inactive: the same gradient exactly
        for name in names[1:]:
            if name != "inverted_tis":
                assert result["terms"]["0"][name] == result["terms"]["0"]["none"], name
    floor = report["0"]["estimators"][FLOOR]["relative_bias_sq"]
    for name in names:
        lag0 = report["0"]["estimators"][name]["relative_bias_sq"]
        assert lag0["ci_low"] < floor["ci_high"] and floor["ci_low"] < lag0["ci_high"], name  # within the floor
        assert lag0["ci_low"] < 0 < lag0["ci_high"], name


def test_the_inverted_weight_comes_out_worse_and_the_correction_better(tiny_report):
    """The control that can fail: weights μ/π move the estimate away from the on-policy gradient. With one-token
    completions the token IS weight is the exact likelihood ratio, so the correction must come out better."""
    _, report, _ = tiny_report
    differences = report["k"]["differences"]
    assert differences["inverted_tis - none"]["relative_bias_sq"]["ci_low"] > 0, differences["inverted_tis - none"]
    assert differences["token_tis - none"]["relative_bias_sq"]["ci_high"] < 0, differences["token_tis - none"]
    assert differences["none - noise_floor"]["relative_bias_sq"]["value"] > 0
    assert report["k"]["estimators"]["token_tis"]["ess"] < 0.9  # the weights are far from 1 at this distance


def test_the_report_prints_the_zero_update_and_each_correction_against_it(tiny_report):
    _, report, names = tiny_report
    stats = report["k"]
    assert stats["estimators"][DROP]["relative_mse"]["value"] == pytest.approx(1.0)
    for name in names:
        versus = stats["differences"][f"{name} - {DROP}"]["relative_mse"]["value"]
        assert versus == pytest.approx(stats["estimators"][name]["relative_mse"]["value"] - 1.0)
        assert "zero_advantage_bias_share" in stats["estimators"][name]
    text = format_report(report)
    assert "| drop (the zero update: the stale batch not trained on) | 1.000 [1.000, 1.000] | undefined |" in text
    assert "MSE − drop" in text and "squared bias from zero-advantage groups" in text


def test_the_report_recomputes_from_stored_results(tiny_report):
    per_prompt, report, names = tiny_report
    stored = json.loads(json.dumps(per_prompt))  # what a results file holds
    again = fidelity_report(stored, names, resamples=1000)
    assert again["k"]["estimators"]["token_tis"] == report["k"]["estimators"]["token_tis"]


def test_the_command_line_parses():
    args = build_parser().parse_args(["--policy", "a", "--behavior", "8=b", "--corrections", "token_tis", "m2po"])
    assert args.behavior == ["8=b"] and args.corrections == ["token_tis", "m2po"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--policy", "a", "--behavior", "8=b", "--corrections", "nope"])


def test_the_floors_cross_term_is_rebuilt_from_its_other_terms_whatever_pairing_stored_it():
    rng = np.random.default_rng(5)
    on = [rng.normal(size=6) + 1.0 for _ in range(4)]
    new = floor_terms(on)
    old = prompt_terms(on, on[2:])  # the pairing the first experiment's cells stored: ⟨o³, o³⟩ in the cross term
    assert old["c"] != pytest.approx(new["c"])
    for stored in (new, old):
        assert floor_with_independent_cross_term(stored) == pytest.approx(new)
