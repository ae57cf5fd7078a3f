"""`make gpu-check`: the GPU checks on one CUDA GPU, within 10 minutes, each result recorded with its provenance under
`benchmarks/results/gpu/`.

    python scripts/gpu_check.py              # run the plan on CUDA (no GPU anywhere: say so, print the plan, exit 0)
    python scripts/gpu_check.py --dry-run    # print the plan and parse each step's command with its own parser
    python scripts/gpu_check.py --only loss_step_h1536 gpu_step
    python scripts/gpu_check.py --device cpu --results DIR    # the rehearsal: every step's code at tiny sizes on CPU

The plan (:func:`plan`), one subprocess per step, in priority order:

1. `cuda_tests`: the CUDA tests (`pytest -m gpu tests/test_gpu.py`): the chunked loss on CUDA against the CPU path,
   both trainers configured as TRL against stock TRL on CUDA (the synchronous one with fixed completions, fp32 and
   bf16, packing `auto`, `off` and `shared_prefix`);
2. `loss_step_h1536`, `loss_step_h3584`: the loss step from hidden states at hidden size 1,536 and 3,584, 16,384
   tokens, 151,936-token vocabulary, bf16, against TRL's chunked kernel and the three-GEMM floor
   (`benchmarks/performance/loss_step.py`);
3. `gpu_step`: whole optimizer steps of a randomly initialised 0.5B-class Qwen2 in bf16 on 512-token fixed
   completions, `RLLossGRPOTrainer` against stock `GRPOTrainer`, 3 interleaved repeats of 6 synchronized steps
   (`benchmarks/performance/gpu_step.py`);
4. `engines_cuda`: one-process launches of the shipped ZeRO-3 and FSDP2 accelerate configs over NCCL, each asserting
   the engine that ran (`scripts/gpu_engines.py`);
5. `vllm_colocate_cuda`: both trainers, configured alike, sampling with a colocated vLLM engine
   (`scripts/gpu_vllm_colocate.py`), and the ratio of their step times; skipped, saying why, when the Python that runs
   it cannot import vLLM (`scripts/install_vllm_cuda.sh` installs it beside the package).

What makes the numbers count: one GPU pinned (`CUDA_VISIBLE_DEVICES`, TRL's synchronous trainer refuses several under
a plain `python`); a GPU that `nvidia-smi` lists but torch cannot use fails the check; a step that runs out of time
is killed with every process it started; a step's raw output is deleted before it runs, so a failed step never reports
an older run's file; the steps' caps add up to the budget. Each step writes `benchmarks/results/gpu/<step>.json`: the
step's own output under `result`, its exit code, wall time and log tail, and `meta`: the git commit (and whether the
tree had changes), the versions of torch, transformers, TRL, accelerate and vLLM, the GPU, its driver and CUDA, the
CPU, the load average before and after, the date and the exact command. `summary.json` lists the steps and their
status.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import shlex
import signal
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
DEVICES = ("cuda", "cpu")  # cpu: the rehearsal, tiny sizes


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


# Each step's sizes on CUDA and in the CPU rehearsal.
SIZES = {
    "cuda": {"tokens": "16384", "vocab": "151936", "hidden": ("1536", "3584"), "loss_repeats": "3",
             "model": "qwen2_0.5b_random", "length": "512", "steps": "6", "repeats": "3", "vllm_steps": "3"},
    "cpu": {"tokens": "256", "vocab": "1024", "hidden": ("64", "96"), "loss_repeats": "1",
            "model": "tiny", "length": "16", "steps": "2", "repeats": "1", "vllm_steps": "1"},
}  # fmt: skip


# The CPU rehearsal's caps: its steps are tiny, but a fresh environment builds DeepSpeed's CPU op on first use and
# the suite's machine is shared.
REHEARSAL_SLACK = 3


def plan(work: Path = WORK, device: str = "cuda") -> list[Step]:
    """The steps `make gpu-check` runs on `device`, in priority order (the budget spent, the rest are not run)."""
    steps = _plan(work, device)
    if device == "cpu":
        steps = [dataclasses.replace(s, timeout_s=REHEARSAL_SLACK * s.timeout_s) for s in steps]
    return steps


def _loss_steps(work: Path, device: str) -> list[Step]:
    """The loss step against TRL's chunked kernel at each of the device's hidden sizes (named by the CUDA sizes)."""
    size = SIZES[device]
    dtype = "bf16" if device == "cuda" else "fp32"
    return [
        Step(
            f"loss_step_h{hidden_cuda}",
            f"the loss step against TRL's chunked kernel, {dtype}, hidden size {hidden}, {size['tokens']} tokens x "
            f"{size['vocab']} vocabulary",
            (
                "python",
                "-m",
                "benchmarks.performance.loss_step",
                "--device",
                device,
                "--dtype",
                dtype,
                "--tokens",
                size["tokens"],
                "--vocab",
                size["vocab"],
                "--hidden",
                hidden,
                "--methods",
                "hf_rlloss",
                "trl_chunked",
                "gemm_floor",
                "--repeats",
                size["loss_repeats"],
                "--out",
                str(work / f"loss_step_h{hidden_cuda}.json"),
            ),
            "benchmarks/performance/loss_step.py",
            f"loss_step_h{hidden_cuda}.json",
            (50, 70)[i],
        )  # fmt: skip
        for i, (hidden, hidden_cuda) in enumerate(zip(size["hidden"], SIZES["cuda"]["hidden"]))
    ]


def _plan(work: Path, device: str) -> list[Step]:
    size = SIZES[device]
    loss_steps = _loss_steps(work, device)
    return [
        Step(
            "cuda_tests",
            "the CUDA tests (tests/test_gpu.py): the chunked loss, both trainers against stock TRL",
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
            120,
            env={"HF_RLLOSS_GPU_CHECK_DEVICE": device},
        ),  # fmt: skip
        *loss_steps,
        Step(
            "gpu_step",
            f"whole optimizer steps, RLLossGRPOTrainer against stock GRPOTrainer, {size['model']}, "
            f"{size['length']}-token completions, {size['repeats']} interleaved repeats of {size['steps']} steps",
            (
                "python",
                "-m",
                "benchmarks.performance.gpu_step",
                "--device",
                device,
                "--model",
                size["model"],
                "--length",
                size["length"],
                "--steps",
                size["steps"],
                "--repeats",
                size["repeats"],
                "--out",
                str(work / "gpu_step.json"),
            ),
            "benchmarks/performance/gpu_step.py",
            "gpu_step.json",
            150,
        ),  # fmt: skip
        Step(
            "engines_cuda",
            "one-process launches of the shipped ZeRO-3 and FSDP2 configs, each asserting the engine that ran",
            ("python", "scripts/gpu_engines.py", "--device", device, "--out", str(work / "engines_cuda.json")),
            "scripts/gpu_engines.py",
            "engines_cuda.json",
            80,
        ),
        Step(
            "vllm_colocate_cuda",
            "both trainers, configured alike, sampling with a colocated vLLM engine, and their ratio",
            (
                "python",
                "scripts/gpu_vllm_colocate.py",
                "--device",
                device,
                "--steps",
                size["vllm_steps"],
                "--out",
                str(work / "vllm_colocate_cuda.json"),
            ),
            "scripts/gpu_vllm_colocate.py",
            "vllm_colocate_cuda.json",
            130,
            needs_vllm=True,
        ),  # fmt: skip
    ]


#: The time budget of a whole run: the steps' caps added up (10 minutes).
BUDGET_S = sum(step.timeout_s for step in plan())


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


def nvidia_smi_gpus() -> list[str]:
    """The GPUs `nvidia-smi` lists (`index, name` per line); empty without the tool or a GPU."""
    query = _run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"])
    return [line.strip() for line in query.splitlines() if line.strip()]


def pinned_gpu(environ: dict) -> str:
    """The one GPU every step sees: the first of `CUDA_VISIBLE_DEVICES` when it is set, else GPU 0."""
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return visible.split(",")[0].strip() if visible else "0"


def run_with_deadline(cmd: list[str], env: dict, log: Path, timeout: float) -> int | str:
    """Run `cmd` in a session of its own, its output into `log`; past `timeout` s, kill it and every process it
    started (each descendant by PID, then the session's process group). The exit code, or `"timeout"`."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_tree(proc.pid)
            proc.wait()
            return "timeout"


def kill_process_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants, each by PID (`benchmarks/shared/launch.kill_tree`: workers in sessions of
    their own die too), then what is left of its process group."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.shared.launch import kill_tree

    kill_tree(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_step(
    step: Step, python: str, vllm_python: str, budget_s: float, meta: dict, work: Path, results: Path | None = None
) -> dict:
    """Run one step, then write its results file (under `results`, default `RESULTS`); returns its summary line."""
    interpreter = vllm_python if step.needs_vllm else python
    cmd = [interpreter, *step.argv[1:]]
    record = {"step": step.name, "what": step.what, "command": shlex.join(["python", *step.argv[1:]])}
    if step.needs_vllm and not vllm_importable(interpreter):
        why = "install vLLM beside hf_rlloss (scripts/install_vllm_cuda.sh), or name its Python with --vllm-python"
        record.update(status="skipped", reason=f"{interpreter} cannot import vllm: {why}")
    elif budget_s < 10:
        record.update(status="not run", reason="the time budget was spent")
    else:
        log = work / f"{step.name}.log"
        raw = work / step.raw_output
        raw.unlink(missing_ok=True)  # never report an earlier run's output
        load_before, start = load_average(), time.perf_counter()
        timeout = min(step.timeout_s, budget_s)
        print(f"[gpu-check] {step.name}: $ {shlex.join(cmd)}  (at most {timeout:.0f} s; log: {log})", flush=True)
        env = {**os.environ, **step.env, "PYTHONUNBUFFERED": "1"}
        code = run_with_deadline(cmd, env, log, timeout)
        wall = time.perf_counter() - start
        result = None
        if raw.exists():
            result = junit_summary(raw) if raw.suffix == ".xml" else json.loads(raw.read_text())
        failed = code != 0 or (
            step.name == "cuda_tests" and result and result["counts"]["failed"] + result["counts"]["error"]
        )
        record.update(status="failed" if failed else "passed", returncode=code, wall_s=round(wall, 1),
                      load_average_before=load_before, load_average_after=load_average(), result=result,
                      log_tail=log.read_text(errors="replace")[-3000:] if failed else None)  # fmt: skip
    results = Path(results or RESULTS)
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"{step.name}.json"
    out.write_text(json.dumps({"meta": meta, **record}, indent=1, default=str) + "\n")
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
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for all steps together (default: "
                        "their caps added up, BUDGET_S on CUDA)")  # fmt: skip
    parser.add_argument("--device", choices=DEVICES, default="cuda", help="cpu: the rehearsal, at tiny sizes")
    parser.add_argument("--results", type=Path, default=None, help="where the results files go (default: RESULTS)")
    parser.add_argument("--work", type=Path, default=WORK, help="where the logs and raw outputs go")
    args = parser.parse_args(argv)
    steps = [s for s in plan(args.work, args.device) if not args.only or s.name in args.only]
    if args.budget_s is None:
        args.budget_s = sum(step.timeout_s for step in plan(args.work, args.device))
    import torch

    cuda, listed = torch.cuda.is_available(), nvidia_smi_gpus()
    if args.device == "cuda" and listed and not cuda:
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        print(f"[gpu-check] FAILED: nvidia-smi lists {len(listed)} GPU(s) ({'; '.join(listed)}) but torch "
              f"{torch.__version__} ({build}) cannot use them: a CPU build, or a driver older than the wheel's CUDA. "
              "Install a torch for this driver (HF_RLLOSS_TORCH=cuda make setup, or PyTorch's matrix).")  # fmt: skip
        return 2
    if args.dry_run or (args.device == "cuda" and not cuda):
        if not args.dry_run:
            build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
            print(f"[gpu-check] no CUDA device (torch {torch.__version__}, {build}; nvidia-smi lists none): nothing "
                  "to run, nothing written. On a machine with one CUDA GPU, `make gpu-check` runs:")  # fmt: skip
        else:
            print("[gpu-check] dry run, the plan:")
        print_plan(steps, sys.executable, args.vllm_python)
        if args.dry_run:
            for step in steps:
                shown = parsed_options(step, parse_with_own_parser(step))
                print(f"[gpu-check] {step.name}: parsed by {step.parser}'s parser: {shown}")
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = pinned_gpu(os.environ)  # every step: one GPU
    command = shlex.join(["python", "scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])])
    meta = provenance(command, args.vllm_python) | {"device": args.device, "load_average_at_start": load_average()}
    print(
        f"[gpu-check] {meta['gpu'].get('name')} ({meta['gpu'].get('memory_gib')} GiB), torch "
        f"{meta['versions'].get('torch')}, commit {str(meta['git_commit'])[:10]}; budget {args.budget_s:.0f} s"
    )
    deadline = time.perf_counter() + args.budget_s
    lines = [run_step(s, sys.executable, args.vllm_python, deadline - time.perf_counter(), meta, args.work,
                      args.results) for s in steps]  # fmt: skip
    results = Path(args.results or RESULTS)
    summary = {"meta": {**meta, "load_average_at_end": load_average()}, "steps": lines}
    (results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[gpu-check] wrote {_shown(results)}/: " + ", ".join(f"{x['step']} {x['status']}" for x in lines))
    return 1 if any(x["status"] == "failed" for x in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
