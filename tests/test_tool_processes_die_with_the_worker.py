"""A trainer SIGKILLed while its rollout worker waits on a hung tool call leaves no process and no `/dev/shm` file:
the tool processes (started from a fork server) die with the worker, the fork server and the resource tracker
follow (`rollout/tool_calling/runner.py`)."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

# the bound the worker's own exit meets (`test_async_worker_lifecycle`): its tool processes must not outlive it longer
EXITS_WITHIN_S = 10.0
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the OS's parent-death signal (Linux)")


def _worker_waiting_on_a_hung_tool(report) -> None:
    """The rollout worker's part: a `ToolRunner` with two tool processes, both running a call that never returns
    (`tool_timeout_s` 30), reported once running; then waiting on one of them, as the worker's turn does."""
    from _tool_functions import hang

    from hf_rlloss.trainer.async_.rollout.tool_calling import ToolRunner

    runner = ToolRunner(timeout_s=30.0, processes=2, max_hung_threads=4, tick=None, preload=[hang])
    calls = [runner.submit(hang, {"seconds": 3600}) for _ in range(2)]
    while any(call.slot is None for call in calls):
        runner._pump()
        time.sleep(0.01)
    report.send(os.getpid())
    runner.result(calls[0])


def _trainer(report) -> None:
    """A stand-in trainer: starts the worker as the trainer does (`ProcessDyingWithParent`) and waits to be killed."""
    from hf_rlloss.trainer.async_.rollout.process import ProcessDyingWithParent

    worker = ProcessDyingWithParent(target=_worker_waiting_on_a_hung_tool, args=(report,), daemon=True)
    worker.start()
    time.sleep(600)


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_trainer_killed_during_a_hung_tool_call_leaves_no_process_and_no_shared_memory():
    import multiprocessing

    shm_before = set(os.listdir("/dev/shm"))
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    trainer = ctx.Process(target=_trainer, args=(send,))
    trainer.start()
    tree = []
    try:
        assert receive.poll(120.0), "the worker did not start its tool calls"
        worker_pid = receive.recv()
        time.sleep(0.5)  # the calls run in their tool processes
        tree = [p.pid for p in psutil.Process(trainer.pid).children(recursive=True)]
        (server,) = [p for p in psutil.Process(worker_pid).children() if "forkserver" in " ".join(p.cmdline())]
        tools = server.children()  # forked by the fork server
        assert worker_pid in tree and len(tools) == 2, (tree, tools)
        os.kill(trainer.pid, signal.SIGKILL)
        killed = time.monotonic()
        while _alive(tree) and time.monotonic() - killed < 30.0:
            time.sleep(0.05)
        left = {pid: " ".join(psutil.Process(pid).cmdline())[:80] for pid in _alive(tree)}
        assert not left, f"{len(left)} processes outlived the trainer by {time.monotonic() - killed:.0f} s: {left}"
        assert time.monotonic() - killed < EXITS_WITHIN_S
        deadline = time.monotonic() + 5.0
        while set(os.listdir("/dev/shm")) - shm_before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not set(os.listdir("/dev/shm")) - shm_before, sorted(set(os.listdir("/dev/shm")) - shm_before)
    finally:
        trainer.join(timeout=10)
        for pid in _alive([trainer.pid, *tree]):
            os.kill(pid, signal.SIGKILL)
