"""`make gpu-check`: the GPU checks on a machine with one CUDA GPU, in about 8 minutes, each result recorded with its
provenance under `benchmarks/results/gpu/`.

    python scripts/gpu_check.py              # run the plan (without a CUDA device: say so, print the plan, exit 0)
    python scripts/gpu_check.py --dry-run    # print the plan and parse each step's command with its own parser
    python scripts/gpu_check.py --only loss_step_cuda demo_step_cuda

The plan (:func:`plan`), one subprocess per step, in this order:

1. `cuda_tests`: the CUDA tests (`pytest -m gpu tests/test_gpu.py`): the chunked loss on CUDA against the CPU path,
   bf16, and the asynchronous trainer configured as TRL against stock TRL on CUDA;
2. `loss_step_cuda`: the loss step from hidden states against TRL's chunked kernel and naive logits, bf16, on CUDA
   (`python -m benchmarks.performance.loss_step`);
3. `demo_step_cuda`: whole optimizer steps of the demo on the GPU (`config_demo_gpu.yaml`), `RLLossGRPOTrainer`
   against stock `GRPOTrainer` (`python -m benchmarks.performance.train_step --demo`);
4. `vllm_colocate_cuda`: `RLLossGRPOTrainer` and stock `GRPOTrainer` sampling with a colocated vLLM engine on the GPU
   (`scripts/gpu_vllm_colocate.py`); skipped, saying why, when the Python that runs it cannot import vLLM
   (`--vllm-python` names another environment's).

Each step writes `benchmarks/results/gpu/<step>.json`: the step's own output under `result`, its exit code, wall time
and log tail, and `meta`: the git commit (and whether the tree had changes), the versions of torch, transformers,
TRL, accelerate and vLLM, the GPU, its driver and CUDA, the CPU, the load average before and after, the date and the
exact command. `summary.json` lists the steps and their status. A step that runs out of the time budget is stopped
and recorded as such.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu"
WORK = ROOT / "outputs" / "gpu-check"  # logs and the steps' raw outputs (git-ignored)
DEMO_GPU_CONFIG = "recipes/smollm2_135m/arithmetic/config_demo_gpu.yaml"
BUDGET_S = 480


@dataclass(frozen=True)
class Step:
    """One step of the plan: `argv` runs under a Python (`python` is replaced by the interpreter), `parser` names
    the argument parser that reads it (`pytest`, or a script path whose `main()` parses with argparse)."""

    name: str
    what: str
    argv: tuple[str, ...]
    parser: str
    raw_output: str  # the file the step writes (under WORK)
    timeout_s: int
    needs_vllm: bool = False
    env: dict = field(default_factory=dict)


def plan(work: Path = WORK) -> list[Step]:
    """The steps `make gpu-check` runs, in order."""
    return [
        Step(
            "cuda_tests",
            "the CUDA tests (tests/test_gpu.py)",
            (
                "python",
                "-m",
                "pytest",
                "-q",
                "-m",
                "gpu",
                "tests/test_gpu.py",
                "-p",
                "no:cacheprovider",
                "--junitxml",
                str(work / "cuda_tests.xml"),
            ),
            "pytest",
            "cuda_tests.xml",
            150,
        ),  # fmt: skip
        Step(
            "loss_step_cuda",
            "the loss step against TRL's chunked kernel on CUDA, bf16, 4096 tokens x 151936 vocabulary",
            (
                "python",
                "-m",
                "benchmarks.performance.loss_step",
                "--device",
                "cuda",
                "--dtype",
                "bf16",
                "--tokens",
                "4096",
                "--vocab",
                "151936",
                "--methods",
                "hf_rlloss",
                "trl_chunked",
                "naive",
                "gemm_floor",
                "--repeats",
                "3",
                "--out",
                str(work / "loss_step_cuda.json"),
            ),
            "benchmarks/performance/loss_step.py",
            "loss_step_cuda.json",
            120,
        ),  # fmt: skip
        Step(
            "demo_step_cuda",
            "a demo step on the GPU, RLLossGRPOTrainer against stock GRPOTrainer (one timed step after a warm-up)",
            (
                "python",
                "-m",
                "benchmarks.performance.train_step",
                "--demo",
                DEMO_GPU_CONFIG,
                "--steps",
                "2",
                "--repeats",
                "1",
                "--out",
                str(work / "demo_step_cuda.json"),
            ),
            "benchmarks/performance/train_step.py",
            "demo_step_cuda.json",
            150,
        ),  # fmt: skip
        Step(
            "vllm_colocate_cuda",
            "both trainers sampling with a colocated vLLM engine on the GPU",
            ("python", "scripts/gpu_vllm_colocate.py", "--steps", "3", "--out", str(work / "vllm_colocate_cuda.json")),
            "scripts/gpu_vllm_colocate.py",
            "vllm_colocate_cuda.json",
            240,
            needs_vllm=True,
        ),
    ]


# ------------------------------------------------------------------------------------------------------ parsing


class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def parse_with_own_parser(step: Step) -> argparse.Namespace:
    """Parse `step.argv` with the parser of the program it runs, running nothing else: pytest's option parser, or
    the script's `main()` stopped right after its argparse parser has read the arguments. Raises on bad arguments
    (`SystemExit` from argparse, `pytest.UsageError`)."""
    args = list(step.argv[1:])
    if step.parser == "pytest":
        from _pytest.config import get_config

        args = args[2:]  # after `-m pytest`
        return get_config(args)._parser.parse(args, namespace=argparse.Namespace())
    script = ROOT / step.parser
    if args[:1] == ["-m"]:  # a benchmark run as a module of the `benchmarks` package (imported from the root)
        args = args[1:]
    sys.path.insert(0, str(ROOT if step.parser.startswith("benchmarks/") else script.parent))
    spec = importlib.util.spec_from_file_location(f"_gpu_check_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    original = argparse.ArgumentParser.parse_known_args

    def parse_then_stop(self, args=None, namespace=None):
        namespace, rest = original(self, args, namespace)
        raise _Parsed(namespace if not rest else self.error(f"unrecognized arguments: {' '.join(rest)}"))

    saved_argv = sys.argv
    sys.argv, argparse.ArgumentParser.parse_known_args = [str(script), *args[1:]], parse_then_stop
    try:
        module.main()
    except _Parsed as parsed:
        return parsed.namespace
    finally:
        sys.argv, argparse.ArgumentParser.parse_known_args = saved_argv, original
        sys.path.remove(str(ROOT if step.parser.startswith("benchmarks/") else script.parent))
    raise RuntimeError(f"{step.parser}: main() returned without parsing its arguments")


def parsed_options(step: Step, namespace: argparse.Namespace) -> dict:
    """The options a step's command sets, as its parser read them."""
    if step.parser == "pytest":
        return {k: getattr(namespace, k) for k in ("markexpr", "file_or_dir", "xmlpath")}
    return {k: v for k, v in vars(namespace).items() if not k.startswith("_") and v is not None}


