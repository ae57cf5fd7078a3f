"""The loss step's time and memory against completion length (`benchmarks/performance/scaling.py`)."""

from __future__ import annotations

from ._aggregates import aggregate, recompute
from ._units import mb, sec
from .core import figure, table

METHODS = ("hf_rlloss", "trl_chunked", "naive")


def _per_1k(rows: list[dict], key: str) -> float:
    """Least-squares slope of `key` against tokens, per 1,000 tokens."""
    xs = [x["tokens"] / 1000 for x in rows]
    ys = [x[key] for x in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)


def _per_1k_time(rows: list[dict], method: str) -> float:
    return _per_1k(rows, f"{method}_s")


@aggregate("scaling", block="memory_mb_per_1k_tokens")
def memory_per_1k(data: dict, name: str = "") -> dict:
    """The peak memory's least-squares slope against tokens, per 1,000 tokens, of each method (from the rows)."""
    return {m: _per_1k(data["rows"], f"{m}_peak_mb") for m in METHODS if f"{m}_peak_mb" in data["rows"][0]}


@table("scaling")
def scaling(r) -> str:
    data = r("scaling.json")
    lines = ["| tokens | hf_rlloss | TRL chunked | naive logits |", "|---:|---|---|---|"]
    for x in data["rows"]:
        cells = [f"{sec(x[f'{m}_s'])}, {mb(x[f'{m}_peak_mb'])}" for m in METHODS]
        lines.append(f"| {x['tokens']:,} | " + " | ".join(cells) + " |")
    growth = recompute("scaling.json", data)
    lines.append(
        f"| **memory per 1k tokens** | **{growth['hf_rlloss']:.1f} MB** | {growth['trl_chunked']:.0f} MB (flat past "
        f"its 4096-token tile) | {growth['naive']:.0f} MB |"
    )
    lines.append("| time per 1k tokens | " + " | ".join(sec(_per_1k_time(data["rows"], m)) for m in METHODS) + " |")
    return "\n".join(lines)


@figure("scaling.hf_rlloss_mb_per_1k")
def hf_rlloss_mb_per_1k(r) -> str:
    return f"{recompute('scaling.json', r('scaling.json'))['hf_rlloss']:.1f} MB"
