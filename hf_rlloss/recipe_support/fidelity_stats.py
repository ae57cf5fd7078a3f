"""Statistics of the gradient-fidelity diagnostic: how far each stale-sample estimator is from the on-policy gradient.

A correction acts prompt by prompt: for prompt ``p`` the on-policy gradient is ``g_p = E_{y~π}[∇ℓ]`` and a
correction's estimator from stale samples has the expectation ``m_p = E_{y~μ}[∇ℓ_c]``. Its bias is ``m_p − g_p``.
Per prompt the diagnostic holds four independent on-policy group estimates ``o¹…o⁴`` and, per estimator, two
independent stale group estimates ``x¹, x²``; independent copies make every quantity below an unbiased per-prompt
estimate (``E⟨u, v⟩ = ⟨E u, E v⟩`` for independent ``u, v``):

| per prompt | estimates |
|---|---|
| ``n_p = ⟨o¹, o²⟩`` | ``‖g_p‖²`` |
| ``b_p = ⟨x¹ − o¹, x² − o²⟩`` | ``‖m_p − g_p‖²``, the squared bias |
| ``c_p = (⟨x¹, o³⟩ + ⟨x², o⁴⟩) / 2`` | ``⟨m_p, g_p⟩`` |
| ``s_p = ⟨x¹, x²⟩`` | ``‖m_p‖²`` |
| ``v_p = ‖x¹ − x²‖² / 2`` | the variance of one group's estimate (trace of its covariance) |

Over the prompts (bars are means over prompts):

- **relative bias** ``√max(b̄, 0) / √n̄``: ``√(E_p‖m_p − g_p‖² / E_p‖g_p‖²)``; and its square ``b̄ / n̄``;
- **cosine** ``c̄ / √(s̄ n̄)``: of the expected gradients, prompt by prompt;
- **relative variance per group** ``v̄ / n̄``;
- **relative MSE at a batch of n groups** ``(b̄ + v̄ / n) / n̄``: the bias kept whole, the variance divided by the
  groups of one optimizer step (the demo's 16 samples are 2 groups of 8).

The **drop** reference is the zero update: not training on the stale batch at all (``x¹ = x² = 0``). Its terms are
``b = n``, ``c = s = v = 0``, so its relative bias and relative MSE are exactly 1 and its cosine is undefined: a
correction earns its place at a lag where its relative MSE lies below 1 (`drop_terms`; the diagnostic prints each
correction's MSE difference to it with its interval).

The **noise floor** is the same statistics with on-policy groups as the "stale" ones, every inner product between two
independent groups (`floor_terms`: ``x¹, x² = o³, o⁴`` against ``o¹, o²``, and the cross term ``(⟨o³, o²⟩ + ⟨o⁴,
o¹⟩) / 2``, so that no group meets itself): its bias is 0 and its cosine 1 in expectation. Its interval shows how far
an estimator with no bias reads from 0 with this many prompts; a bias inside it is not shown to be a bias, which is
not evidence that there is none. Intervals are percentile bootstraps over prompts (the prompt is
the independent unit; every estimator of a resample uses the same prompts, so differences are paired).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

STATISTICS = ("relative_bias", "relative_bias_sq", "cosine", "relative_variance", "relative_mse")
FLOOR = "noise_floor"
DROP = "drop"


def prompt_terms(on: Sequence[np.ndarray], stale: Sequence[np.ndarray]) -> dict[str, float]:
    """The per-prompt inner products of one estimator: ``b``, ``c``, ``s``, ``v`` (and ``n``) of the module docstring.

    Args:
        on (`Sequence[np.ndarray]`): the four on-policy group estimates ``o¹…o⁴`` `(k,)`.
        stale (`Sequence[np.ndarray]`): the estimator's two stale group estimates ``x¹, x²`` `(k,)`.
    """
    o1, o2, o3, o4 = (np.asarray(v, dtype=np.float64) for v in on)
    x1, x2 = (np.asarray(v, dtype=np.float64) for v in stale)
    return {
        "n": float(o1 @ o2),
        "b": float((x1 - o1) @ (x2 - o2)),
        "c": float((x1 @ o3 + x2 @ o4) / 2),
        "s": float(x1 @ x2),
        "v": float((x1 - x2) @ (x1 - x2) / 2),
    }


def floor_terms(on: Sequence[np.ndarray]) -> dict[str, float]:
    """The noise floor's per-prompt terms from the four on-policy groups ``o¹…o⁴``: the estimator ``x¹, x² = o³, o⁴``
    with every inner product between independent groups (`prompt_terms` with the reference groups ``o¹, o², o², o¹``,
    so that its cross term is ``(⟨o³, o²⟩ + ⟨o⁴, o¹⟩) / 2``: pairing ``o³`` with itself would add the group's variance
    to the cosine's numerator)."""
    o1, o2, o3, o4 = on
    return prompt_terms([o1, o2, o2, o1], [o3, o4])


def floor_with_independent_cross_term(floor: Mapping[str, float]) -> dict[str, float]:
    """The noise floor's terms with its cross term rebuilt from the others: ``b = s − (⟨o³, o²⟩ + ⟨o¹, o⁴⟩) + n``, so
    ``c = (s + n − b) / 2`` is `floor_terms`' cross term whatever the stored ``c`` was (terms stored before
    `floor_terms` paired independent groups read ``(‖o³‖² + ‖o⁴‖²) / 2`` there, the groups' variance included)."""
    return {**floor, "c": (floor["s"] + floor["n"] - floor["b"]) / 2}


def drop_terms(floor: Mapping[str, float]) -> dict[str, float]:
    """The per-prompt terms of the zero update (`DROP`) from the prompt's on-policy terms (any `prompt_terms` of it:
    only ``n`` is read): ``x¹ = x² = 0`` gives ``b = ⟨−o¹, −o²⟩ = n`` and ``c = s = v = 0``."""
    n = float(floor["n"])
    return {"n": n, "b": n, "c": 0.0, "s": 0.0, "v": 0.0}


def zero_advantage_bias_share(b: Sequence[float], flagged: Sequence[bool]) -> float:
    """The share of an estimator's summed squared bias ``Σ_p b_p`` that comes from the `flagged` prompts (those whose
    stale groups' advantages are all zero while an on-policy group's are not: no likelihood ratio can correct an
    advantage the stale groups never had). Each ``b_p`` is an unbiased estimate and can be negative, so the share can
    fall outside [0, 1] where the summed bias is small (at lag 0, say). NaN when the summed bias is not positive."""
    b = np.asarray(b, dtype=np.float64)
    total = b.sum()
    return float(b[np.asarray(flagged, dtype=bool)].sum() / total) if total > 0 else float("nan")


def _statistics(terms: Mapping[str, np.ndarray], batch_groups: int) -> dict[str, np.ndarray]:
    """Each statistic from the prompt means of the terms (arrays over resamples)."""
    n = np.where(terms["n"] > 0, terms["n"], np.nan)
    return {
        "relative_bias": np.sqrt(np.maximum(terms["b"], 0.0) / n),
        "relative_bias_sq": terms["b"] / n,
        "cosine": terms["c"] / np.sqrt(np.where(terms["s"] > 0, terms["s"], np.nan) * n),
        "relative_variance": terms["v"] / n,
        "relative_mse": (terms["b"] + terms["v"] / batch_groups) / n,
    }


def _summary(point: float, resampled: np.ndarray) -> dict[str, float]:
    finite = resampled[np.isfinite(resampled)]
    low, high = np.percentile(finite, [2.5, 97.5]) if finite.size else (np.nan, np.nan)
    return {"value": float(point), "ci_low": float(low), "ci_high": float(high)}


def bootstrap_p(resampled: np.ndarray) -> float:
    """Two-sided bootstrap p-value of "the statistic is 0": twice the smaller tail share beyond 0 (at most 1)."""
    finite = resampled[np.isfinite(resampled)]
    if finite.size == 0:
        return float("nan")
    return float(min(1.0, 2 * min((finite <= 0).mean(), (finite >= 0).mean())))


def bootstrap_p_error(resampled: np.ndarray) -> float:
    """The Monte-Carlo standard error of `bootstrap_p` over `R` resamples: ``2 √(q (1 − q) / R)`` for the smaller tail
    share ``q`` (a binomial share, doubled); it shrinks as ``1/√R``, which is how many resamples a decision at a
    threshold needs to be read off."""
    finite = resampled[np.isfinite(resampled)]
    if finite.size == 0:
        return float("nan")
    q = min((finite <= 0).mean(), (finite >= 0).mean())
    return float(2 * np.sqrt(q * (1 - q) / finite.size))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the order given: with p₍₁₎ ≤ … ≤ p₍ₘ₎ sorted,
    p̃₍ᵢ₎ = max_{j ≤ i} min(1, (m − j + 1) p₍ⱼ₎). Reject H₍ᵢ₎ at level α when p̃₍ᵢ₎ ≤ α."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def fidelity_statistics(
    per_prompt: Mapping[str, Sequence[Mapping[str, float]]],
    batch_groups: int = 2,
    resamples: int = 4000,
    seed: int = 0,
    differences: Mapping[str, tuple[str, str]] | None = None,
) -> dict:
    """Every statistic of every estimator (the noise floor included), with 95 % bootstrap intervals over prompts.

    Args:
        per_prompt (`Mapping[str, Sequence[Mapping[str, float]]]`): per estimator (and `"noise_floor"`), the
            `prompt_terms` of each prompt, in the same prompt order for every estimator.
        batch_groups (`int`, *optional*, defaults to `2`): the groups of one optimizer step, for the relative MSE.
        resamples (`int`, *optional*, defaults to `4000`): bootstrap resamples of the prompts.
        seed (`int`, *optional*, defaults to `0`): the bootstrap's seed.
        differences (`Mapping[str, tuple[str, str]]`, *optional*): named paired differences ``(x, y)``: each statistic
            of estimator `x` minus that of `y`, with its interval and bootstrap p-value.

    Returns:
        `dict`: ``{"prompts": P, "estimators": {name: {statistic: {value, ci_low, ci_high}}}, "differences":
        {name: {statistic: {value, ci_low, ci_high, p}}}}``.
    """
    prompts = len(next(iter(per_prompt.values())))
    if prompts < 3:
        raise ValueError(f"the statistics need at least 3 prompts (got {prompts})")
    rng = np.random.default_rng(seed)
    weights = (
        np.vstack([np.ones(prompts), rng.multinomial(prompts, np.full(prompts, 1 / prompts), size=resamples)])
        / prompts
    )  # (1 + R, P): row 0 is the sample itself
    stats = {}
    for name, rows in per_prompt.items():
        if len(rows) != prompts:
            raise ValueError(f"{name} has {len(rows)} prompts, the others {prompts}")
        terms = {key: weights @ np.array([row[key] for row in rows]) for key in ("n", "b", "c", "s", "v")}
        stats[name] = _statistics(terms, batch_groups)
    result = {"prompts": prompts, "resamples": resamples, "batch_groups": batch_groups, "estimators": {}}
    for name, values in stats.items():
        result["estimators"][name] = {key: _summary(v[0], v[1:]) for key, v in values.items()}
    result["differences"] = {}
    for label, (x, y) in (differences or {}).items():
        entry = {}
        for key in STATISTICS:
            delta = stats[x][key] - stats[y][key]
            entry[key] = {**_summary(delta[0], delta[1:]), "p": bootstrap_p(delta[1:]),
                          "p_mc_se": bootstrap_p_error(delta[1:]), "resamples": resamples}  # fmt: skip
        result["differences"][label] = entry
    return result
