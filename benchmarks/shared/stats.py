"""The tests of the pre-registered staleness experiment (`benchmarks/experiments/staleness_experiment.py analyze`),
exact and in
the standard library only (SciPy is not a dependency of the project; `tests/test_stats.py` compares with it where it
is installed).

    from benchmarks.shared.stats import paired_t, mcnemar, holm, format_p
    paired_t([0.50, 0.47, 0.55, 0.52], [0.45, 0.46, 0.48, 0.50])   # per-seed accuracies of two arms, same seeds
    mcnemar(both=120, only_x=31, only_y=18, neither=87)             # paired 0/1 items: the 2 × 2 table
    holm([0.01, 0.04, 0.03])                                        # -> [0.03, 0.06, 0.06]

* Student's t distribution: the CDF of an integer number of degrees of freedom in closed form (a finite sum,
  Abramowitz & Stegun 26.7.3-4), its quantile by bisection on it.
* Binomial tails: exact integer sums of `math.comb` for p = 1/2 (any n), log-space terms otherwise.
* Power of the paired t-test: the noncentral t probability, integrated numerically over the chi distribution of the
  sample standard deviation (Simpson's rule; within 1e-7 of SciPy's noncentral t for 1 to 40 degrees of freedom).
"""

from __future__ import annotations

import fractions
import math
import random
import statistics
from collections.abc import Sequence

from hf_rlloss.recipe_support.fidelity_stats import holm  # noqa: F401  (Holm-Bonferroni, re-exported)

NORMAL = statistics.NormalDist()


# ------------------------------------------------------------------------------------------------------------------
# Distributions


def t_cdf(t: float, df: int) -> float:
    """P(T ≤ t) for Student's t with integer `df` ≥ 1, exactly (A&S 26.7.3-4). With θ = atan(t / √df), c = cos θ,
    A = P(|T| ≤ |t|):

        df odd:  A = (2/π) [θ + sin θ (c + (2/3) c³ + (2·4)/(3·5) c⁵ + … + (2·4…(df−3))/(3·5…(df−2)) c^(df−2))]
        df even: A = sin θ [1 + (1/2) c² + (1·3)/(2·4) c⁴ + … + (1·3…(df−3))/(2·4…(df−2)) c^(df−2)]

    and P(T ≤ t) = (1 + sign(t) A) / 2.
    """
    if df < 1 or int(df) != df:
        raise ValueError(f"df={df} must be an integer >= 1")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:
        term, total = c, c if df > 1 else 0.0
        for k in range(3, df - 1, 2):  # the factor (k − 1) / k, then c² more
            term *= (k - 1) / k * c * c
            total += term
        a = 2 / math.pi * (theta + s * total)
    else:
        term, total = 1.0, 1.0
        for k in range(2, df - 1, 2):
            term *= (k - 1) / k * c * c
            total += term
        a = s * total
    return (1 + math.copysign(min(a, 1.0), t)) / 2


def t_sf_two_sided(t: float, df: int) -> float:
    """P(|T| ≥ |t|) = 2 (1 − P(T ≤ |t|)): exact to about 1e-15 absolute (the subtraction), so a p below `P_FLOOR`
    is an upper bound, not a value (`format_p` writes it as one)."""
    return 2 * (1 - t_cdf(abs(t), df))


P_FLOOR = 1e-10


def format_p(p: float) -> str:
    """`p = 0.0073` (two significant digits), or `p < 1e-10` below `P_FLOOR`, where `t_sf_two_sided`'s value is
    round-off."""
    return f"p < {P_FLOOR:.0e}" if p < P_FLOOR else f"p = {p:.2g}"


def t_quantile(p: float, df: int) -> float:
    """The `p` quantile of Student's t (`df` integer): bisection on `t_cdf` to 1e-12."""
    if not 0 < p < 1:
        raise ValueError(f"p={p} must be in (0, 1)")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2
    while t_cdf(hi, df) < p:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, abs(lo)):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def binom_cdf(k: int, n: int, p: float = 0.5) -> float:
    """P(X ≤ k), X ~ Binomial(n, p): Σ_{i ≤ k} C(n, i) p^i (1 − p)^(n − i). For p = 1/2 (the sign and McNemar
    tests) the sum Σ C(n, i) / 2ⁿ is computed in integers and divided once (exact for any n); otherwise each term is
    exp(ln C(n, i) + i ln p + (n − i) ln(1 − p)), with ln C(n, i) from `math.lgamma`."""
    k = min(k, n)
    if k < 0:
        return 0.0
    if p == 0.5:
        return float(fractions.Fraction(sum(math.comb(n, i) for i in range(k + 1)), 2**n))
    if p in (0.0, 1.0):
        return 1.0 if p == 0.0 or k == n else 0.0
    log_c = math.lgamma(n + 1)
    return math.fsum(
        math.exp(log_c - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p))
        for i in range(k + 1)
    )


