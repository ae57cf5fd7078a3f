"""The two channels between the trainer and a rollout process that must not hang when either side dies.

* `SampleChannel`: rollout samples, worker → trainer. A `multiprocessing.Queue` sends a pickled sample (40-55 KB
  for 1-2k tokens) in several writes; a worker killed between them leaves half a message, and `Queue.get` then blocks
  in `recv_bytes` forever, past its timeout, with the health check never called. Here the trainer reads the pipe
  itself, with `select` and a deadline: it keeps partial frames in a buffer, and the trainer's copy of the write end
  is closed once the worker has started, so a dead writer is an end of file, reported at once, naming the worker
  (`health`). Bounded by `maxsize` slots (a semaphore), like the queue it replaces.
* `LatestWeights`: the trainer's weights, trainer → worker. One shared-memory copy, sent to the worker once (one file
  descriptor per tensor, once) and overwritten in place by each later version under a lock: only the newest weights
  are kept, so a slow worker cannot make unread messages (each with a shared copy of the model and its descriptors)
  pile up.
* `SharedFlag`: a `multiprocessing.Event` without its lock (the worker's stop, ready and failed flags).

No primitive shared with the worker has a lock the trainer can be left waiting on by a dead worker, except the
weights' lock, which the trainer waits on with a timeout and a health check: the counters and flags are plain shared
integers, each written by one side only (an aligned 8-byte store or load is atomic), and `Value`s are made with
`lock=False`. A synchronized `Value` or an `Event` takes a shared lock on every read and write: a worker SIGKILLed
while holding it (between two instructions of `heartbeat.value = ...` or `stop.is_set()`) would leave the trainer
blocked for ever in the next read, with no health check called.

Neither is shipped by multiprocessing, torch or TRL with these guarantees (reads with a deadline that survive a
half-written message; a latest-value mailbox for tensors), hence this module.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["LatestWeights", "SampleChannel", "SharedFlag"]

HEADER = struct.Struct("!Q")  # payload length


def _no_health_check() -> None: ...


class SharedFlag:
    """`multiprocessing.Event`'s `set`, `clear`, `is_set` and `wait` on one shared byte, without a lock: a process
    killed in any of them leaves nothing locked (an `Event` takes a shared lock in each, so a worker killed while it
    checks its stop flag blocks the trainer's `set` for ever). `wait` polls.

    Args:
        ctx: the `multiprocessing` context the other process is started with.
    """

    def __init__(self, ctx):
        self._value = ctx.Value("b", 0, lock=False)

    def set(self) -> None:
        self._value.value = 1

    def clear(self) -> None:
        self._value.value = 0

    def is_set(self) -> bool:
        return bool(self._value.value)

    def wait(self, timeout: float | None = None, poll_s: float = 0.01) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True


class SampleChannel:
    """A bounded channel of pickled objects from one writer process to one reader, whose reads never hang.

    Args:
        ctx: the `multiprocessing` context the writer is started with.
        maxsize (`int`): objects in flight at most (`put` waits for a slot); 0 for unbounded.
    """

    def __init__(self, ctx, maxsize: int = 0):
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._slots = ctx.BoundedSemaphore(maxsize) if maxsize > 0 else None
        # objects written (the writer's count) and read (the reader's): `qsize` is their difference. No lock: each
        # count has one writer, so a writer killed anywhere leaves nothing for the reader to wait on
        self._sent = ctx.Value("q", 0, lock=False)
        self._received = 0
        self._buffer = bytearray()
        self.health: Callable[[], None] = _no_health_check  # raises, naming the cause, when the writer is dead

    def __getstate__(self):  # the reader's buffer and health check stay in the reader's process
        state = dict(self.__dict__)
        state["_buffer"], state["health"] = bytearray(), _no_health_check
        return state

    def close_writer(self) -> None:
        """Close this process' copy of the write end (the reader's, once the writer process has its own): the
        writer's death is then an end of file for the reader."""
        self._writer.close()

    # writer side --------------------------------------------------------------------------------------------------

    def put(self, obj: Any, timeout: float | None = None) -> None:
        """Send `obj`; raise `queue.Full` when no slot frees within `timeout` seconds."""
        if self._slots is not None and not self._slots.acquire(timeout=timeout):
            raise queue.Full
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._sent.value += 1  # this process is the only writer
        view = memoryview(HEADER.pack(len(payload)) + payload)
        fd = self._writer.fileno()
        while view:
            view = view[os.write(fd, view) :]

    # reader side --------------------------------------------------------------------------------------------------

    def qsize(self) -> int:
        """Objects written (or being written) and not read yet; never blocks."""
        return int(self._sent.value) - self._received

    def get(self, timeout: float | None = None) -> Any:
        """The next object; `queue.Empty` when none arrives within `timeout` seconds. A writer that died (even in the
        middle of a message) raises the health check's error (or a `RuntimeError`) as soon as it is seen."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self._reader.fileno()
        while True:
            obj = self._pop_frame()
            if obj is not _NOTHING:
                return obj
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if wait <= 0:
                if self._buffer:  # part of a message: its writer may be dead
                    self.health()
                raise queue.Empty
            readable, _, _ = select.select([fd], [], [], wait)
            if not readable:
                if self._buffer:
                    self.health()
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self._writer_gone()
            self._buffer += chunk

    def _pop_frame(self) -> Any:
        if len(self._buffer) < HEADER.size:
            return _NOTHING
        (size,) = HEADER.unpack_from(self._buffer)
        end = HEADER.size + size
        if len(self._buffer) < end:
            return _NOTHING
        obj = pickle.loads(bytes(self._buffer[HEADER.size : end]))
        del self._buffer[:end]
        self._received += 1
        if self._slots is not None:
            self._slots.release()
        return obj

    def _writer_gone(self) -> None:
        """End of file: every writer closed the pipe. The health check names why (it may take a moment to see the
        process as exited); failing that, a plain error."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            self.health()
            time.sleep(0.1)
        partial = f", {len(self._buffer)} bytes into a message" if self._buffer else ""
        raise RuntimeError(f"the rollout channel was closed by its writer{partial}")


