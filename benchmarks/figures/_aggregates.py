"""Aggregates are recomputed from the per-run rows, never read.

A results file may store aggregates of its runs for a reader of the JSON: the spread of each outcome over the seeds
(`aggregate`), the medians of a benchmark's repeats (`rows`, next to the repeats under `samples`), the statistics of
an experiment's per-seed files (`staleness_v2/analysis.json`). The renderers compute every aggregate they show from
the runs (`recompute`), and the check fails when a stored aggregate differs from its recomputation, naming the
figures that read the file.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Recomputation:
    """How a results file's stored aggregates are recomputed from its runs.

    Args:
        fn: `fn(data, name) -> dict`, the aggregates from the runs.
        block: the key of the stored block that `fn` recomputes (`None`: the whole file but its `meta`).
        every_key: whether every key of the stored block must be recomputed (an `aggregate` block holds nothing
            else); otherwise only the keys `fn` returns are compared (a `rows` block also holds counts and labels).
        abs_tol: the absolute tolerance of the comparison (per-run values recorded rounded).
    """

    fn: Callable[[dict, str], dict]
    block: str | None = "aggregate"
    every_key: bool = True
    abs_tol: float = 1e-12


RECOMPUTE: dict[str, Recomputation] = {}


def spread(values: list[float]) -> dict:
    """min, max, mean and sample standard deviation (0 for one value) of a list of run outcomes."""
    values = [float(v) for v in values]
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"min": min(values), "max": max(values), "mean": statistics.fmean(values), "sd": sd}


def aggregate(prefix: str, block: str | None = "aggregate", every_key: bool = True, abs_tol: float = 1e-12):
    """Register `fn(data, name)`, the recomputation of the stored `block` of the results files whose name starts
    with `prefix`."""

    def register(fn):
        if prefix in RECOMPUTE:
            raise ValueError(f"a recomputation for {prefix!r} is registered twice")
        RECOMPUTE[prefix] = Recomputation(fn, block, every_key, abs_tol)
        return fn

    return register


def _registered(name: str) -> Recomputation:
    for prefix, how in RECOMPUTE.items():
        if name.startswith(prefix):
            return how
    raise KeyError(f"no recomputation registered for {name}")


def recompute(name: str, data: dict) -> dict:
    """The aggregates of results file `name` (its contents `data`), computed from its runs."""
    return _registered(name).fn(data, name)


def _differences(stored, computed, how: Recomputation, path: str = "") -> list[str]:
    if isinstance(stored, dict) and isinstance(computed, dict):
        out = []
        keys = set(stored) | set(computed) if how.every_key else set(computed)
        for key in sorted(keys, key=str):
            if key not in computed or key not in stored:
                out.append(f"{path}{key}: {'not recomputed' if key not in computed else 'missing'}")
            else:
                out += _differences(stored[key], computed[key], how, f"{path}{key}.")
        return out
    if isinstance(stored, list) and isinstance(computed, list) and len(stored) == len(computed):
        return [d for i, (s, c) in enumerate(zip(stored, computed)) for d in _differences(s, c, how, f"{path}{i}.")]
    if isinstance(stored, (int, float)) and isinstance(computed, (int, float)):
        same = math.isclose(stored, computed, rel_tol=1e-9, abs_tol=how.abs_tol)
        return [] if same else [f"{path.rstrip('.')}: stored {stored!r}, runs give {computed!r}"]
    return [] if stored == computed else [f"{path.rstrip('.')}: stored {stored!r}, runs give {computed!r}"]


def problems(name: str, data) -> list[str]:
    """A stored aggregate of results file `name` (its contents `data`) that the file's runs do not give."""
    try:
        how = _registered(name)
    except KeyError as err:
        if isinstance(data, dict) and "aggregate" in data:
            return [f"benchmarks/results/{name}: {err.args[0]}"]
        return []
    if how.block is None:
        stored = {k: v for k, v in data.items() if k != "meta"}
    elif how.block in data:
        stored = data[how.block]
    else:
        return []
    label = "aggregate" if how.block in (None, "aggregate") else how.block
    return [f"benchmarks/results/{name}: {label} {d}" for d in _differences(stored, how.fn(data, name), how)]