# ------------------------------------------------------------------------------------------------------------------
# Intervals and tests


def mean_ci_t(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): mean ± t_{(1+level)/2, n−1} · s / √n, s the sample standard deviation (n − 1)."""
    n = len(values)
    if n < 2:
        raise ValueError("a t interval needs at least 2 values")
    mean, s = statistics.fmean(values), statistics.stdev(values)
    half = t_quantile((1 + level) / 2, n - 1) * s / math.sqrt(n)
    return mean, mean - half, mean + half


def bootstrap_ci(
    values: Sequence[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): the percentile bootstrap of the mean, `resamples` resamples with replacement (seeded): the
    ((1 − level)/2, (1 + level)/2) quantiles of the resampled means (`statistics.quantiles`, inclusive method)."""
    rng, n = random.Random(seed), len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(resamples))
    cuts = statistics.quantiles(means, n=1000, method="inclusive")  # cuts[i] is the (i + 1)/1000 quantile
    low, high = round((1 - level) / 2 * 1000) - 1, round((1 + level) / 2 * 1000) - 1
    return statistics.fmean(values), cuts[low], cuts[high]


def paired_t(x: Sequence[float], y: Sequence[float], level: float = 0.95) -> dict:
    """Paired t-test of x − y (pairs in order, e.g. per seed): d_i = x_i − y_i, d̄ their mean, s their standard
    deviation (n − 1), t = d̄ / (s / √n), df = n − 1, p = P(|T_df| ≥ |t|) (two-sided), and the `level` interval
    d̄ ± t_{(1+level)/2, df} s / √n. (s = 0: t = ±inf, p = 0, or t = 0, p = 1 when d̄ = 0.)"""
    if len(x) != len(y):
        raise ValueError(f"paired samples of different lengths: {len(x)} and {len(y)}")
    d = [a - b for a, b in zip(x, y)]
    n = len(d)
    mean, low, high = mean_ci_t(d, level)
    s = statistics.stdev(d)
    t = mean / (s / math.sqrt(n)) if s > 0 else (math.copysign(math.inf, mean) if mean else 0.0)
    p = t_sf_two_sided(t, n - 1) if math.isfinite(t) else 0.0
    return {"n": n, "mean_diff": mean, "sd_diff": s, "t": t, "df": n - 1, "p": p, "ci": [low, high], "level": level}


def sign_test(x: Sequence[float], y: Sequence[float]) -> dict:
    """Exact two-sided sign test of paired x, y: n₊ pairs with x > y, n₋ with x < y (ties dropped), n = n₊ + n₋,
    p = min(1, 2 Σ_{k ≤ min(n₊, n₋)} C(n, k) / 2ⁿ)."""
    plus = sum(a > b for a, b in zip(x, y))
    minus = sum(a < b for a, b in zip(x, y))
    return {"plus": plus, "minus": minus, "ties": len(x) - plus - minus, "p": _two_sided_binom(plus, minus)}


def _two_sided_binom(b: int, c: int) -> float:
    n = b + c
    return 1.0 if n == 0 else min(1.0, 2 * binom_cdf(min(b, c), n))


