"""Render every marked figure and table of the user pages from `benchmarks/results/` (`benchmarks/figures/core.py`).

python -m benchmarks.tools.render_figures           # rewrite the marked spans in place
python -m benchmarks.tools.render_figures --check   # exit 1 and list the problems if any page is stale or unbacked
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.figures import core


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="check only; exit 1 on any problem")
    args = parser.parse_args(argv)
    if not args.check:
        for page in core.write():
            print(f"rendered {page}")
    problems = core.check()
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
