"""Pin a measured function's outputs (`benchmarks/shared/pins.py`): compute a case of `benchmarks/shared/pin_cases.py`
at the checkout and at other commits, and record the commits where it gave the same outputs.

    python -m benchmarks.tools.pin_outputs loss_layer --measures hf_rlloss/loss --at 6b69c5a b05731c
    python -m benchmarks.tools.pin_outputs loss_layer --at 245360e     # more commits, the pin's outputs kept

Each commit's package is checked out into a temporary `git worktree` and put first on `PYTHONPATH`; the case runs
from this checkout's `pin_cases.py` (it imports only torch and the package). A commit whose outputs differ, or where
the case does not run, is reported and not recorded. The checkout's own outputs become the pin's `outputs` (a
changed output starts the pin over: `verified_at` is then the checkout's commit only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.shared.pins import CASES, PINS, ROOT


def outputs_at(case: str, commit: str | None) -> dict | None:
    """The case's outputs with the package of `commit` (the checkout's when None); None when it does not run."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = ROOT
        if commit is not None:
            tree = os.path.join(tmp, "tree")
            subprocess.run(["git", "worktree", "add", "--detach", tree, commit], cwd=ROOT, check=True,
                           capture_output=True)  # fmt: skip
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            run = subprocess.run([sys.executable, str(CASES), case], cwd=tmp, env=env, capture_output=True, text=True)
        finally:
            if commit is not None:
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)
    if run.returncode != 0:
        print(f"{commit}: the case does not run: {run.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(run.stdout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", help="a case of benchmarks/shared/pin_cases.py")
    parser.add_argument("--measures", nargs="+", help="the repository paths the case runs (a new pin)")
    parser.add_argument("--at", nargs="*", default=[], help="the commits to verify the outputs at")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = PINS / f"{args.case}.json"
    pin = json.loads(path.read_text()) if path.exists() else {"case": args.case, "measures": [], "verified_at": []}
    head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    now = outputs_at(args.case, None)
    if now is None:
        return 1
    if now != pin.get("outputs"):
        pin["verified_at"] = []
    pin.update(case=args.case, outputs=now, measures=args.measures or pin["measures"])
    for commit in [head.stdout.strip(), *args.at]:
        same = commit == head.stdout.strip() or outputs_at(args.case, commit) == now
        print(f"{commit}: {'the same outputs' if same else 'other outputs (not recorded)'}", flush=True)
        if same and commit not in pin["verified_at"]:
            pin["verified_at"].append(commit)
    if not pin["measures"]:
        raise SystemExit("a new pin needs --measures")
    PINS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pin, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(ROOT)}: verified at {len(pin['verified_at'])} commit(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
