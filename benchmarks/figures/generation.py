"""Shared-prompt generation (`benchmarks/performance/generation.py`) and the demo run with and without it."""

from __future__ import annotations

import re
import statistics

from ._aggregates import aggregate, recompute
from ._units import times
from .core import figure, table

GENERATE = "generation_generate.json"
DEMO_STEP = "generation_demo_fp32.json"
DEMO_RUN = "demo_shared_generation.json"
VARIANTS = ("today", "shared_concat", "shared")  # every row prefilled, concatenating cache, preallocated buffers
STEP_VARIANTS = {"trl": "stock TRL", "today": "every row", "shared": "shared"}
COMPLETIONS = {"long64": 64, "long256": 256}
# per-run records that are not measurements to take the median of
SAMPLE_ONLY = ("reward", "tokens", "repeat", "started_utc", "load_average_at_start")


@aggregate("generation_", block="rows", every_key=False)
def generation_rows(data: dict, name: str = "") -> dict:
    """The `rows` of a `benchmarks/performance/generation.py` results file from its repeats (`samples`, keyed
    `kind/workload`):
    per workload, kind and variant the median over the repeats of each measure, and the sampled tokens' hashes."""
    rows: dict = {}
    for key, by_variant in data["samples"].items():
        kind, workload = key.split("/")
        rows.setdefault(workload, {})[kind] = {
            variant: {m: statistics.median(run[m] for run in runs) for m in runs[0] if m not in SAMPLE_ONLY}
            for variant, runs in by_variant.items()
        }
        if kind == "generate":
            rows[workload]["tokens"] = {
                variant: [run["tokens"] for run in runs] for variant, runs in by_variant.items()
            }
    return rows


def _generate(r, workload: str) -> dict:
    return recompute(GENERATE, r(GENERATE))[workload]


@table("generation.generate")
def generate(r) -> str:
    samples = r(GENERATE)["samples"]
    lines = [
        "| completion | CPU s: every row → concatenating → shared | shared ÷ every row (per repeat) "
        "| wall s: every row / concatenating / shared | peak MB: every row / concatenating / shared | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for workload, length in COMPLETIONS.items():
        g = _generate(r, workload)["generate"]
        tokens = _generate(r, workload)["tokens"]
        calls = [t for v in VARIANTS for t in tokens[v]]
        same = f"yes, all {len(calls)} calls" if len(set(calls)) == 1 else "no"
        s = samples[f"generate/{workload}"]
        per_repeat = ", ".join(
            times(a["generate_cpu_s"] / b["generate_cpu_s"]) for a, b in zip(s["shared"], s["today"])
        )
        cpu = " → ".join(f"{g[v]['generate_cpu_s']:.2f}" for v in VARIANTS)
        wall = " / ".join(f"{g[v]['generate_s']:.1f}" for v in VARIANTS)
        peak = " / ".join(f"{g[v]['peak_mb']:.0f}" for v in VARIANTS)
        ratio = times(g["shared"]["generate_cpu_s"] / g["today"]["generate_cpu_s"])
        lines.append(f"| {length} tokens | {cpu} | **{ratio}** ({per_repeat}) | {wall} | {peak} | {same} |")
    return "\n".join(lines)


@figure("generation.concatenating_256")
def concatenating_256(r) -> str:
    g = _generate(r, "long256")["generate"]
    return times(g["shared_concat"]["generate_cpu_s"] / g["today"]["generate_cpu_s"])


@figure("generation.decode_step_ms")
def decode_step_ms(r) -> str:
    """CPU time per decoding step: the difference of the 256- and 64-token calls over the extra steps."""
    long, short = _generate(r, "long256")["generate"], _generate(r, "long64")["generate"]
    steps = COMPLETIONS["long256"] - COMPLETIONS["long64"]
    ms = [(long[v]["generate_cpu_s"] - short[v]["generate_cpu_s"]) / steps * 1000 for v in VARIANTS]
    return f"{ms[0]:.0f} ms, {ms[1]:.0f} ms and {ms[2]:.0f} ms"


def _demo_runs(r) -> dict[str, list[dict]]:
    """The demo step's repeats per variant, each with its repeat index."""
    runs = r(DEMO_STEP)["samples"]["step/demo"]
    return {v: [{"repeat": i} | run for i, run in enumerate(runs[v])] for v in STEP_VARIANTS}


def _demo_medians(r) -> dict:
    return recompute(DEMO_STEP, r(DEMO_STEP))["demo"]["step"]


def _repeats(n: int) -> str:
    return "one repeat" if n == 1 else f"{n} repeats"


@figure("generation.demo_step_repeats")
def demo_step_repeats(r) -> str:
    """How many repeats the demo-step table's medians are of, and how they were ordered."""
    n = len(_demo_runs(r)["shared"])
    return (
        "**one repeat only**" if n == 1 else f"the median of {n} repeats, the variants interleaved in rotating order"
    )


def _load(run: dict) -> str:
    load = run.get("load_average_at_start")
    return f"load {load[0]:.1f}" if load else "load not recorded"


def _order(runs: dict[str, list[dict]], repeat: int) -> str:
    """The order the variants ran in within one repeat (by their start times, when recorded)."""
    started = {v: runs[v][repeat].get("started_utc") for v in STEP_VARIANTS}
    if not all(started.values()):
        return "order not recorded"
    return "order: " + ", ".join(STEP_VARIANTS[v] for v in sorted(started, key=started.get))


@table("generation.demo_step")
def demo_step(r) -> str:
    """The demo's whole step per variant: the medians over the repeats, then each repeat's CPU and wall seconds and
    the load at its start (1-minute load average), with the ratios of that repeat."""
    x, runs = _demo_medians(r), _demo_runs(r)
    trl, every, shared = x["trl"], x["today"], x["shared"]
    n = len(runs["shared"])
    of = f" (median of {n})" if n > 1 else ""
    lines = [
        "| | stock TRL | every row prefilled (`shared_prompt_generation=False`) | shared (default) "
        "| shared ÷ every row | shared ÷ stock TRL |",
        "|---|---|---|---|---|---|",
    ]
    measures = (("step_cpu_s", "step, CPU s"), ("step_s", "step, wall s"), ("generation_cpu_s", "generation, CPU s"))
    for key, label in measures:
        lines.append(
            f"| {label}{of} | {trl[key]:.2f} | {every[key]:.2f} | {shared[key]:.2f} "
            f"| {times(shared[key] / every[key])} | {times(shared[key] / trl[key])} |"
        )
    lines.append(f"| peak MB{of} | {trl['peak_mb']:.0f} | {every['peak_mb']:.0f} | {shared['peak_mb']:.0f} | | |")
    for i in range(n):
        cells = [runs[v][i] for v in STEP_VARIANTS]
        trl_i, every_i, shared_i = cells

        def ratio(a: dict, b: dict) -> str:
            return f"{times(a['step_cpu_s'] / b['step_cpu_s'])} / {times(a['step_s'] / b['step_s'])}"

        lines.append(
            f"| repeat {i + 1} ({_order(runs, i)}): step CPU s / wall s, load at its start | "
            + " | ".join(f"{c['step_cpu_s']:.2f} / {c['step_s']:.2f}, {_load(c)}" for c in cells)
            + f" | {ratio(shared_i, every_i)} | {ratio(shared_i, trl_i)} |"
        )
    return "\n".join(lines)


@figure("generation.demo_generation_share")
def demo_generation_share(r) -> str:
    """Generation's share of the shared variant's step, in CPU seconds (medians)."""
    shared = _demo_medians(r)["shared"]
    return f"{shared['generation_cpu_s'] / shared['step_cpu_s'] * 100:.0f} %"


@figure("generation.demo_generation_saved")
def demo_generation_saved(r) -> str:
    """The share of generation's CPU seconds that sharing the prompts saves (medians)."""
    x = _demo_medians(r)
    return f"{(1 - x['shared']['generation_cpu_s'] / x['today']['generation_cpu_s']) * 100:.0f} %"


def _wall_s(span: str) -> int:
    """Seconds between the two `HH:MM:SS` of `00:19:55-00:26:47 UTC, ...` (same day)."""
    start, end = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in re.findall(r"(\d\d):(\d\d):(\d\d)", span)[:2]]
    return end - start


