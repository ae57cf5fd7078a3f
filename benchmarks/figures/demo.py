"""The README demo: its outcome over seeds (`benchmarks/experiments/demo_seeds.py`)."""

from __future__ import annotations

import statistics

from ._aggregates import aggregate, recompute, spread
from .core import figure, table

SEEDS = "demo_seeds.json"


def span(stat: dict, fmt: str = "{:.2f}", sep: str = "–") -> str:
    """`min–max` of a spread, or the single value when every seed gave it."""
    low, high = fmt.format(stat["min"]), fmt.format(stat["max"])
    return low if low == high else f"{low}{sep}{high}"


# the outcomes of a demo run that a seed sweep aggregates (those every run has)
OUTCOMES = ("reward_first", "reward_last", "heldout_before", "heldout_after", "step_s", "wall_s")
OUTCOMES += ("turns_first", "turns_last", "heldout_untrained")
OUTCOMES += ("completion_length_first", "completion_length_last", "mismatch_abs_logp_first", "mismatch_abs_logp_last")


@aggregate("demo_seeds")
@aggregate("agentic_demo_")
def seed_sweep(data: dict, name: str = "") -> dict:
    """The spread over the seeds of each outcome of a seed sweep (`benchmarks/experiments/demo_seeds.py`), from its
    `runs`
    (superseded rows, kept under `superseded`, are not runs)."""
    rows = data["runs"]
    out = {
        key: spread([row[key] for row in rows]) | {"n": len(rows)} for key in OUTCOMES if all(key in r for r in rows)
    }
    out["heldout_gain"] = spread([row["heldout_after"] - row["heldout_before"] for row in rows]) | {"n": len(rows)}
    return out


def _aggregate(r) -> dict:
    return recompute(SEEDS, r(SEEDS))


@figure("demo.seeds")
def seeds(r) -> str:
    return str(len(r(SEEDS)["runs"]))


@figure("demo.reward_first")
def reward_first(r) -> str:
    return span(_aggregate(r)["reward_first"])


@figure("demo.reward_last")
def reward_last(r) -> str:
    return span(_aggregate(r)["reward_last"])


@figure("demo.heldout_before")
def heldout_before(r) -> str:
    return span(_aggregate(r)["heldout_before"])


@figure("demo.heldout_after")
def heldout_after(r) -> str:
    return span(_aggregate(r)["heldout_after"])


@figure("demo.heldout_gain")
def heldout_gain(r) -> str:
    return span(_aggregate(r)["heldout_gain"], "{:+.2f}", " to ")


@figure("demo.machine")
def machine(r) -> str:
    meta = r(SEEDS)["meta"]
    return f"{meta['machine']['kind']}, {meta['precision']}"


@table("demo_seeds")
def demo_seeds(r) -> str:
    data = r(SEEDS)
    rows = [
        "| seed | accuracy reward, first 8 → last 8 steps | held-out accuracy, step 0 → 40 | run "
        "| load average at start |",
        "|---|---|---|---|---|",
    ]
    for run in data["runs"]:
        rows.append(
            f"| {run['seed']} | {run['reward_first']:.2f} → {run['reward_last']:.2f} "
            f"| {run['heldout_before']:.2f} → {run['heldout_after']:.2f} | {run['wall_s'] / 60:.1f} min "
            f"| {run['load_average_at_start'][0]:.1f} |"
        )
    agg = recompute(SEEDS, data)

    def mean_sd(key: str) -> str:
        return f"{agg[key]['mean']:.2f} ± {agg[key]['sd']:.2f}"

    rows.append(
        f"| mean ± sd | {mean_sd('reward_first')} → {mean_sd('reward_last')} "
        f"| {mean_sd('heldout_before')} → {mean_sd('heldout_after')} | | |"
    )
    return "\n".join(rows)


@figure("demo.length_first")
def length_first(r) -> str:
    return span(_aggregate(r)["completion_length_first"], "{:.0f}")


@figure("demo.length_last")
def length_last(r) -> str:
    return span(_aggregate(r)["completion_length_last"], "{:.0f}")


@figure("demo.mismatch")
def mismatch(r) -> str:
    agg = _aggregate(r)
    both = {"min": min(agg["mismatch_abs_logp_first"]["min"], agg["mismatch_abs_logp_last"]["min"])}
    both["max"] = max(agg["mismatch_abs_logp_first"]["max"], agg["mismatch_abs_logp_last"]["max"])
    return span(both)


@figure("demo.fp32_run")
def fp32_run(r) -> str:
    """The float32 run of the demo on a CPU without AVX-512 (the shared-prompt generation measurement)."""
    data = r("demo_shared_generation.json")
    run = data["runs"]["shared"]  # per-step series, as the run logged them (the run summary's 8 steps)
    first, last = statistics.fmean(run["reward"][:8]), statistics.fmean(run["reward"][-8:])
    before, after = run["heldout_accuracy"][0][1], run["heldout_accuracy"][-1][1]
    return (
        f"an accuracy reward of {first:.2f} → {last:.2f} and a held-out accuracy of {before:.2f} → {after:.2f} "
        f"({data['meta']['machine']['cpu']})"
    )
