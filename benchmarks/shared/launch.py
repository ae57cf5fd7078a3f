"""The one launcher of the subprocess tests and the benchmarks: a free port, a hard timeout, and every worker ended
BY PID.

`torchrun` and `accelerate launch` start their workers in sessions of their own, so killing the launcher's process
group (`os.killpg`) leaves the workers running (and holding the port and both cores). `kill_tree` collects the
launcher's descendants with psutil (`children(recursive=True)`) and kills each by its PID.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]

# Every launch: one thread per process (2 cores shared), no Hub, DeepSpeed on its CPU accelerator.
LAUNCH_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DS_ACCELERATOR": "cpu",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}


def _fail(message: str):
    """Fail the current test (pytest's `Failed`) under pytest, else raise `TimeoutError`."""
    if "pytest" in sys.modules:
        import pytest

        pytest.fail(message)
    raise TimeoutError(message)


def python_module(module: str) -> list[str]:
    """`python -m module` with this Python: how a benchmark starts itself again in a fresh process (from the
    repository root, `cwd=ROOT`, so that `benchmarks` imports)."""
    return [sys.executable, "-m", module]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and all its descendants, each by PID (descendants first collected, then killed); the PIDs."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    procs = [*root.children(recursive=True), root]
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    return [proc.pid for proc in procs]


def run(
    cmd: list[str], timeout: float, cwd=None, env: dict | None = None, stdout: bool = False
) -> subprocess.CompletedProcess:
    """Run `cmd` (stderr captured, stdout too with `stdout=True`, else discarded); after `timeout` s kill it and all
    its workers and fail."""
    return run_all([cmd], timeout, cwd, env, stdout)[0]


def run_all(cmds: list[list[str]], timeout: float, cwd=None, env: dict | None = None, stdout: bool = False) -> list:
    """Run `cmds` concurrently (e.g. the machine ranks of a multi-node launch); after `timeout` s for all of them
    kill each with all its workers and fail. Returns their `CompletedProcess` (stderr, and stdout with
    `stdout=True`, captured in files so that no pipe can fill up while the others run)."""
    env = {**os.environ, **LAUNCH_ENV, **(env or {})}
    procs, logs, outs = [], [], []
    try:
        for cmd in cmds:
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            out = tempfile.TemporaryFile(mode="w+") if stdout else subprocess.DEVNULL
            outs.append(out)
            procs.append(
                subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=log, text=True, start_new_session=True)
            )
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                killed = [pid for p in procs for pid in kill_tree(p.pid)]
                command = " ".join(map(str, cmds[0][:6]))
                _fail(f"{command} ... did not finish within {timeout:.0f} s; killed PIDs {killed}")
    finally:  # also on Ctrl-C or a failure above: leave no worker behind
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
    results = []
    for cmd, proc, log, out in zip(cmds, procs, logs, outs):
        log.seek(0)
        printed = None
        if stdout:
            out.seek(0)
            printed = out.read()
            out.close()
        results.append(subprocess.CompletedProcess(cmd, proc.returncode, printed, log.read()))
        log.close()
    return results


def torchrun(nproc: int) -> list[str]:
    """The launcher prefix for `nproc` processes: plain python for one, torchrun on a free port otherwise."""
    if nproc == 1:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
    ]


def shipped_accelerate_config(name: str, out_dir: Path, suffix: str, **overrides) -> Path:
    """The shipped `accelerate_configs/<name>.yaml` with `overrides` replacing top-level keys, written to
    `out_dir/<name>_<suffix>.yaml`."""
    config = yaml.safe_load((ROOT / "accelerate_configs" / f"{name}.yaml").read_text()) | overrides
    path = Path(out_dir) / f"{name}_{suffix}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cpu_accelerate_config(name: str, out_dir: Path, num_processes: int = 2, **overrides) -> Path:
    """The shipped `accelerate_configs/<name>.yaml` made to run here: on CPU, `num_processes` processes, fp32; its
    sharding settings unchanged. `overrides` replace further top-level keys."""
    return shipped_accelerate_config(
        name, out_dir, "cpu", use_cpu=True, num_processes=num_processes, mixed_precision="no", **overrides
    )


def accelerate_launch(
    config: Path, script: Path | str, *args: str, main_process_port: int | None = None, machine_rank: int | None = None
) -> list[str]:
    """`accelerate launch --config_file config script args` as a command (through `python -m`, so this Python)."""
    launch = ["--main_process_port", str(main_process_port or free_port())]
    if machine_rank is not None:
        launch += ["--machine_rank", str(machine_rank)]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        *launch,
        str(script),
        *args,
    ]


def accelerate_launch_machines(config: Path, script: Path | str, *args: str) -> list[list[str]]:
    """One `accelerate launch` command per machine rank of a multi-node `config`, on one free port (run them together
    with `run_all`)."""
    num_machines = yaml.safe_load(Path(config).read_text())["num_machines"]
    port = free_port()
    return [
        accelerate_launch(config, script, *args, main_process_port=port, machine_rank=rank)
        for rank in range(num_machines)
    ]


def launch_once(launch):
    """`get(name)`: `launch(name)` run once per name and remembered, its failure too.

    Module fixtures share one launch among many parametrized tests. A failed launch re-raises its own error in each
    of them (not a second launch, nor a `FileExistsError` for the output folder the first attempt created)."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            try:
                cache[name] = launch(name)
            except BaseException as err:  # pytest's Failed from `run` derives from BaseException
                cache[name] = err
                raise
        if isinstance(cache[name], BaseException):
            raise cache[name]
        return cache[name]

    return get
