"""The demo with and without dynamic sampling, over seeds (`benchmarks/experiments/demo_seeds.py`, with and without
`--set dynamic_sampling=true`)."""

from __future__ import annotations

from benchmarks.shared.stats import paired_t

from .core import table

OFF, ON = "demo_seeds.json", "demo_seeds_ds.json"
MEASURES = (("reward_last", "accuracy reward, last 8 steps"), ("heldout_after", "held-out accuracy, step 40"))


def _runs(r, name: str) -> dict[int, dict]:
    return {run["seed"]: run for run in r(name)["runs"]}


@table("dynamic_sampling.seeds")
def seeds(r) -> str:
    """Per seed, the demo without (`off`) and with (`on`) dynamic sampling; then, over the seeds both ran, the
    paired difference on − off with its 95 % interval (paired t)."""
    off, on = _runs(r, OFF), _runs(r, ON)
    common = sorted(set(off) & set(on))
    rows = [
        "| seed | dynamic sampling | accuracy reward, first 8 → last 8 steps | held-out accuracy, step 0 → 40 "
        "| mean step time |",
        "|---|---|---|---|---|",
    ]
    for seed in common:
        for label, run in (("off", off[seed]), ("on", on[seed])):
            rows.append(
                f"| {seed} | {label} | {run['reward_first']:.2f} → {run['reward_last']:.2f} "
                f"| {run['heldout_before']:.2f} → {run['heldout_after']:.2f} | {run['step_s']:.1f} s |"
            )
    for key, name in MEASURES:
        t = paired_t([on[s][key] for s in common], [off[s][key] for s in common])
        rows.append(
            f"| on − off, {len(common)} seeds | {name} | {t['mean_diff']:+.3f} "
            f"[{t['ci'][0]:+.3f}, {t['ci'][1]:+.3f}] (95 % CI) | t({t['df']}) = {t['t']:.2f}, p = {t['p']:.2f} | |"
        )
    return "\n".join(rows)
