"""Where a multi-turn batch's tool calls run: concurrently, each where a call that does not return can be stopped.

`ToolRunner` runs the calls TRL's loop makes during one turn of a batch side by side (`MultiTurnRollouts` submits a
turn's calls as soon as the first of them is made, and TRL's loop then collects them one after another):

* a **tool** (a `tools=` function, pickled by reference) runs in one of `tool_processes` small processes of its own,
  started once (from a fork server, so a replacement starts in milliseconds) and reused. A call that does not return
  within `tool_timeout_s` is a `ToolTimeoutError`, and its process is killed and replaced: a hung tool leaves no
  thread, no memory and no process behind. What a tool keeps in module state therefore lives in its process;
  `tool_processes=0` runs the tools in threads of the rollout process instead, and a tool defined in the script that
  was run (`__main__`) always runs in one (`in_main_module`). A tool process ends as soon as the rollout process is
  gone, even in the middle of a call that hangs (it waits on the worker's pidfd); the fork server and the resource
  tracker then end with it;
* an **environment's method** runs in a thread of the rollout process (the environment's state lives there: the
  reward functions and `get_reward` read it), its calls one after another in the order the model wrote them. A
  thread whose call timed out cannot be stopped: the environment's later calls are refused (`ToolTimeoutError`)
  while it runs (`MultiTurnRollouts` replaces it by a new one after the batch), and when `max_hung_tool_threads` such
  threads are alive the next thread to start stops the worker with `HungToolCallsError`, instead of piling up
  threads for ever.

Every call that ends (returned, raised or timed out) ticks the worker's heartbeat: hung tools are slow progress, not a
stalled worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import multiprocessing
import os
import pickle
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["HungToolCallsError", "ToolRunner"]


class HungToolCallsError(RuntimeError):
    """More than `max_hung_tool_threads` tool calls run in threads of the rollout process timed out and are still
    running (an environment's method, or a tool under `tool_processes=0`): they cannot be stopped."""


# The program of a tool process (run by `exec`, so that starting one imports nothing but the tools' modules): run the
# `(function, arguments)` requests on `conn` until it closes; reply `("ok", result)` or `("raised", pickled exception,
# its text)`. It ends as soon as the rollout worker that started it (`worker`, a PID) is gone, whatever it is running:
# its parent is the fork server, which stays up while any tool process holds the server's liveness pipe, so neither
# the parent-death signal (which would come from the fork server) nor the closed `conn` (unread during a call that
# hangs) would end it; a thread waits on the worker's pidfd (Linux; elsewhere it polls the PID) instead.
_SERVE = """
import asyncio, inspect, os, pickle, select, sys, threading, time
if sys.platform.startswith("linux"):
    import ctypes, signal
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)

def watch(pid):
    try:
        select.select([os.pidfd_open(pid)], [], [])
    except (AttributeError, OSError):  # no pidfd here, or the worker is already gone
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
    os._exit(3)

threading.Thread(target=watch, args=(worker,), daemon=True).start()

def run(request):
    try:
        function, arguments = pickle.loads(request)
        result = function(**arguments)
        return ("ok", asyncio.run(result) if inspect.isawaitable(result) else result)
    except BaseException as error:
        try:
            payload = pickle.dumps(error)
        except Exception:
            payload = None
        return ("raised", payload, type(error).__name__ + ": " + str(error))

while True:
    try:
        request = conn.recv_bytes()
    except EOFError:
        break
    reply = run(request)
    try:
        conn.send(reply)
    except Exception as error:
        conn.send(("raised", None, "TypeError: the tool's result cannot be sent from its process: " + str(error)))
"""


def _raised(payload: bytes | None, text: str) -> BaseException:
    """The tool's exception as it raised it, or a `RuntimeError` with its text when it does not unpickle."""
    if payload is not None:
        with contextlib.suppress(Exception):
            return pickle.loads(payload)
    return RuntimeError(text)


@contextlib.contextmanager
def _without_main():
    """Start a tool process without the main module: multiprocessing would import the script that was run again in
    every process it starts (Python 3.11's fork server does not preload it); a tool of the script runs in a thread
    (`in_main_module`)."""
    main = sys.modules["__main__"]
    stand_in = types.ModuleType("__main__")
    stand_in.__spec__ = types.SimpleNamespace(name="__main__")  # multiprocessing: nothing to import
    sys.modules["__main__"] = stand_in
    try:
        yield
    finally:
        sys.modules["__main__"] = main


@contextlib.contextmanager
def _may_have_children():
    """Let a daemonic process (the rollout worker is one) start tool processes: multiprocessing refuses it because a
    daemon's children are not joined at its exit; a tool process dies with its parent instead (`_SERVE`)."""
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


class _Slot:
    """One tool process and the call it runs."""

    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        with _may_have_children(), _without_main():
            program = {"conn": child, "worker": os.getpid()}
            self.process = ctx.Process(target=exec, args=(_SERVE, program), name="hf-rlloss-tool", daemon=True)
            self.process.start()
        child.close()
        self.call: _Call | None = None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


@dataclasses.dataclass(eq=False)
class _Call:
    function: Callable
    arguments: dict[str, Any]
    lane: Any  # None: a tool process; else the environment (or thread lane) its calls are ordered in
    outcome: tuple | None = None  # ("ok", result) | ("raised", exception) | ("timeout", message)
    deadline: float = float("inf")
    slot: _Slot | None = None
    thread: threading.Thread | None = None
    box: dict[str, Any] = dataclasses.field(default_factory=dict)


class ToolRunner:
    """Runs tool calls concurrently, each for at most `timeout_s` (see the module docstring).

    Args:
        timeout_s (`float`): how long one call may run, from its start.
        processes (`int`): tool processes (concurrent tool calls); `0`: tools run in threads.
        max_hung_threads (`int`): threads of calls that timed out and still run, beyond which `HungToolCallsError`.
        tick (`Callable`, *optional*): called whenever a call ends (the worker's heartbeat).
        preload (`list[Callable]`, *optional*): tools whose modules the fork server imports once, when the first
            tool process starts (`preload`).

    Example:

    ```python
    >>> from hf_rlloss.recipe_support.tools import TOOLS
    >>> from hf_rlloss.trainer.async_.rollout.tool_calling import ToolRunner
    >>> runner = ToolRunner(timeout_s=30.0, processes=1, max_hung_threads=4, tick=None, preload=[TOOLS["add"]])
    >>> runner.result(runner.submit(TOOLS["add"], {"a": 2, "b": 3}))
    ('ok', 5)
    >>> runner.close()
    ```
    """

    def __init__(self, timeout_s: float, processes: int, max_hung_threads: int, tick: Callable[[], None] | None,
                 preload: list[Callable] = ()):  # fmt: skip
        self.timeout_s, self.processes, self.max_hung_threads = timeout_s, processes, max_hung_threads
        self.preload = list(preload)
        self.tick = tick or (lambda: None)
        self.pending: deque[_Call] = deque()
        self.running: list[_Call] = []
        self.slots: list[_Slot] = []
        self.hung: dict[Any, threading.Thread] = {}  # lane -> the thread of its call that timed out
        self._ctx = None

    def submit(self, function: Callable, arguments: dict[str, Any], lane: Any = None, thread: bool = False) -> _Call:
        """Start `function(**arguments)` as soon as a tool process is free, or in a thread (`thread`, a `lane`, or no
        tool processes) once the calls submitted before it in its `lane` (an environment) have ended."""
        if lane is None and (thread or not self.processes):
            lane = object()  # a thread of its own
        call = _Call(function, dict(arguments), lane)
        self.pending.append(call)
        self._pump()
        return call

    def result(self, call: _Call) -> tuple:
        """Wait for `call`: `("ok", result)`, `("raised", exception)` or `("timeout", message)`."""
        while call.outcome is None:
            self._pump()
            if call.outcome is None:
                time.sleep(0.005)
        return call.outcome

    def abandon(self) -> None:
        """Forget the calls nobody will collect (a batch that ended): queued ones are dropped, running ones stopped
        (a tool process killed, a thread left to the hung-thread bound)."""
        self.pending.clear()
        for call in list(self.running):
            self._time_out(call, "abandoned")

    def close(self) -> None:
        self.abandon()
        for slot in self.slots:
            slot.kill()
        self.slots.clear()

    def _pump(self) -> None:
        now = time.monotonic()
        for call in list(self.running):
            self._collect(call, now)
        for call in list(self.pending):
            self._start(call)

    def _collect(self, call: _Call, now: float) -> None:
        if call.slot is not None and call.slot.conn.poll():
            try:
                reply = call.slot.conn.recv()
            except (EOFError, OSError):  # the process died under the call
                reply = ("raised", None, f"RuntimeError: the tool process exited ({call.slot.process.exitcode})")
                self._drop_slot(call.slot)
            self._end(call, ("ok", reply[1]) if reply[0] == "ok" else ("raised", _raised(reply[1], reply[2])))
        elif call.thread is not None and not call.thread.is_alive():
            self._end(call, call.box["outcome"])
        elif now > call.deadline:
            self._time_out(call, f"did not return within tool_timeout_s={self.timeout_s:g}s")

    def _time_out(self, call: _Call, why: str) -> None:
        if call.slot is not None:
            self._drop_slot(call.slot)  # killed: a hung tool leaves nothing behind
        elif call.thread is not None:
            self.hung[call.lane] = call.thread
        self._end(call, ("timeout", why))

    def _end(self, call: _Call, outcome: tuple) -> None:
        call.outcome = outcome
        self.running.remove(call)
        if call.slot is not None:
            call.slot.call = None
        self.tick()

    def _drop_slot(self, slot: _Slot) -> None:
        slot.kill()
        self.slots.remove(slot)

    def _start(self, call: _Call) -> None:
        if call.lane is None:
            slot = self._free_slot()
            if slot is None:
                return
            self.pending.remove(call)
            slot.call, call.slot = call, slot
            slot.conn.send_bytes(pickle.dumps((call.function, call.arguments)))
        else:
            if any(c.lane is call.lane for c in self.running) or any(c.lane is call.lane for c in self._before(call)):
                return  # one call of an environment at a time, in order
            self.pending.remove(call)
            if self._lane_hung(call.lane):
                call.outcome = ("timeout", "was not run: a previous call on its environment timed out and still runs")
                self.tick()
                return
            self._start_thread(call)
        call.deadline = time.monotonic() + self.timeout_s
        self.running.append(call)

    def _before(self, call: _Call) -> list[_Call]:
        return list(self.pending)[: self.pending.index(call)]

    def is_hung(self, lane: Any) -> bool:
        """Whether a call of `lane` (an environment) timed out and still runs."""
        return self._lane_hung(lane)

    def _lane_hung(self, lane: Any) -> bool:
        thread = self.hung.get(lane)
        if thread is not None and not thread.is_alive():
            del self.hung[lane]
            return False
        return thread is not None

    def _start_thread(self, call: _Call) -> None:
        alive = [lane for lane, thread in self.hung.items() if thread.is_alive()]
        self.hung = {lane: self.hung[lane] for lane in alive}
        if len(self.hung) >= self.max_hung_threads:
            raise HungToolCallsError(
                f"{len(self.hung)} tool calls timed out (tool_timeout_s={self.timeout_s:g}s) and still run in threads "
                f"of the rollout process, max_hung_tool_threads={self.max_hung_threads}: an environment's methods "
                "(or tools under tool_processes=0) hang and cannot be stopped. Fix what hangs, or run the tools in "
                "tool processes (tool_processes > 0), where a hung call is killed"
            )

        def target() -> None:
            try:
                result = call.function(**call.arguments)
                call.box["outcome"] = ("ok", asyncio.run(result) if inspect.isawaitable(result) else result)
            except BaseException as error:  # noqa: BLE001 - the caller's outcome
                call.box["outcome"] = ("raised", error)

        call.thread = threading.Thread(target=target, daemon=True, name=f"tool-{call.function.__name__}")
        call.thread.start()

    def _free_slot(self) -> _Slot | None:
        for slot in self.slots:
            if slot.call is None:
                return slot
        if len(self.slots) >= self.processes:
            return None
        if self._ctx is None:
            preload(self.preload)  # before the fork server starts: its modules are imported there once
            self._ctx = multiprocessing.get_context("forkserver")
        self.slots.append(_Slot(self._ctx))
        return self.slots[-1]


def in_main_module(function: Callable) -> bool:
    """A function of the script that was run (`__main__`, `__mp_main__` in a spawned process): a tool process would
    have to run the script again to find it, so it runs in a thread."""
    return getattr(function, "__module__", None) in ("__main__", "__mp_main__")


def preload(functions: list[Callable]) -> None:
    """Import the tools' modules once, in the fork server the tool processes start from (before it starts)."""
    modules = {f.__module__ for f in functions if not in_main_module(f)}
    multiprocessing.get_context("forkserver").set_forkserver_preload(sorted(modules))
