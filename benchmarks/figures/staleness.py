"""docs/async.md: the async demo's logged run and the staleness experiment
(`benchmarks/experiments/async_staleness.py`).

The experiment's run files (`async_staleness/smollm2/seed*_lag*_*.jsonl`: one record per step, then a final record)
are JSON lines without a provenance record, since `async_staleness.py report` reads every line but the last as a
step; their machine, date and command are in the `meta.json` beside them, which each renderer reads through the
loader, so the Source line names it. The tables are those `async_staleness.py report` prints, computed here with the
script's own helpers (`_mean_sd`, `_steps_to`, the arm names).
"""

from __future__ import annotations

import collections
import functools
import json
import math
import statistics

from .core import RESULTS, figure, table

EXPERIMENT = "async_staleness/smollm2"
DEMO = "async_demo_metrics.jsonl"
DRIFT = ("bench/abs_logratio", "bench/ess", "bench/frac_over_ln2")
LAGS = (0, 4, 8)  # sampler lags of the experiment (a lag of 0 trains at lag 1: the prefetch)


@functools.cache
def _script():
    """`benchmarks/experiments/async_staleness.py` (its top level defines constants and functions only)."""
    from benchmarks.experiments import async_staleness

    return async_staleness


def _runs(r) -> dict[tuple[int, int, str], tuple[list[dict], dict]]:
    """`(lag, seed, arm) -> (step records, final record)`, as `async_staleness.py report` loads them."""
    r(f"{EXPERIMENT}/meta.json")  # the run files' provenance
    runs = {}
    for path in sorted((RESULTS / EXPERIMENT).glob("seed*_lag*_*.jsonl")):
        lines = [json.loads(line) for line in path.read_text(encoding="utf8").splitlines() if line.strip()]
        final = lines[-1]
        runs[(final["lag"], final["seed"], final["arm"])] = (lines[:-1], final)
    return runs


def _auc(rows: list[dict]) -> float:
    return sum(row["reward"] for row in rows) / len(rows)


def _cell(runs, lag: int, arm: str) -> dict:
    """One (lag, arm) of the summary: per-seed values and the drift of the steps after the warm-up."""
    script = _script()
    out = collections.defaultdict(list)
    for (lg, seed, a), (rows, final) in sorted(runs.items(), key=lambda item: item[0][1]):
        if lg != lag or a != arm:
            continue
        out["seeds"].append(seed)
        out["auc"].append(_auc(rows))
        out["steps_to"].append(script._steps_to([row["reward"] for row in rows], script.ACCURACY_TARGET))
        out["heldout"].append(final["heldout_accuracy"])
        late = [row for row in rows if row["step"] > lag]  # after the warm-up, once the lag is reached
        for key in ("bench/abs_logratio", "bench/ess", "bench/frac_over_ln2", "bench/lag_trained"):
            out[key] += [row[key] for row in late]
        ref = runs.get((lag, seed, "C"))
        if ref is not None and arm != "C":
            out["d_auc"].append(out["auc"][-1] - _auc(ref[0]))
            out["d_heldout"].append(final["heldout_accuracy"] - ref[1]["heldout_accuracy"])
    return out


def _mean(values) -> float:
    return sum(values) / len(values) if values else float("nan")


def _signed(x: float) -> str:
    return f"{x:+.2f}".replace("-", "−")


def _mean_sd(values: list[float], signed: bool = False) -> str:
    """`mean ± sd` over the seeds, two decimals (a signed mean for a paired difference)."""
    mean, sd = statistics.mean(values), statistics.stdev(values)
    return f"{_signed(mean) if signed else f'{mean:.2f}'} ± {sd:.2f}"


