"""Packed forwards: `packing="shared_prefix"` against the padded batch (`benchmarks/performance/packing.py`)."""

from __future__ import annotations

import statistics

from ._aggregates import aggregate, recompute
from ._units import times
from .core import figure, table

IDLE = {1: "packing_idle_1proc.json", 2: "packing_idle_2proc.json"}
DEMO = "packing_demo_1proc.json"
ALL_MODES = "packing_1proc.json"  # all three modes, under load: its position counts only
WORKLOADS = {
    "long": "(b) 1,024-token prompts, G = 8, completions 64–256",
    "reasoning": "(c) 128-token prompts, G = 8, completions 32–2,048",
}


G = 8  # completions per prompt in every workload


def _summary(runs: list[dict]) -> dict:
    """One mode's repeats: the median, min and max of the step and training-phase times and of the peak memory;
    the positions padded and forwarded in the last repeat's timed step; `G × (prompt + longest completion)` over
    `(prompt + Σ completions)` of that step's group (the arithmetic share of `shared_prefix`, synthetic workloads)."""

    def spread(key: str) -> dict:
        values = [run[key] for run in runs]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    last = runs[-1]
    out = {key: spread(key) for key in ("step_s", "train_s", "peak_mb")}
    out["padded_tokens"] = last["padded_tokens"][-1] if last["padded_tokens"] else None
    out["forwarded_tokens"] = last["forwarded_tokens"][-1] if last["forwarded_tokens"] else None
    if "lengths" in last:
        lengths, prompt = last["lengths"][-1], last["prompt_tokens"]
        out["arithmetic_ratio"] = G * (prompt + max(lengths)) / (prompt + sum(lengths))
    else:
        out["arithmetic_ratio"] = None
    if "reward" in last:
        out["reward"] = [run["reward"] for run in runs]
    return out


@aggregate("packing_demo_", block="rows", every_key=False)
@aggregate("packing_idle_", block="rows", every_key=False)
def packing_rows(data: dict, name: str = "") -> dict:
    """The `rows` of a `benchmarks/performance/packing.py` results file from its repeats (`samples`, keyed
    `workload|processes|mode`): `{"workload|processes": {mode: _summary(repeats)}}`."""
    rows: dict = {}
    for key, runs in data["samples"].items():
        workload, processes, mode = key.split("|")
        rows.setdefault(f"{workload}|{processes}", {})[mode] = _summary(runs)
    return rows


def _rows(r, name: str) -> dict:
    return recompute(name, r(name))


def _cell(r, processes: int, workload: str) -> dict:
    return _rows(r, IDLE[processes])[f"{workload}|{processes}"]


def _ratio(x: dict, key: str = "train_s") -> float:
    return x["shared_prefix"][key]["median"] / x["off"][key]["median"]


@table("packing.summary")
def summary(r) -> str:
    demo = _rows(r, DEMO)["demo|1"]
    lines = [
        "| workload | `shared_prefix` ÷ `off`, 1 process | 2 processes | peak memory ÷ `off`, 1 / 2 processes |",
        "|---|---|---|---|",
        f"| (a) demo recipe (training phase; whole step) | {times(_ratio(demo))}; {times(_ratio(demo, 'step_s'))} "
        f"| — | {times(_ratio(demo, 'peak_mb'))} / — |",
    ]
    for workload, label in WORKLOADS.items():
        one, two = _cell(r, 1, workload), _cell(r, 2, workload)
        lines.append(
            f"| {label} | **{times(_ratio(one))}** | **{times(_ratio(two))}** "
            f"| {times(_ratio(one, 'peak_mb'))} / {times(_ratio(two, 'peak_mb'))} |"
        )
    return "\n".join(lines)


def _time(t: dict) -> str:
    if t["min"] == t["max"]:
        return f"{t['median']:.2f} s"
    return f"{t['median']:.2f} s [{t['min']:.2f}–{t['max']:.2f}]"


@table("packing.training_phase")
def training_phase(r) -> str:
    lines = [
        "| workload | processes | `shared_prefix` training phase | `off` | ratio | peak RSS `shared_prefix` / `off` "
        "| padded ÷ forwarded positions (arithmetic) |",
        "|---|---|---|---|---|---|---|",
    ]
    for processes in IDLE:
        for workload, label in WORKLOADS.items():
            x = _cell(r, processes, workload)
            ours, off = x["shared_prefix"], x["off"]
            rank = " (rank 0)" if processes > 1 else ""
            positions = f"{ours['padded_tokens'] / ours['forwarded_tokens']:.2f} ({ours['arithmetic_ratio']:.2f})"
            lines.append(
                f"| {label if processes == 1 else label.split(' ')[0]} | {processes} | {_time(ours['train_s'])} "
                f"| {_time(off['train_s'])} | **{times(_ratio(x))}** "
                f"| {ours['peak_mb']['median']:,.0f} / {off['peak_mb']['median']:,.0f} MB{rank} | {positions} |"
            )
    return "\n".join(lines)


@table("packing.demo")
def demo(r) -> str:
    x = _rows(r, DEMO)["demo|1"]
    off = x["off"]
    lines = [
        "| mode | whole step (s) | vs `off` | training phase (s) | vs `off` | generation (s) | peak RSS (MB) "
        "| padded ÷ forwarded |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("shared_prefix", "padding_free", "off"):
        m = x[mode]
        step, train = m["step_s"]["median"], m["train_s"]["median"]
        padded, forwarded = m["padded_tokens"], m["forwarded_tokens"]
        lines.append(
            f"| `{mode}` | {step:.2f} | {times(step / off['step_s']['median'])} | {train:.2f} "
            f"| {times(train / off['train_s']['median'])} | {step - train:.2f} | {m['peak_mb']['median']:,.0f} "
            f"| {padded:.0f} / {forwarded:.0f} = {padded / forwarded:.2f} |"
        )
    return "\n".join(lines)


def _padding_free(r, workload: str) -> str:
    tokens = r(ALL_MODES)["tokens_timed_step"][workload]
    return times(tokens["padding_free"] / tokens["padded"])


@figure("packing.padding_free_positions_long")
def padding_free_long(r) -> str:
    return _padding_free(r, "long")


@figure("packing.padding_free_positions_reasoning")
def padding_free_reasoning(r) -> str:
    return _padding_free(r, "reasoning")