def _min_s(seconds: int) -> str:
    return f"{seconds // 60} min {seconds % 60} s"


@table("generation.demo_run")
def demo_run(r) -> str:
    data = r(DEMO_RUN)
    every, shared = data["runs"]["today"], data["runs"]["shared"]
    wall = {k: _wall_s(data["meta"]["runs"][k]) for k in ("today", "shared")}
    steps = len(shared["step_time_s"])
    lines = [
        "| | every row prefilled (`shared_prompt_generation=False`) | shared (default) | shared ÷ every row |",
        "|---|---|---|---|",
    ]
    for label, fn in ((f"mean step time ({steps} steps)", statistics.mean), ("median step time", statistics.median)):
        a, b = fn(every["step_time_s"]), fn(shared["step_time_s"])
        lines.append(f"| {label} | {a:.2f} s | {b:.2f} s | {times(b / a)} |")
    lines.append(
        f"| wall time of the run (evaluations, model load and save included) | {_min_s(wall['today'])} "
        f"| {_min_s(wall['shared'])} | {times(wall['shared'] / wall['today'])} |"
    )

    def reward(run: dict) -> str:
        rw = run["reward"]
        return f"{statistics.mean(rw[:8]):.2f} → {statistics.mean(rw[-8:]):.2f}"

    def heldout(run: dict) -> str:
        return f"{run['heldout_accuracy'][0][1]:.2f} → {run['heldout_accuracy'][-1][1]:.2f}"

    first, last = shared["heldout_accuracy"][0][0], shared["heldout_accuracy"][-1][0]
    lines.append(f"| accuracy reward, first 8 → last 8 steps | {reward(every)} | {reward(shared)} | |")
    lines.append(
        f"| held-out accuracy (greedy, 64 prompts), step {first} → {last} | {heldout(every)} | {heldout(shared)} | |"
    )
    return "\n".join(lines)
