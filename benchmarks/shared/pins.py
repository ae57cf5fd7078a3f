"""Pinned outputs: a measured function's outputs on recorded inputs, kept in a small golden file, so that a results
file whose measured code changed after its commit, but whose measured functions gave the same outputs then and now,
is not stale.

A pin is `benchmarks/shared/pins/<case>.json`:

* `case`: the function that computes the outputs (`benchmarks/shared/pin_cases.py`: fixed inputs, the package only);
* `measures`: the repository paths whose code the case runs (as a benchmark's `MEASURES`);
* `outputs`: what the case gives;
* `verified_at`: the commits at which the case gave exactly these outputs (`python -m benchmarks.tools.pin_outputs`
  computes it at each commit in a worktree of its own); `tests/test_pinned_outputs.py` computes it at the checkout,
  so that the outputs hold there whenever the suite passes.

A commit after a results file's own changes its measured code in paths (`git diff --name-only`). The file is still
current when every such path is under the `measures` of a pin verified at the file's commit: the code changed, its
outputs on the recorded inputs did not. Pins speak for values (an experiment's, a recipe's): a results file of a
performance benchmark measures time and memory, which the same outputs do not vouch for; it is re-measured.
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS = ROOT / "benchmarks" / "shared" / "pins"
CASES = ROOT / "benchmarks" / "shared" / "pin_cases.py"
# the scripts whose results are timings, for which pinned outputs vouch for nothing
TIMED = ("benchmarks/performance/", "benchmarks/tools/")


def load_pins() -> dict[str, dict]:
    """Every pin, by case."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(PINS.glob("*.json"))}


def _within(path: str, prefixes: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def _same_commit(a: str, b: str) -> bool:
    return bool(a) and bool(b) and (a.startswith(b) or b.startswith(a))


@functools.cache
def changed_paths(commit: str, modules: tuple[str, ...]) -> tuple[str, ...]:
    """The paths under `modules` that the commits after `commit` changed (`git diff --name-only`)."""
    out = subprocess.run(["git", "diff", "--name-only", f"{commit}..HEAD", "--", *modules], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    return tuple(out.stdout.split())


def vouching(commit: str, modules: tuple[str, ...], scripts: list[str], pins: dict[str, dict] | None = None) -> list:
    """The cases whose pins, verified at `commit`, cover every path under `modules` changed since: their outputs on
    the recorded inputs are those of `commit`. Empty when one changed path is not covered, or when the results come
    from a timed benchmark (`TIMED`)."""
    if not scripts or any(script.startswith(TIMED) for script in scripts):
        return []
    pins = load_pins() if pins is None else pins
    verified = {case: pin for case, pin in pins.items() if any(_same_commit(commit, c) for c in pin["verified_at"])}
    used = []
    for path in changed_paths(commit, modules):
        covering = [case for case, pin in verified.items() if _within(path, pin["measures"])]
        if not covering:
            return []
        used += [case for case in covering if case not in used]
    return used
