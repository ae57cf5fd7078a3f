"""`benchmarks/shared/stats.py`: each test against a computation written out by hand here, and against SciPy where it
is installed (it is not a dependency of the project)."""

import math

import pytest

from benchmarks.shared import stats

X4 = [7.0, 5.0, 9.0, 12.0]
Y4 = [6.0, 3.0, 6.0, 6.0]  # d = x − y = [1, 2, 3, 6]
T_975_3 = 3.182446305284263  # t_{0.975, 3}, the printed tables' 3.182


def test_t_cdf_closed_forms():
    # df = 1 (Cauchy): 1/2 + atan(t)/π; df = 2: 1/2 + t / (2 √(2 + t²)); df = 3: A = (2/π)(θ + sin θ cos θ)
    for t in (-4.0, -1.0, 0.0, 0.3, 2.5):
        assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-14)
        assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-14)
        theta = math.atan(abs(t) / math.sqrt(3))
        a = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta))
        assert stats.t_cdf(t, 3) == pytest.approx((1 + math.copysign(a, t)) / 2, abs=1e-14)


def test_t_quantiles_match_the_printed_tables():
    assert stats.t_quantile(0.975, 1) == pytest.approx(12.706204736174698, abs=1e-9)
    assert stats.t_quantile(0.975, 3) == pytest.approx(T_975_3, abs=1e-9)
    assert stats.t_quantile(0.975, 11) == pytest.approx(2.200985160082949, abs=1e-9)
    assert stats.t_quantile(0.025, 11) == pytest.approx(-2.200985160082949, abs=1e-9)


def test_paired_t_four_pairs_by_hand():
    # d = [1, 2, 3, 6]: mean 3, squared deviations 4 + 1 + 0 + 9 = 14, s² = 14/3, SE = s/√4 = √(7/6),
    # t = 3 / √(7/6) = 3 √(6/7) = 2.7775, df = 3; p = 1 − A(t | 3) with A = (2/π)(θ + sin θ cos θ), θ = atan(t/√3)
    result = stats.paired_t(X4, Y4)
    se = math.sqrt(7 / 6)
    t = 3 * math.sqrt(6 / 7)
    theta = math.atan(t / math.sqrt(3))
    p = 1 - 2 / math.pi * (theta + math.sin(theta) * math.cos(theta))
    assert result["mean_diff"] == pytest.approx(3.0)
    assert result["sd_diff"] == pytest.approx(math.sqrt(14 / 3))
    assert result["t"] == pytest.approx(t) and result["df"] == 3
    assert result["p"] == pytest.approx(p, abs=1e-12)
    assert result["p"] == pytest.approx(0.0690, abs=5e-4)
    assert result["ci"] == pytest.approx([3 - T_975_3 * se, 3 + T_975_3 * se], abs=1e-9)
    assert stats.mean_ci_t([1.0, 2.0, 3.0, 6.0]) == pytest.approx((3.0, 3 - T_975_3 * se, 3 + T_975_3 * se))


def test_paired_t_without_spread():
    assert stats.paired_t([1.0, 2.0], [0.0, 1.0])["p"] == 0.0
    assert stats.paired_t([1.0, 2.0], [1.0, 2.0])["p"] == 1.0
    with pytest.raises(ValueError):
        stats.paired_t([1.0, 2.0], [1.0])


def test_mcnemar_exact_by_hand():
    # b = 2, c = 10: p = 2 Σ_{k ≤ 2} C(12, k) / 2¹² = 2 (1 + 12 + 66) / 4096 = 158 / 4096 = 0.0386
    result = stats.mcnemar(both=50, only_x=2, only_y=10, neither=38)
    assert result["p"] == pytest.approx(158 / 4096, abs=1e-15)
    assert round(result["p"], 4) == 0.0386
    assert result["diff"] == pytest.approx((2 - 10) / 100)
    assert stats.mcnemar(5, 0, 0, 5)["p"] == 1.0  # no discordant pair
    assert stats.mcnemar(5, 3, 3, 5)["p"] == 1.0  # capped at 1


