"""The pre-registered staleness experiment (`python -m benchmarks.experiments.staleness_experiment analyze`).

`analysis.json` is derived from the per-seed run files beside it (each with its held-out items): the renderers
recompute it from them with the experiment's own analysis (`staleness_experiment.analysis`,
`benchmarks/shared/stats.py`), and the check fails when the stored file differs from that recomputation.
"""

from __future__ import annotations

import functools

from ._aggregates import aggregate, recompute
from .core import figure, table

ANALYSIS = "staleness_v2/analysis.json"


@functools.lru_cache(maxsize=4)
def _analysis(folder: str, stamps: tuple) -> dict:
    from pathlib import Path

    from benchmarks.experiments import staleness_experiment

    return staleness_experiment.analysis(*staleness_experiment.load_runs(Path(folder)))


@aggregate("staleness_v2/analysis", block=None)
def recomputed_analysis(data: dict, name: str) -> dict:
    """The pre-registered tests and descriptives, recomputed from the run files in the analysis file's folder."""
    from .core import RESULTS

    folder = (RESULTS / name).parent
    return _analysis(str(folder), folder_stamps(folder))


def folder_stamps(folder) -> tuple:
    """The name, mtime and size of each JSON file in `folder`: a cache key that changes when a run file does."""
    return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.glob("*.json")))


def analysis_data(r) -> dict:
    return {"meta": r(ANALYSIS)["meta"], **recompute(ANALYSIS, r(ANALYSIS))}


@figure("staleness_v2.primary")
def primary(r) -> str:
    data = analysis_data(r)
    p = data["primary"]
    t = p["paired_t"]
    verdict = "C above B" if p["positive"] else "no difference detected"
    return (
        f"held-out accuracy C − B = {t['mean_diff']:+.3f} (95 % CI {t['ci'][0]:+.3f} to {t['ci'][1]:+.3f}), "
        f"t({t['df']}) = {t['t']:.2f}, p = {t['p']:.2f} over {t['n']} paired seeds: {verdict}; the per-seed "
        f"differences had a standard deviation of {t['sd_diff']:.2f}, and the untrained policy scored "
        f"{data['untrained_accuracy']:.2f}"
    )


def _interval(t: dict) -> str:
    return f"{t['mean_diff']:+.3f} [{t['ci'][0]:+.3f}, {t['ci'][1]:+.3f}]"


@table("staleness_v2.comparisons")
def comparisons(r) -> str:
    """The pre-registered comparisons: the primary first, then the five secondary ones with their Holm p-values."""
    data = analysis_data(r)
    rows = [
        "| comparison | metric | lag | lr | seeds | mean difference [95 % CI] | t (df) | p | Holm p "
        "| pooled McNemar p (supporting) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    primary = {**data["primary"], "name": "primary: C vs B, lag 8"}
    for c in [primary, *data["secondary"]]:
        t = c["paired_t"]
        holm = f"{c['holm_p']:.3g}" if "holm_p" in c else "(primary: not corrected)"
        mcnemar = f"{c['mcnemar_pooled']['p']:.2g}" if "mcnemar_pooled" in c else "–"
        metric = "held-out accuracy" if c["metric"] == "heldout_accuracy" else "reward AUC"
        rows.append(
            f"| {c['name']} ({c['x']} − {c['y']}) | {metric} | {c['lag']} | {c['learning_rate']:g} | {t['n']} "
            f"| {_interval(t)} | {t['t']:.2f} ({t['df']}) | {t['p']:.3g} | {holm} | {mcnemar} |"
        )
    return "\n".join(rows)


@figure("staleness_v2.lag_reading")
def lag_reading(r) -> str:
    """The pre-registered reading of the lag curve: the smallest lag whose comparison rejects."""
    data = analysis_data(r)
    by_lag = {c["lag"]: c for c in data["secondary"] if c["metric"] == "heldout_accuracy" and c["x"] == "C"
              and c["y"] == "B" and c["learning_rate"] == data["primary"]["learning_rate"]}  # fmt: skip
    by_lag[data["primary"]["lag"]] = {**data["primary"], "holm_p": data["primary"]["paired_t"]["p"]}
    rejecting = [lag for lag in sorted(by_lag) if by_lag[lag]["holm_p"] < 0.05]
    parts = [f"lag {lag}: p = {by_lag[lag]['holm_p']:.3g}" for lag in sorted(by_lag)]
    if not rejecting:
        return f"no lag rejects ({'; '.join(parts)}, Holm-adjusted for lags 2 and 4)"
    return f"lag {rejecting[0]} ({'; '.join(parts)}, Holm-adjusted for lags 2 and 4)"


@table("staleness_v2.cells")
def cells(r) -> str:
    """Exploratory: each cell's mean held-out accuracy with its 95 % t interval over seeds, and training figures."""
    data = analysis_data(r)
    rows = [
        f"| lag | arm | lr | seeds | held-out accuracy [95 % CI] | change from untrained "
        f"({data['untrained_accuracy']:.3f}) | reward AUC | zero-loss steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in data["descriptives"]:
        lo, hi = d["heldout_accuracy_ci"]
        rows.append(
            f"| {d['lag']} | {d['arm']} | {d['learning_rate']:g} | {len(d['seeds'])} "
            f"| {d['heldout_accuracy_mean']:.3f} [{lo:.3f}, {hi:.3f}] | {d['change_from_untrained']:+.3f} "
            f"| {d['reward_auc']:.3f} | {d['zero_loss_frac']:.2f} |"
        )
    return "\n".join(rows)


@figure("staleness_v2.primary_support")
def primary_support(r) -> str:
    """The primary comparison's registered supporting statistics: the sign test, the bootstrap interval and the
    pooled McNemar test with its interval."""
    p = analysis_data(r)["primary"]
    mc = p["mcnemar_pooled"]
    return (
        f"{sign_and_bootstrap(p)}; pooled McNemar over {mc['n']} (seed, item) pairs: difference {mc['diff']:+.3f} "
        f"(95 % CI {mc['ci'][0]:+.3f} to {mc['ci'][1]:+.3f}), p = {mc['p']:.1e}"
    )


def sign_and_bootstrap(c: dict) -> str:
    """A seed-level comparison's sign test and percentile bootstrap interval, in words."""
    sign, boot = c["sign_test"], c["bootstrap_ci"]
    return (
        f"{c['x']} above {c['y']} in {sign['plus']} seeds, below in {sign['minus']} (exact sign test p = "
        f"{sign['p']:.2f}); percentile bootstrap interval of the mean difference {boot[0]:+.3f} to {boot[1]:+.3f}"
    )


@figure("staleness_v2.realized_power")
def realized_power(r) -> str:
    """What the primary test could detect, given the spread of the per-seed differences it measured."""
    from benchmarks.shared import stats

    t = analysis_data(r)["primary"]["paired_t"]
    detectable = stats.min_detectable_difference(t["sd_diff"], t["n"])
    power = stats.paired_t_power(abs(t["mean_diff"]), t["sd_diff"], t["n"])
    return (
        f"the per-seed differences had a standard deviation of {t['sd_diff']:.2f}; with {t['n']} seeds the test "
        f"detects a difference of {detectable:.2f} with 80 % power, and its power at the observed mean difference "
        f"({t['mean_diff']:+.3f}) was {power:.2f}"
    )
