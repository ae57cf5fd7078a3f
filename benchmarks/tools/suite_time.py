"""The README's test command, timed: how many tests the default suite runs and how long it takes, set-up included.

    python -m benchmarks.tools.suite_time [--out benchmarks/results/test_suite.json]

Runs `make test` in the checkout (the first run creates `.venv` and installs; later runs reuse it) and records
pytest's closing counts, pytest's own time, and the wall time of the whole command.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

from benchmarks.shared.provenance import ROOT, provenance

CLOSING = re.compile(r"^=*\s*(?P<counts>\d+ (?:passed|failed).*?) in (?P<seconds>[\d.]+)s\b")


def parse_closing(text: str) -> dict:
    """pytest's closing line (`774 passed, 9 skipped in 301.2s (0:05:01)`, with or without `===`): counts,
    seconds."""
    for line in reversed(text.splitlines()):
        match = CLOSING.match(line.strip())
        if match:
            counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", match["counts"])}
            return {"counts": counts, "pytest_s": float(match["seconds"])}
    raise ValueError("no pytest closing line in the output")


# The package modules (and recipes) this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss", "tests", "Makefile")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/test_suite.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    meta = provenance("python -m benchmarks.tools.suite_time") | {"suite_command": "make test"}
    start = time.time()
    proc = subprocess.run(["make", "test"], cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - start
    sys.stdout.write(proc.stdout[-3000:])
    result = {"meta": meta, "returncode": proc.returncode, "wall_s": wall, **parse_closing(proc.stdout)}
    (ROOT / args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