def test_binomial_tails():
    # n = 4, p = 1/2: P(X ≤ 1) = (1 + 4)/16; p = 0.3: P(X ≤ 1) = 0.7⁴ + 4 · 0.3 · 0.7³ = 0.2401 + 0.4116
    assert stats.binom_cdf(1, 4) == 5 / 16
    assert stats.binom_cdf(1, 4, 0.3) == pytest.approx(0.6517, abs=1e-12)
    assert stats.binom_cdf(-1, 4) == 0.0 and stats.binom_cdf(9, 4, 0.3) == pytest.approx(1.0)
    # many discordant pairs (items pooled over seeds): C(3000, k) overflows a float, the integer sum does not;
    # b = c = 1500 is the median: P(X ≤ 1500) = 1/2 + C(3000, 1500)/2^3001
    half = 0.5 + math.comb(3000, 1500) / 2**3001
    assert stats.binom_cdf(1500, 3000) == pytest.approx(half, rel=1e-12)
    assert stats.mcnemar(3000, 1400, 1600, 3000)["p"] < 0.001


def test_mcnemar_items_builds_the_table():
    x = [1, 1, 0, 0, 1, 0, 1]
    y = [1, 0, 1, 0, 0, 0, 1]
    result = stats.mcnemar_items(x, y)
    assert (result["both"], result["only_x"], result["only_y"], result["neither"]) == (2, 2, 1, 2)
    assert result["p"] == pytest.approx(2 * (1 + 3) / 8)  # b = 2, c = 1: capped at 1
    assert result["p"] == 1.0


def test_sign_test_by_hand():
    # 5 pairs x > y, 1 pair x < y, 1 tie: n = 6, p = 2 (C(6,0) + C(6,1)) / 2⁶ = 14/64
    x = [3, 4, 5, 6, 7, 1, 2]
    y = [1, 1, 1, 1, 1, 2, 2]
    result = stats.sign_test(x, y)
    assert (result["plus"], result["minus"], result["ties"]) == (5, 1, 1)
    assert result["p"] == pytest.approx(14 / 64)


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04: 3 × 0.01 = 0.03; max(0.03, 2 × 0.03) = 0.06; max(0.06, 1 × 0.04) = 0.06
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert stats.holm([0.5, 0.6]) == [1.0, 1.0]
    assert stats.holm([]) == []


def test_wilson_by_hand():
    # k = 5, n = 10, z = 1.959964: (0.5 + z²/20 ± z √(0.025 + z²/400)) / (1 + z²/10) = (0.2366, 0.7634)
    z = 1.959963984540054
    centre, half = 0.5 + z * z / 20, z * math.sqrt(0.25 / 10 + z * z / 400)
    low, high = stats.wilson(5, 10)
    assert (low, high) == pytest.approx(((centre - half) / (1 + z * z / 10), (centre + half) / (1 + z * z / 10)))
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)