@table("staleness.summary")
def summary(r) -> str:
    script, runs = _script(), _runs(r)
    lines = [
        "| lag (trained) | arm | seeds | mean \\|Δ log π\\| | ESS | frac \\|Δ\\| > ln 2 | reward AUC | "
        f"steps to {script.ACCURACY_TARGET} | held-out acc. | paired Δ AUC vs C | paired Δ held-out vs C |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lag in sorted({key[0] for key in runs}):
        for arm in script.ARMS:
            c = _cell(runs, lag, arm)
            if not c["seeds"]:
                continue
            d_auc = script._mean_sd(c["d_auc"]) if c["d_auc"] else "–"
            d_held = script._mean_sd(c["d_heldout"], "not measured") if c["d_heldout"] else "–"
            lines.append(
                f"| {_mean(c['bench/lag_trained']):.1f} | {script.ARM_NAMES[arm]} | {len(c['seeds'])} | "
                f"{_mean(c['bench/abs_logratio']):.3f} | {_mean(c['bench/ess']):.3f} | "
                f"{_mean(c['bench/frac_over_ln2']):.3f} | {script._mean_sd(c['auc'])} | "
                f"{script._mean_sd(c['steps_to'])} | {script._mean_sd(c['heldout'], 'not measured')} | "
                f"{d_auc} | {d_held} |"
            )
    return "\n".join(lines)


@table("staleness.drift_by_lag")
def drift_by_lag(r) -> str:
    """Every step of every run (warm-up steps included) by the lag it was trained at."""
    cells: dict[tuple[int, str], list[dict]] = collections.defaultdict(list)
    for (_, _, arm), (rows, _) in _runs(r).items():
        for row in rows:
            cells[(int(row["bench/lag_trained"]), arm)].append(row)
    lines = [
        "| lag (trained) | arm | steps | mean \\|log π_θ − log π_behavior\\| | ESS | frac \\|Δ\\| > ln 2 |",
        "|---|---|---|---|---|---|",
    ]
    for (lag, arm), rows in sorted(cells.items()):
        drift, ess, over = (_mean([row[key] for row in rows]) for key in DRIFT)
        lines.append(f"| {lag} | {arm} | {len(rows)} | {drift:.3f} | {ess:.3f} | {over:.3f} |")
    return "\n".join(lines)


def _range(values: list[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}–{high}"


def _arms_range(key: str, lag: int):
    """The range over the three arms of a drift column's after-warm-up mean at one sampler lag."""

    def render(r) -> str:
        runs = _runs(r)
        return _range([_mean(_cell(runs, lag, arm)[key]) for arm in _script().ARMS])

    return render


def _arm_stat(stat: str, lag: int, arm: str):
    """A per-seed statistic of one arm at one sampler lag, as mean ± sd over the seeds."""

    def render(r) -> str:
        c = _cell(_runs(r), lag, arm)
        return _mean_sd(c[stat], signed=stat.startswith("d_"))

    return render


# The figures the page's reading of the experiment states (each name is used on docs/async.md).
for _lag in LAGS:
    figure(f"staleness.drift.lag{_lag}")(_arms_range("bench/abs_logratio", _lag))
figure("staleness.ess.lag0")(_arms_range("bench/ess", 0))
figure("staleness.ess.lag8")(_arms_range("bench/ess", 8))
for _stat, _arm, _lags in (
    ("heldout", "A", (4, 8)),
    ("heldout", "B", (4, 8)),
    ("heldout", "C", (4, 8)),
    ("auc", "B", (4, 8)),
    ("auc", "C", (4, 8)),
    ("d_auc", "A", (4, 8)),
    ("d_heldout", "A", (4, 8)),
    ("d_heldout", "B", (4, 8)),
):
    for _lag in _lags:
        figure(f"staleness.{_stat}.{_arm}.lag{_lag}")(_arm_stat(_stat, _lag, _arm))


@figure("staleness.frac_over_ln2.max")
def frac_over_ln2_max(r) -> str:
    """The largest after-warm-up fraction of tokens whose probability changed by more than a factor 2 (a cell)."""
    runs = _runs(r)
    cells = [_mean(_cell(runs, lag, arm)["bench/frac_over_ln2"]) for lag in LAGS for arm in _script().ARMS]
    return f"{100 * max(cells):.0f} %"


@figure("staleness.seeds")
def seeds(r) -> str:
    return str(len({key[1] for key in _runs(r)}))


@figure("staleness.B_below_C.lag8")
def b_below_c(r) -> str:
    """In how many seeds arm B's held-out accuracy is below arm C's at sampler lag 8."""
    c = _cell(_runs(r), 8, "B")
    return f"{sum(d < 0 for d in c['d_heldout'])} of {len(c['d_heldout'])}"


@figure("staleness.A_reaches_target.lag8")
def a_reaches_target(r) -> str:
    """In how many seeds arm A's 5-step mean reward reaches the target at sampler lag 8."""
    c = _cell(_runs(r), 8, "A")
    return f"{sum(math.isfinite(s) for s in c['steps_to'])} of {len(c['steps_to'])}"


@figure("staleness.sign_test_min_p")
def sign_test_min_p(r) -> str:
    """The smallest two-sided p-value a sign test over the paired seeds can give (every seed the same sign)."""
    n = len({key[1] for key in _runs(r)})
    return f"{2 * 0.5**n:.3g}"


@figure("staleness.heldout_se")
def heldout_se(r) -> str:
    """The binomial standard error of one held-out accuracy (at 0.5, its largest) over the held-out problems."""
    n = r(f"{EXPERIMENT}/meta.json")["meta"]["heldout_size"]
    return f"{math.sqrt(0.25 / n):.2f}"


# ------------------------------------------------------------------------------------------------------------------
# The async demo's logged run (`async_demo_metrics.jsonl`: its provenance, then one record per optimizer step)


def _demo_steps(r) -> list[dict]:
    return [record for record in r(DEMO) if "loss" in record and "step" in record]


@table("async_demo.metrics")
def demo_metrics(r) -> str:
    steps = _demo_steps(r)

    def col(key):
        return [s[key] for s in steps]

    rows = [  # name, the per-step values averaged, those whose maximum is shown, formats of the two
        ("sample version lag (when trained)", "async/version_lag_mean", "async/version_lag_max", "{:.1f}", "{:.0f}"),
        ("samples dropped as too stale (fraction)", "async/dropped_stale_frac", None, "{:.0f}", "{:.0f}"),
        ("mismatch k3 KL (π_old vs π_behavior)", "mismatch/mismatch_k3_kl", None, "{:.3f}", "{:.3f}"),
        ("rollout IS weight (the step's mean)", "rollout_is/mean", None, "{:.3f}", "{:.2f}"),
        ("time the trainer waited for samples", "perf/rollout_wait_s", None, "{:.1f} s", "{:.0f} s"),
    ]
    lines = [f"| metric (over the {len(steps)} steps) | mean | max |", "|---|---|---|"]
    for name, mean_key, max_key, fmt_mean, fmt_max in rows:
        mean, high = _mean(col(mean_key)), max(col(max_key or mean_key))
        lines.append(f"| {name} | {fmt_mean.format(mean)} | {fmt_max.format(high)} |")
    return "\n".join(lines)


@figure("async_demo.reward")
def demo_reward(r) -> str:
    """The accuracy reward of the first 8 and the last 8 steps, as the run summary line gives it."""
    rewards = [s["rewards/accuracy_reward"] for s in _demo_steps(r)]
    return f"{_mean(rewards[:8]):.2f} → {_mean(rewards[-8:]):.2f}"


@figure("async_demo.mismatch_lag0")
def demo_mismatch_lag0(r) -> str:
    """The mismatch k3 KL of the first step, the only one trained at lag 0."""
    first = next(s for s in _demo_steps(r) if s["async/version_lag_max"] == 0)
    return f"{first['mismatch/mismatch_k3_kl']:.4f}"


@figure("async_demo.mismatch_lagged")
def demo_mismatch_lagged(r) -> str:
    """The median and range of the mismatch k3 KL over the steps that trained stale samples."""
    values = [s["mismatch/mismatch_k3_kl"] for s in _demo_steps(r) if s["async/version_lag_max"] >= 1]
    return f"{statistics.median(values):.3f} (range {min(values):.4f}–{max(values):.3f})"