def wilson(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval of a proportion p̂ = k/n: (p̂ + z²/2n ± z √(p̂(1−p̂)/n + z²/4n²)) / (1 + z²/n)."""
    z = NORMAL.inv_cdf((1 + level) / 2)
    p = successes / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def paired_diff_ci(both: int, only_x: int, only_y: int, neither: int, level: float = 0.95) -> tuple[float, float]:
    """Newcombe's hybrid score interval for the difference of paired proportions (Newcombe 1998, Stat. Med. 17:2635),
    with φ uncorrected (the paper also has a variant with a continuity-corrected φ; not checked against its tables).
    With n the pairs, p₁ = (both + only_x)/n, p₂ = (both + only_y)/n, (l₁, u₁), (l₂, u₂) their Wilson intervals
    and φ the correlation of the 2 × 2 table, φ = (both·neither − only_x·only_y) / √((both+only_x)(only_y+neither)
    (both+only_y)(only_x+neither)) (0 when a margin is empty), the interval of D = p₁ − p₂ is

        D − √((p₁−l₁)² − 2φ(p₁−l₁)(u₂−p₂) + (u₂−p₂)²),  D + √((u₁−p₁)² − 2φ(u₁−p₁)(p₂−l₂) + (p₂−l₂)²).
    """
    n = both + only_x + only_y + neither
    p1, p2 = (both + only_x) / n, (both + only_y) / n
    (l1, u1), (l2, u2) = wilson(both + only_x, n, level), wilson(both + only_y, n, level)
    margins = (both + only_x) * (only_y + neither) * (both + only_y) * (only_x + neither)
    phi = (both * neither - only_x * only_y) / math.sqrt(margins) if margins else 0.0
    d = p1 - p2
    low = d - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = d + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return low, high


def mcnemar(both: int, only_x: int, only_y: int, neither: int, level: float = 0.95) -> dict:
    """Exact McNemar test of paired 0/1 outcomes (x and y on the same items): under H₀ each discordant pair is
    "x only" or "y only" with probability 1/2, so with b = only_x, c = only_y, p = min(1, 2 Σ_{k ≤ min(b,c)} C(b+c,
    k) / 2^(b+c)) (two-sided). Also the difference of proportions D = (b − c)/n with Newcombe's interval
    (`paired_diff_ci`)."""
    n = both + only_x + only_y + neither
    return {
        "n": n,
        "both": both,
        "only_x": only_x,
        "only_y": only_y,
        "neither": neither,
        "p": _two_sided_binom(only_x, only_y),
        "diff": (only_x - only_y) / n,
        "ci": list(paired_diff_ci(both, only_x, only_y, neither, level)),
        "ci_method": "Newcombe hybrid score interval for paired proportions (Wilson limits, uncorrected phi)",
        "level": level,
    }


def mcnemar_items(x: Sequence[int], y: Sequence[int], level: float = 0.95) -> dict:
    """`mcnemar` of two equally long 0/1 sequences, paired by position."""
    if len(x) != len(y):
        raise ValueError(f"paired items of different lengths: {len(x)} and {len(y)}")
    table = paired_table(x, y)
    return mcnemar(table[(1, 1)], table[(1, 0)], table[(0, 1)], table[(0, 0)], level)


def paired_table(x: Sequence[int], y: Sequence[int]) -> dict[tuple[int, int], int]:
    """The 2 × 2 table of paired 0/1 outcomes: {(x_i, y_i): count}."""
    table = {(1, 1): 0, (1, 0): 0, (0, 1): 0, (0, 0): 0}
    for a, b in zip(x, y):
        table[(int(bool(a)), int(bool(b)))] += 1
    return table


# ------------------------------------------------------------------------------------------------------------------
# Power of the paired t-test


def paired_t_power(delta: float, sd: float, n: int, alpha: float = 0.05, grid: int = 2000) -> float:
    """P(reject H₀: mean difference 0 | true mean difference `delta`, SD of the differences `sd`, `n` pairs), two
    sided at `alpha`: with λ = δ√n/σ, ν = n − 1, c = t_{1−α/2, ν} and U = √V, V ~ χ²_ν (U has the density
    u^(ν−1) e^(−u²/2) / (2^(ν/2−1) Γ(ν/2))),

        power = E_U[Φ(−c U/√ν − λ) + 1 − Φ(c U/√ν − λ)]     (T = (Z + λ)/(U/√ν), Z ~ N(0, 1))

    integrated over U by Simpson's rule on [0, √ν + 12]."""
    nu = n - 1
    c, lam = t_quantile(1 - alpha / 2, nu), delta * math.sqrt(n) / sd
    upper = math.sqrt(nu) + 12
    h = upper / grid
    log_norm = -(nu / 2 - 1) * math.log(2) - math.lgamma(nu / 2)

    def integrand(u: float) -> float:
        if u <= 0:
            return math.exp(log_norm) if nu == 1 else 0.0
        density = math.exp(log_norm + (nu - 1) * math.log(u) - u * u / 2)
        scale = c * u / math.sqrt(nu)
        return density * (NORMAL.cdf(-scale - lam) + 1 - NORMAL.cdf(scale - lam))

    total = integrand(0.0) + integrand(upper)
    total += sum((4 if i % 2 else 2) * integrand(i * h) for i in range(1, grid))
    return total * h / 3


def min_detectable_difference(sd: float, n: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest true mean difference the two-sided paired t-test of `n` pairs detects with probability `power`
    (`paired_t_power` inverted by bisection, to 1e-6 · sd)."""
    lo, hi = 0.0, sd
    while paired_t_power(hi, sd, n, alpha) < power:
        hi *= 2
    while hi - lo > 1e-6 * sd:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if paired_t_power(mid, sd, n, alpha) < power else (lo, mid)
    return (lo + hi) / 2
