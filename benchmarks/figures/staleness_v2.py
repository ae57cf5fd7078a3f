"""The pre-registered staleness experiment (`benchmarks/staleness_experiment.py analyze`)."""

from __future__ import annotations

from .core import figure

ANALYSIS = "staleness_v2/analysis.json"


@figure("staleness_v2.primary")
def primary(r) -> str:
    data = r(ANALYSIS)
    p = data["primary"]
    t = p["paired_t"]
    verdict = "C above B" if p["positive"] else "no difference detected"
    return (
        f"held-out accuracy C − B = {t['mean_diff']:+.3f} (95 % CI {t['ci'][0]:+.3f} to {t['ci'][1]:+.3f}), "
        f"t({t['df']}) = {t['t']:.2f}, p = {t['p']:.2f} over {t['n']} paired seeds: {verdict}; the per-seed "
        f"differences had a standard deviation of {t['sd_diff']:.2f}, and the untrained policy scored "
        f"{data['untrained_accuracy']:.2f}"
    )