def test_paired_diff_ci_by_hand():
    # both 36, only_x 12, only_y 2, neither 0 (n = 50): p₁ = 48/50, p₂ = 38/50, D = 0.2,
    # φ = (36·0 − 12·2) / √(48·2·38·12) = −24 / √43776
    (l1, u1), (l2, u2) = stats.wilson(48, 50), stats.wilson(38, 50)
    p1, p2, phi = 0.96, 0.76, -24 / math.sqrt(43776)
    low = 0.2 - math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    high = 0.2 + math.sqrt((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2)
    assert stats.paired_diff_ci(36, 12, 2, 0) == pytest.approx((low, high))
    assert low < 0.2 < high


def test_paired_diff_ci_approaches_wald_for_many_items():
    # Wald for paired proportions: D ± z √((b + c) − (b − c)²/n) / n
    both, b, c, neither = 4000, 700, 500, 4800
    n = both + b + c + neither
    half = 1.959963984540054 * math.sqrt((b + c) - (b - c) ** 2 / n) / n
    low, high = stats.paired_diff_ci(both, b, c, neither)
    assert low == pytest.approx((b - c) / n - half, abs=2e-4)
    assert high == pytest.approx((b - c) / n + half, abs=2e-4)


def test_bootstrap_ci():
    assert stats.bootstrap_ci([0.2] * 5) == pytest.approx((0.2, 0.2, 0.2))
    values = [0.1, -0.05, 0.02, 0.08, 0.03, -0.01, 0.06, 0.04, 0.0, 0.05, 0.07, -0.02]
    mean, low, high = stats.bootstrap_ci(values)
    _, t_low, t_high = stats.mean_ci_t(values)
    assert low < mean < high
    assert (high - low) == pytest.approx(t_high - t_low, rel=0.25)  # the percentile bootstrap is a little narrower
    assert stats.bootstrap_ci(values) == (mean, low, high)  # seeded


def test_power_at_zero_is_alpha_and_grows():
    # δ = 0: P(|T| ≥ t_{0.975, ν}) = 0.05 exactly; the normal approximation Φ(λ − z) for large n
    assert stats.paired_t_power(0.0, 1.0, 12) == pytest.approx(0.05, abs=1e-6)
    assert stats.paired_t_power(0.0, 1.0, 5, alpha=0.1) == pytest.approx(0.1, abs=1e-6)
    big = stats.paired_t_power(0.3, 1.0, 400)
    assert big == pytest.approx(stats.NORMAL.cdf(0.3 * 20 - 1.959963984540054), abs=2e-3)
    mdd = stats.min_detectable_difference(0.05, 12)
    assert stats.paired_t_power(mdd, 0.05, 12) == pytest.approx(0.8, abs=1e-5)
    assert stats.min_detectable_difference(0.05, 24) < mdd


def test_against_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 5, 11, 30):
        for t in (-3.1, -0.5, 0.0, 0.7, 2.2, 10.0):
            assert stats.t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), abs=1e-12)
        assert stats.t_quantile(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=1e-9)
    x = [0.50, 0.47, 0.55, 0.52, 0.61, 0.44]
    y = [0.45, 0.46, 0.48, 0.50, 0.52, 0.47]
    ours, theirs = stats.paired_t(x, y), scipy_stats.ttest_rel(x, y)
    assert ours["t"] == pytest.approx(theirs.statistic) and ours["p"] == pytest.approx(theirs.pvalue, abs=1e-12)
    assert ours["ci"] == pytest.approx(list(theirs.confidence_interval(0.95)), abs=1e-9)
    for b, c in ((2, 10), (7, 7), (0, 5), (31, 18)):
        assert stats.mcnemar(10, b, c, 10)["p"] == pytest.approx(scipy_stats.binomtest(b, b + c).pvalue, abs=1e-12)
    assert stats.mcnemar(0, 1400, 1600, 0)["p"] == pytest.approx(scipy_stats.binomtest(1400, 3000).pvalue, rel=1e-9)
    assert stats.binom_cdf(40, 100, 0.37) == pytest.approx(scipy_stats.binom.cdf(40, 100, 0.37), rel=1e-12)
    nu, c = 11, scipy_stats.t.ppf(0.975, 11)
    lam = 0.04 * math.sqrt(12) / 0.05
    power = scipy_stats.nct.sf(c, nu, lam) + scipy_stats.nct.cdf(-c, nu, lam)
    assert stats.paired_t_power(0.04, 0.05, 12) == pytest.approx(power, abs=1e-6)


def test_a_p_value_below_the_round_off_of_one_minus_the_cdf_is_written_as_a_bound():
    # t = 17.84 on 63 df: the true two-sided p is about 1e-25, below what 1 − CDF can resolve in float64.
    assert stats.t_sf_two_sided(17.84, 63) < stats.P_FLOOR
    assert stats.format_p(stats.t_sf_two_sided(17.84, 63)) == "p < 1e-10"
    assert stats.format_p(stats.t_sf_two_sided(2.0, 10)) == "p = 0.073"  # 0.07339 (hand: 2 × (1 − 0.963306))
