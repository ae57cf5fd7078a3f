"""Where a result came from, stored beside every figure of a results file.

`provenance(command)` is the `meta` block the benchmark scripts write: the machine, the date, the load, the exact
command, the versions of the libraries measured and the git commit. `benchmarks/figures/` shows it under the tables
and figures it renders, so that a page never states a number without its machine, date and command, and says when
the code a benchmark measures (its `MEASURES`) changed after the commit the file records.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The libraries whose versions a measurement depends on (vLLM where it is installed: its runs sample with it).
LIBRARIES = ("torch", "transformers", "trl", "accelerate", "vllm")


def cpu() -> dict:
    """The CPU model, its core count and the vector extensions that decide bf16 and matmul speed."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model.startswith(("AMD", "Intel")):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "isa": isa, "cores": cores, "kind": f"{cores}-core {model} ({isa})"}


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def command_line() -> str:
    """The command this process runs, as a user would type it again from the repository root: `python -m
    benchmarks.<kind>.<name> <arguments>` for a benchmark run as a module, `python <script> <arguments>` else."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # set when run with `python -m`
    if spec is not None and spec.name.startswith("benchmarks."):
        return shlex.join(["python", "-m", spec.name, *sys.argv[1:]])
    script = sys.argv[0] if sys.argv else ""
    return shlex.join(["python", os.path.relpath(script) if script else "-", *sys.argv[1:]])


def provenance(command: str | None = None) -> dict:
    """The `meta` block of a results file: machine, date (UTC), command, package versions, load at the start and the
    git commit (`git_dirty`: uncommitted changes to tracked files were present)."""
    return {
        "machine": cpu(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": command or command_line(),
        "versions": versions(),
        "load_average_at_start": load_average(),
        "git_commit": _git(["rev-parse", "--short=10", "HEAD"]),
        "git_dirty": bool(_git(["status", "--porcelain", "--untracked-files=no"])),
    }


def _git(args: list[str]) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
    except OSError:
        return None
    return out.stdout.strip() or None
