"""Number formats shared by the benchmark renderers (loss step, packing, generation, train step, scaling, SP,
engines)."""

from __future__ import annotations


def sec(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f} s"


def mb(x: float) -> str:
    return f"{x:.0f} MB"


def times(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}×"


def span(values, digits: int = 2, unit: str = "×") -> str:
    """`lo–hi` of `values` with `unit` once at the end (one value: just it)."""
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def markdown(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> str:
    align = align or ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
