"""The loss step from hidden states (`benchmarks/performance/loss_step.py`): hf_rlloss against TRL's chunked kernel,
naive logits
and the three-GEMM floor."""

from __future__ import annotations

import statistics

from ._aggregates import aggregate, recompute
from ._units import mb, sec, span, times
from .core import figure, table

# (dtype, vocab) -> results file, in the table's order
FILES = {
    ("bf16", 49152): "loss_step_bf16_49k.json",
    ("bf16", 151936): "loss_step_bf16_152k.json",
    ("fp32", 49152): "loss_step_fp32_49k.json",
    ("fp32", 151936): "loss_step_fp32_152k.json",
}
TRL_FP32_152K = "loss_step_fp32_152k_trl.json"  # TRL at fp32 152k: a separate run
METHODS = ("hf_rlloss", "trl_chunked", "naive", "gemm_floor")


@aggregate("loss_step_", block="rows", every_key=False, abs_tol=2e-3)  # per-run times are recorded to the ms
def loss_step_rows(data: dict, name: str = "") -> list[dict]:
    """Per row of a `benchmarks/performance/loss_step.py` results file, from its repeats: each method's median time
    (`{method}_runs_s`) and peak memory (`{method}_runs_peak_mb`, where recorded), and hf_rlloss ÷ floor per repeat.
    A row without repeats (one run) is its own median."""
    out = []
    for x in data["rows"]:
        row = {}
        for method in METHODS:
            for runs, median in ((f"{method}_runs_s", f"{method}_s"), (f"{method}_runs_peak_mb", f"{method}_peak_mb")):
                if runs in x:
                    row[median] = statistics.median(x[runs])
        if "hf_rlloss_runs_s" in x and "gemm_floor_runs_s" in x:
            pairs = zip(x["hf_rlloss_runs_s"], x["gemm_floor_runs_s"])
            row["floor_ratio_per_repeat"] = [a / b for a, b in pairs]
        out.append(row)
    return out


def rows(r, name: str) -> list[dict]:
    """A results file's rows with every median recomputed from its repeats (the peak memory of a file that recorded
    only its median per method: that median)."""
    return [x | computed for x, computed in zip(r(name)["rows"], recompute(name, r(name)))]


def row(r, key) -> dict:
    return rows(r, FILES[key])[0]


def cell(x: dict, method: str) -> str:
    if f"{method}_s" not in x:
        return "—"
    return f"{sec(x[f'{method}_s'])}, {mb(x[f'{method}_peak_mb'])}"


def with_trl(r) -> list[dict]:
    rows = [row(r, key) for key in FILES]
    return [x for x in rows if "trl_chunked_s" in x]


@table("loss_step")
def loss_step_table(r) -> str:
    lines = [
        "| dtype | vocab | hf_rlloss | TRL chunked | naive logits | 3-GEMM floor "
        "| ÷ floor (ratio of the median times; per repeat) | vs naive | vs TRL (time / memory) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (dtype, vocab), _ in FILES.items():
        x = row(r, (dtype, vocab))
        floor = x["hf_rlloss_s"] / x["gemm_floor_s"]
        repeats = ", ".join(f"{v:.2f}" for v in x["floor_ratio_per_repeat"])
        naive = f"{times(x['naive_s'] / x['hf_rlloss_s'])} faster"
        trl = "—"
        if "trl_chunked_s" in x:
            trl = (
                f"{times(x['trl_chunked_s'] / x['hf_rlloss_s'])} faster / "
                f"{times(x['hf_rlloss_peak_mb'] / x['trl_chunked_peak_mb'])}"
            )
        cells = [
            dtype,
            f"{vocab:,}",
            cell(x, "hf_rlloss"),
            cell(x, "trl_chunked"),
            cell(x, "naive"),
            cell(x, "gemm_floor"),
            f"**{floor:.2f}**; {repeats}",
            naive,
            trl,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@figure("loss_step.trl_speedup_range")
def trl_speedup_range(r) -> str:
    return span([x["trl_chunked_s"] / x["hf_rlloss_s"] for x in with_trl(r)], digits=1)


@figure("loss_step.trl_memory_range")
def trl_memory_range(r) -> str:
    return span([x["hf_rlloss_peak_mb"] / x["trl_chunked_peak_mb"] for x in with_trl(r)])


@figure("loss_step.floor_range")
def floor_range(r) -> str:
    return span([row(r, key)["hf_rlloss_s"] / row(r, key)["gemm_floor_s"] for key in FILES])


@figure("loss_step.floor_repeat_max")
def floor_repeat_max(r) -> str:
    return times(max(v for key in FILES for v in row(r, key)["floor_ratio_per_repeat"]))


@figure("loss_step.naive_speedup_range")
def naive_speedup_range(r) -> str:
    return span([row(r, key)["naive_s"] / row(r, key)["hf_rlloss_s"] for key in FILES])


@figure("loss_step.fp32_49k_floor_runs")
def fp32_49k_floor_runs(r) -> str:
    return span(row(r, ("fp32", 49152))["gemm_floor_runs_s"], unit=" s")


@figure("loss_step.trl_fp32_152k")
def trl_fp32_152k(r) -> str:
    x = rows(r, TRL_FP32_152K)[0]
    return cell(x, "trl_chunked")
