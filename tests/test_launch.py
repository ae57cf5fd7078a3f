"""The subprocess launcher of the tests ends every worker by PID after its timeout, even workers in new sessions."""

from __future__ import annotations

import os
import sys

import _launch
import psutil
import pytest

LAUNCHER = """
import os, subprocess, sys, time
# like torchrun / accelerate launch: the worker runs in a session of its own
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
with open(sys.argv[1], "w") as f:
    f.write(f"{worker.pid} {os.getsid(worker.pid)} {os.getsid(0)}")
time.sleep(600)
"""


def test_timeout_kills_workers_in_new_sessions(tmp_path):
    script, pid_file = tmp_path / "launcher.py", tmp_path / "pids"
    script.write_text(LAUNCHER)
    with pytest.raises(pytest.fail.Exception, match=r"did not finish within 3 s; killed PIDs"):
        _launch.run([sys.executable, str(script), str(pid_file)], timeout=3)
    worker, worker_session, launcher_session = map(int, pid_file.read_text().split())
    assert worker_session != launcher_session  # os.killpg on the launcher's group would have missed it
    gone = not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    assert gone, f"worker {worker} survived the timeout"


def test_cpu_accelerate_config_keeps_the_sharding(tmp_path):
    import yaml

    path = _launch.cpu_accelerate_config("zero3", tmp_path, num_processes=2)
    config = yaml.safe_load(path.read_text())
    shipped = yaml.safe_load((_launch.ROOT / "accelerate_configs/zero3.yaml").read_text())
    assert config["deepspeed_config"] == shipped["deepspeed_config"]
    assert (config["use_cpu"], config["num_processes"], config["mixed_precision"]) == (True, 2, "no")
    assert os.path.dirname(path) == str(tmp_path)


def test_launch_once_runs_each_launch_once_and_replays_its_failure():
    calls = []

    def launch(name):
        calls.append(name)
        if name == "bad":
            raise AssertionError(f"launch {name} failed")
        return {"name": name}

    get = _launch.launch_once(launch)
    assert get("good") is get("good") and get("good") == {"name": "good"}
    for _ in range(2):  # the second test sharing the launch sees the first error, not a relaunch
        with pytest.raises(AssertionError, match="launch bad failed"):
            get("bad")
    assert calls == ["good", "bad"]
