"""Where a result came from: the machine, the date and the command, stored beside every figure of a results file.

`provenance(command)` is the `meta` block the benchmark scripts write; `docs/figures.py` shows it under the tables
and figures it renders, so that a page never states a number without its machine, date and command.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys


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
    for name in ("torch", "transformers", "trl", "accelerate"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def provenance(command: str | None = None) -> dict:
    """The `meta` block of a results file: machine, date (UTC), command, package versions, load at the start."""
    return {
        "machine": cpu(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": command or " ".join(["python", *sys.argv]),
        "versions": versions(),
        "load_average_at_start": load_average(),
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None
