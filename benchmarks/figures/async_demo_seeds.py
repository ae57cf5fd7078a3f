"""The asynchronous demo over seeds (`python -m benchmarks.experiments.demo_seeds --demo async`): held-out accuracy
before and after training, greedy, as the synchronous demo's."""

from __future__ import annotations

from benchmarks.shared.stats import format_p, paired_t

from ._aggregates import aggregate
from .core import plot, table
from .demo import seed_sweep, span
from .plots import seed_curves

SEEDS = "async_demo_seeds.json"

aggregate("async_demo_seeds")(seed_sweep)


@table("async_demo.seeds")
def seeds(r) -> str:
    """Per seed, then the held-out gain (after − before) with its 95 % interval, paired over seeds and over items
    pooled across seeds (each seed draws its own held-out problems)."""
    data = r(SEEDS)
    rows = [
        "| seed | accuracy reward, first 8 → last 8 steps | held-out accuracy (greedy), step 0 → 40 |",
        "|---|---|---|",
    ]
    for run in data["runs"]:
        rows.append(
            f"| {run['seed']} | {run['reward_first']:.2f} → {run['reward_last']:.2f} | {run['heldout_before']:.2f} → "
            f"{run['heldout_after']:.2f} |"
        )
    runs = data["runs"]
    rows.append("")
    if len(runs) > 1:
        before = [run["heldout_before"] for run in runs]
        after = [run["heldout_after"] for run in runs]
        last = [max((k for k in run["heldout"] if k.startswith("step_")), key=lambda k: int(k[5:])) for run in runs]
        items_before = [c for run in runs for c in run["heldout"]["step_0"]["greedy"]["correct"]]
        items_after = [c for run, k in zip(runs, last) for c in run["heldout"][k]["greedy"]["correct"]]
        for label, x, y in (("seeds", after, before), ("items, pooled over seeds", items_after, items_before)):
            t = paired_t(x, y)
            rows.append(
                f"Held-out gain, paired over {t['n']} {label}: {t['mean_diff']:+.3f} (95 % CI {t['ci'][0]:+.3f} to "
                f"{t['ci'][1]:+.3f}), t({t['df']}) = {t['t']:.2f}, {format_p(t['p'])}."
            )
            rows.append("")
    summary = seed_sweep(data)
    rows.append(
        f"Over the {len(runs)} seeds: held-out {span(summary['heldout_before'])} before, "
        f"{span(summary['heldout_after'])} after."
    )
    return "\n".join(rows).rstrip()


@plot("docs/async_demo_seeds.png")
def curves(r):
    """Per seed: the accuracy reward per step, and the held-out accuracy at step 0 and at the end."""
    return seed_curves(r(SEEDS))
