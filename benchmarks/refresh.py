"""Re-run the measurements whose measured code changed since they were taken.

    python -m benchmarks.refresh --stale --dry-run   # list them, with the command that re-measures each
    python -m benchmarks.refresh --stale             # re-run those commands, one after the other

A results file is stale when `git log <its commit>..HEAD -- <the modules its benchmark measures>` lists a commit
(`benchmarks/figures/_age.py`), unless pinned outputs verified at its commit cover every changed path
(`benchmarks/shared/pins.py`: the code changed, its outputs on the recorded inputs did not); its table's source line
then says which. After a re-run, `python -m
benchmarks.tools.render_figures` renders the pages from the new files.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from benchmarks.figures import _age, core


def stale() -> list[tuple[str, dict]]:
    """`(results file, meta)` of every results file a page reads whose measured code changed since its commit."""
    core.load_renderers()
    found = []
    for name in sorted(core.sources()):
        meta = core.meta_of(core.Results()(name))
        if _age.age(meta)[1]:
            found.append((name, meta))
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stale", action="store_true", required=True, help="the stale results files")
    parser.add_argument("--dry-run", action="store_true", help="list them and their commands; run nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    found = stale()
    for name, meta in found:
        print(f"benchmarks/results/{name}: {_age.age(meta)[0]}\n    {meta['command']}")
    if args.dry_run or not found:
        print(f"{len(found)} stale results file(s)")
        return 0
    for name, meta in found:
        print(f"re-measuring benchmarks/results/{name}", flush=True)
        code = subprocess.run(meta["command"], shell=True, cwd=core.ROOT, env=dict(os.environ)).returncode
        if code:
            print(f"failed ({code}): {shlex.quote(meta['command'])}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
