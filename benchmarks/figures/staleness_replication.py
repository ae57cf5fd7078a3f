"""The lag-4 replication of the accuracy experiment (`python -m benchmarks.experiments.staleness_experiment analyze
--plan replication`), registered in `docs/gradient_fidelity_preregistration.md`.

`analysis.json` is derived from the run files beside it and from the accuracy experiment's (its original 6-seed
comparison and the untrained policy): the renderers recompute it with the experiment's own analysis
(`staleness_experiment.replication_analysis`), and the check fails when the stored file differs.
"""

from __future__ import annotations

import functools

from ._aggregates import aggregate, recompute
from .core import figure, table
from .staleness_v2 import folder_stamps, sign_and_bootstrap

ANALYSIS = "staleness_replication/analysis.json"


@functools.lru_cache(maxsize=4)
def _analysis(folder: str, original: str, stamps: tuple) -> dict:
    from pathlib import Path

    from benchmarks.experiments import staleness_experiment as exp

    original_runs, untrained = exp.load_runs(Path(original))
    return exp.replication_analysis(exp.load_runs(Path(folder))[0], original_runs, untrained)


@aggregate("staleness_replication/analysis", block=None)
def recomputed_analysis(data: dict, name: str) -> dict:
    """The registered test and the descriptives, recomputed from the replication's run files and the accuracy
    experiment's."""
    from .core import RESULTS

    folder, original = (RESULTS / name).parent, RESULTS / "staleness_v2"
    return _analysis(str(folder), str(original), folder_stamps(folder) + folder_stamps(original))


def analysis_data(r) -> dict:
    return {"meta": r(ANALYSIS)["meta"], **recompute(ANALYSIS, r(ANALYSIS))}


def _seeds(c: dict) -> str:
    if c["complete"]:
        return f"{len(c['seeds'])} paired seeds"
    return f"{len(c['seeds'])} of its {len(c['seeds_planned'])} paired seeds (incomplete)"


@figure("staleness_replication.result")
def result(r) -> str:
    """The registered test: the paired t-test of C − B over the replication's seeds, its verdict, and beside it the
    sign test, the bootstrap interval and what the test could detect given the spread it measured."""
    from benchmarks.shared import stats

    c = analysis_data(r)["replication"]
    t = c["paired_t"]
    verdict = {
        True: "the test rejects H₀",
        False: "the test does not reject H₀",
        None: "no verdict until every seed has run",
    }[c["rejects"]]
    detectable = stats.min_detectable_difference(t["sd_diff"], t["n"])
    return (
        f"held-out accuracy C − B = {t['mean_diff']:+.3f} (95 % CI {t['ci'][0]:+.3f} to {t['ci'][1]:+.3f}), "
        f"t({t['df']}) = {t['t']:.2f}, p = {t['p']:.2f} over {_seeds(c)}: {verdict}; {sign_and_bootstrap(c)}; the "
        f"per-seed differences had a standard deviation of {t['sd_diff']:.2f}, with which {t['n']} seeds detect a "
        f"difference of {detectable:.2f} with 80 % power"
    )


@figure("staleness_replication.original")
def original(r) -> str:
    """The comparison the replication repeats: the accuracy experiment's lag-4 secondary, unadjusted."""
    t = analysis_data(r)["original"]["paired_t"]
    return (
        f"C − B = {t['mean_diff']:+.3f} (95 % CI {t['ci'][0]:+.3f} to {t['ci'][1]:+.3f}), p = {t['p']:.3g} "
        f"unadjusted, over {t['n']} seeds"
    )


@table("staleness_replication.cells")
def cells(r) -> str:
    """Exploratory: each arm's mean held-out accuracy over the replication's seeds with its 95 % t interval, its
    change from the untrained policy, the runs below the untrained policy, and training figures."""
    data = analysis_data(r)
    base = data["untrained_accuracy"]
    runs = {(arm, s): a for arm, c in (("C", data["replication"]), ("B", data["replication"]))
            for s, a in zip(c["seeds"], c["per_seed_x" if arm == "C" else "per_seed_y"])}  # fmt: skip
    rows = [
        f"| arm | seeds | held-out accuracy [95 % CI] | change from untrained ({base:.3f}) | runs below untrained "
        "| reward AUC | zero-loss steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in data["descriptives"]:
        lo, hi = d["heldout_accuracy_ci"]
        below = sum(runs[(d["arm"], s)] < base for s in d["seeds"] if (d["arm"], s) in runs)
        rows.append(
            f"| {d['arm']} | {len(d['seeds'])} | {d['heldout_accuracy_mean']:.3f} [{lo:.3f}, {hi:.3f}] "
            f"| {d['change_from_untrained']:+.3f} | {below} | {d['reward_auc']:.3f} | {d['zero_loss_frac']:.2f} |"
        )
    return "\n".join(rows)