def parse_demo_config(cuda: bool) -> tuple:
    """The GPU demo config read by the recipe's own parser (`recipes/grpo.py`'s `parse_args`, as
    `python -m benchmarks.performance.train_step --demo` reads it). Without CUDA, `bf16` is parsed off: transformers
    refuses bf16 on a
    CPU-only machine unless `use_cpu` is set."""
    spec = importlib.util.spec_from_file_location("grpo_recipe", ROOT / "recipes" / "grpo.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules["grpo_recipe"] = recipe  # its dataclasses look their module up
    spec.loader.exec_module(recipe)
    return recipe.parse_args(["--config", str(ROOT / DEMO_GPU_CONFIG), *([] if cuda else ["--bf16", "false"])])


# --------------------------------------------------------------------------------------------------- provenance


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def versions(python: str = sys.executable) -> dict:
    """The versions `python` imports (a missing package: `None`)."""
    code = (
        "import importlib.metadata as md, json, platform\n"
        "out = {'python': platform.python_version()}\n"
        "for name in ('torch', 'transformers', 'trl', 'accelerate', 'vllm', 'deepspeed', 'peft'):\n"
        "    try: out[name] = md.version(name)\n"
        "    except md.PackageNotFoundError: out[name] = None\n"
        "print(json.dumps(out))"
    )
    text = _run([python, "-c", code])
    return json.loads(text) if text else {}


def gpu() -> dict:
    """The GPU as torch and the driver see it."""
    import torch

    info = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1), count=torch.cuda.device_count(),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))  # fmt: skip
    query = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    info["nvidia_smi"] = query.splitlines() if query else None
    return info


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cores, "system": platform.platform()}


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def provenance(command: str, vllm_python: str) -> dict:
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {
        "git_commit": _run(["git", "rev-parse", "HEAD"]) or None,
        "git_tree_changed": bool(status),
        "versions": versions(),
        "vllm_python": vllm_python,
        "vllm_python_versions": versions(vllm_python) if vllm_python != sys.executable else None,
        "gpu": gpu(),
        "machine": machine(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": command,
    }


# ---------------------------------------------------------------------------------------------------------- run


def junit_summary(path: Path) -> dict:
    """Each test of a pytest junit XML with its outcome (and the skip or failure message)."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = (
                    {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag],
                    (child.get("message") or "")[:500],
                )
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})  # fmt: skip
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "tests": tests}


def vllm_importable(python: str) -> bool:
    return subprocess.run([python, "-c", "import vllm"], capture_output=True, cwd=ROOT).returncode == 0


def run_step(step: Step, python: str, vllm_python: str, budget_s: float, meta: dict, work: Path) -> dict:
    """Run one step, then write its results file; returns its summary line."""
    interpreter = vllm_python if step.needs_vllm else python
    cmd = [interpreter, *step.argv[1:]]
    record = {"step": step.name, "what": step.what, "command": shlex.join(["python", *step.argv[1:]])}
    if step.needs_vllm and not vllm_importable(interpreter):
        record.update(status="skipped", reason=f"{interpreter} cannot import vllm: install vLLM for CUDA in an "
                      "environment with hf_rlloss and name its Python with --vllm-python (docs/gpu.md)")  # fmt: skip
    elif budget_s < 10:
        record.update(status="not run", reason="the time budget was spent")
    else:
        log = work / f"{step.name}.log"
        load_before, start = load_average(), time.perf_counter()
        timeout = min(step.timeout_s, budget_s)
        print(f"[gpu-check] {step.name}: $ {shlex.join(cmd)}  (at most {timeout:.0f} s; log: {log})", flush=True)
        env = {**os.environ, **step.env, "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as f:
            try:
                code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
                code = code.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        wall = time.perf_counter() - start
        raw = work / step.raw_output
        result = None
        if raw.exists():
            result = junit_summary(raw) if raw.suffix == ".xml" else json.loads(raw.read_text())
        failed = code != 0 or (
            step.name == "cuda_tests" and result and result["counts"]["failed"] + result["counts"]["error"]
        )
        record.update(status="failed" if failed else "passed", returncode=code, wall_s=round(wall, 1),
                      load_average_before=load_before, load_average_after=load_average(), result=result,
                      log_tail=log.read_text(errors="replace")[-3000:] if failed else None)  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{step.name}.json"
    out.write_text(json.dumps({"meta": meta, **record}, indent=1) + "\n")
    line = {"step": step.name, "status": record["status"], "file": _shown(out)}
    print(f"[gpu-check] {step.name}: {record['status']}" + (f" ({record.get('reason')})" if "reason" in record else "")
          + (f" in {record['wall_s']} s" if "wall_s" in record else ""), flush=True)  # fmt: skip
    return line


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def print_plan(steps: list[Step], python: str, vllm_python: str) -> None:
    for i, step in enumerate(steps, 1):
        interpreter = vllm_python if step.needs_vllm else python
        print(f"  {i}. {step.name}: {step.what} (at most {step.timeout_s} s)")
        print(f"     $ {shlex.join([interpreter, *step.argv[1:]])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan and parse each step's command")
    parser.add_argument("--only", nargs="+", choices=[s.name for s in plan()], help="run these steps only")
    parser.add_argument("--vllm-python", default=sys.executable, help="the Python that runs the vLLM step")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all steps together")
    args = parser.parse_args(argv)
    steps = [s for s in plan() if not args.only or s.name in args.only]
    import torch

    cuda = torch.cuda.is_available()
    if args.dry_run or not cuda:
        if not cuda:
            build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
            print(f"[gpu-check] no CUDA device (torch {torch.__version__}, {build}): nothing to run, nothing "
                  "written. On a machine with one CUDA GPU, `make gpu-check` runs:")  # fmt: skip
        else:
            print("[gpu-check] dry run, the plan:")
        print_plan(steps, sys.executable, args.vllm_python)
        if args.dry_run:
            for step in steps:
                shown = parsed_options(step, parse_with_own_parser(step))
                print(f"[gpu-check] {step.name}: parsed by {step.parser}'s parser: {shown}")
            parse_demo_config(cuda)
            print(f"[gpu-check] {DEMO_GPU_CONFIG}: parsed by recipes/grpo.py's parser")
        return 0
    WORK.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])])
    meta = provenance(command, args.vllm_python)
    meta["load_average_at_start"] = load_average()
    print(
        f"[gpu-check] {meta['gpu'].get('name')} ({meta['gpu'].get('memory_gib')} GiB), torch "
        f"{meta['versions'].get('torch')}, commit {str(meta['git_commit'])[:10]}; budget {args.budget_s:.0f} s"
    )
    deadline = time.perf_counter() + args.budget_s
    lines = [run_step(s, sys.executable, args.vllm_python, deadline - time.perf_counter(), meta, WORK) for s in steps]
    summary = {"meta": {**meta, "load_average_at_end": load_average()}, "steps": lines}
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[gpu-check] wrote {_shown(RESULTS)}/: " + ", ".join(f"{x['step']} {x['status']}" for x in lines))
    return 1 if any(x["status"] == "failed" for x in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
