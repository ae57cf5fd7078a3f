"""Aggregates are recomputed from the per-run rows, never read.

A results file may store an aggregate of its runs (`aggregate`: the spread of each outcome over the seeds) for a
reader of the JSON; the renderers compute every aggregate they show from the rows (`recompute`), and the check fails
when a stored aggregate differs from its recomputation, naming the figures that read the file.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

RECOMPUTE: dict[str, Callable[[dict], dict]] = {}


def spread(values: list[float]) -> dict:
    """min, max, mean and sample standard deviation (0 for one value) of a list of run outcomes."""
    values = [float(v) for v in values]
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"min": min(values), "max": max(values), "mean": statistics.fmean(values), "sd": sd}


def aggregate(prefix: str):
    """Register the recomputation of the `aggregate` block of the results files whose name starts with `prefix`."""

    def register(fn):
        RECOMPUTE[prefix] = fn
        return fn

    return register


def recompute(name: str, data: dict) -> dict:
    for prefix, fn in RECOMPUTE.items():
        if name.startswith(prefix):
            return fn(data)
    raise KeyError(f"no recomputation registered for {name}")


def _differences(stored, computed, path: str = "") -> list[str]:
    if isinstance(stored, dict) and isinstance(computed, dict):
        out = []
        for key in sorted(set(stored) | set(computed)):
            if key not in computed or key not in stored:
                out.append(f"{path}{key}: {'not recomputed' if key not in computed else 'missing'}")
            else:
                out += _differences(stored[key], computed[key], f"{path}{key}.")
        return out
    if isinstance(stored, (int, float)) and isinstance(computed, (int, float)):
        same = math.isclose(stored, computed, rel_tol=1e-9, abs_tol=1e-12)
        return [] if same else [f"{path.rstrip('.')}: stored {stored!r}, runs give {computed!r}"]
    return [] if stored == computed else [f"{path.rstrip('.')}: stored {stored!r}, runs give {computed!r}"]


def problems(name: str) -> list[str]:
    """A stored aggregate that the file's runs do not give."""
    from .core import Results

    data = Results()(name)
    if not (isinstance(data, dict) and "aggregate" in data):
        return []
    try:
        computed = recompute(name, data)
    except KeyError as err:
        return [f"benchmarks/results/{name}: {err.args[0]}"]
    return [f"benchmarks/results/{name}: aggregate {d}" for d in _differences(data["aggregate"], computed)]
