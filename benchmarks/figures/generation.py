"""Shared-prompt generation (`benchmarks/generation.py`) and the demo run with and without it."""

from __future__ import annotations

import re
import statistics

from ._units import times
from .core import figure, table

GENERATE = "generation_generate.json"
DEMO_STEP = "generation_demo_fp32.json"
DEMO_RUN = "demo_shared_generation.json"
VARIANTS = ("today", "shared_concat", "shared")  # every row prefilled, concatenating cache, preallocated buffers
COMPLETIONS = {"long64": 64, "long256": 256}


def _generate(r, workload: str) -> dict:
    return r(GENERATE)["rows"][workload]


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


@table("generation.demo_step")
def demo_step(r) -> str:
    x = r(DEMO_STEP)["rows"]["demo"]["step"]
    trl, every, shared = x["trl"], x["today"], x["shared"]
    lines = [
        "| | stock TRL | every row prefilled (`shared_prompt_generation=False`) | shared (default) "
        "| shared ÷ every row | shared ÷ stock TRL |",
        "|---|---|---|---|---|---|",
    ]
    measures = (("step_cpu_s", "step, CPU s"), ("step_s", "step, wall s"), ("generation_cpu_s", "generation, CPU s"))
    for key, label in measures:
        lines.append(
            f"| {label} | {trl[key]:.2f} | {every[key]:.2f} | {shared[key]:.2f} "
            f"| {times(shared[key] / every[key])} | {times(shared[key] / trl[key])} |"
        )
    lines.append(f"| peak MB | {trl['peak_mb']:.0f} | {every['peak_mb']:.0f} | {shared['peak_mb']:.0f} | | |")
    return "\n".join(lines)


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
