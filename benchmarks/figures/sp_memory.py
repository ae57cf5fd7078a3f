"""Per-rank memory and step time under sequence parallelism (`benchmarks/performance/sp_memory.py`)."""

from __future__ import annotations

from ._units import times
from .core import figure, table


def _rows(r) -> list[dict]:
    return r("sp_memory.json")["rows"]


def _sp1(rows: list[dict], tokens: int) -> float:
    return next(x["peak_mb_max"] for x in rows if x["tokens"] == tokens and x["sp"] == 1)


@table("sp_memory")
def sp_memory(r) -> str:
    rows = _rows(r)
    lines = [
        "| tokens | sp | tokens per rank | peak MB per rank | vs sp=1 | step |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for x in rows:
        ratio = times(x["peak_mb_max"] / _sp1(rows, x["tokens"]))
        lines.append(
            f"| {x['tokens']} | {x['sp']} | {x['local_tokens']} | {x['peak_mb_max']:.0f} | {ratio} "
            f"| {x['step_s']:.2f} s |"
        )
    return "\n".join(lines)


@figure("sp_memory.summary")
def summary(r) -> str:
    """`2k tokens 225 → 136 MB (0.61×), ...` from sp=1 to sp=2."""
    rows = _rows(r)
    parts = []
    for x in rows:
        if x["sp"] == 2:
            one = _sp1(rows, x["tokens"])
            parts.append(
                f"{x['tokens'] // 1024}k tokens {one:.0f} → {x['peak_mb_max']:.0f} MB "
                f"({times(x['peak_mb_max'] / one)})"
            )
    return ", ".join(parts)