_NOTHING = object()


class LatestWeights:
    """The newest weights of the trainer, in one shared-memory copy the worker reads when it is ready.

    Args:
        ctx: the `multiprocessing` context the worker is started with.
        lock_timeout_s (`float`, *optional*, defaults to `1.0`): how often a side waiting for the lock checks the
            other's health (a process killed while holding the lock would otherwise block the other forever).
    """

    def __init__(self, ctx, lock_timeout_s: float = 1.0):
        self._handoff = ctx.Queue(maxsize=1)  # carries the shared tensors once
        # no lock of their own (`lock=False`): the first is written by the trainer only, the second by the worker only
        self._version = ctx.Value("q", 0, lock=False)  # the newest version written (0: none)
        self._read = ctx.Value("q", 0, lock=False)  # the newest version the reader has copied
        self._lock = ctx.Lock()
        self._lock_timeout_s = lock_timeout_s
        self._state: dict[str, torch.Tensor] | None = None  # the trainer's (writer's) view
        self._shared: dict[str, torch.Tensor] | None = None  # the worker's (reader's) view

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_state"] = state["_shared"] = None
        return state

    @property
    def version(self) -> int:
        return int(self._version.value)

    def _locked(self, health: Callable[[], None]):
        while not self._lock.acquire(timeout=self._lock_timeout_s):
            health()
        return self._lock

    def publish(
        self,
        version: int,
        tensors: Iterator[tuple[str, torch.Tensor]],
        health=_no_health_check,
        wait_read: bool = False,
    ) -> None:
        """Trainer side: make `tensors` the newest weights, as `version` (the first call allocates the shared copy
        and hands it to the worker; later calls overwrite it in place). `wait_read`: first wait until the reader has
        copied the previous version (calling `health` meanwhile), so that it sees every version."""
        if self._state is None:
            self._state = {name: t.detach().to("cpu", copy=True).share_memory_() for name, t in tensors}
            self._handoff.put(self._state)
            self._version.value = version
            return
        while wait_read and self._read.value < self._version.value:
            health()
            time.sleep(0.01)
        lock = self._locked(health)
        try:
            for name, tensor in tensors:
                self._state[name].copy_(tensor.detach())
            self._version.value = version
        finally:
            lock.release()

    def read_newer(self, than: int, apply: Callable[[dict[str, torch.Tensor]], None], health=_no_health_check):
        """Worker side: when the newest version is newer than `than`, call `apply` on its tensors (under the lock:
        `apply` must copy what it keeps) and return that version; else `None`."""
        if self.version <= than:
            return None
        if self._shared is None:
            self._shared = self._handoff.get(timeout=60.0)
        lock = self._locked(health)
        try:
            version = self.version
            apply(self._shared)
            self._read.value = version
        finally:
            lock.release()
        return version
