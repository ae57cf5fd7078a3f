"""A spawned process that dies with the process that started it.

The rollout workers run in a process of their own (`rollout/worker.py`). `ProcessDyingWithParent` asks the OS, from the
child's first instruction, to end it when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`), and `exit_with_parent`
watches the parent from a thread once the child runs: a trainer killed at any point leaves no worker behind.
"""

from __future__ import annotations

import os
import sys
import time

import torch.multiprocessing as mp

__all__ = ["ProcessDyingWithParent", "exit_with_parent"]


# Run first in the spawned interpreter, before it unpickles (and so imports) anything: the OS is asked to SIGKILL the
# process when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`), and a parent already gone ends it at once. Without
# it a trainer killed while its worker imports torch, transformers and TRL (seconds) would leave the worker running
# until `exit_with_parent`'s watch starts.
_DIE_WITH_PARENT = """import os, sys
if sys.platform.startswith("linux"):
    import ctypes, signal
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
if os.getppid() != {parent}:
    os._exit(3)
"""


def _die_with_parent(command: list[str], parent_pid: int) -> list[str]:
    """The spawn command line (`[python, ..., "-c", program, ...]`) with `_DIE_WITH_PARENT` before its program."""
    command = list(command)
    i = command.index("-c") + 1
    command[i] = _DIE_WITH_PARENT.format(parent=parent_pid) + command[i]
    return command


def _popen_dying_with_parent():
    """`multiprocessing`'s spawn `Popen`, its child's command line prefixed by `_DIE_WITH_PARENT` (its `_launch` is
    the standard library's, but for that line)."""
    import io
    from multiprocessing import popen_spawn_posix, reduction, spawn, util
    from multiprocessing.context import set_spawning_popen

    class Popen(popen_spawn_posix.Popen):
        def _launch(self, process_obj):
            from multiprocessing import resource_tracker

            tracker_fd = resource_tracker.getfd()
            self._fds.append(tracker_fd)
            prep_data = spawn.get_preparation_data(process_obj._name)
            fp = io.BytesIO()
            set_spawning_popen(self)
            try:
                reduction.dump(prep_data, fp)
                reduction.dump(process_obj, fp)
            finally:
                set_spawning_popen(None)
            parent_r = child_w = child_r = parent_w = None
            try:
                parent_r, child_w = os.pipe()
                child_r, parent_w = os.pipe()
                cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
                cmd = _die_with_parent(cmd, os.getpid())
                self._fds.extend([child_r, child_w])
                self.pid = util.spawnv_passfds(spawn.get_executable(), cmd, self._fds)
                self.sentinel = parent_r
                with open(parent_w, "wb", closefd=False) as f:
                    f.write(fp.getbuffer())
            finally:
                self.finalizer = util.Finalize(self, util.close_fds, [fd for fd in (parent_r, parent_w) if fd])
                for fd in (child_r, child_w):
                    if fd is not None:
                        os.close(fd)

    return Popen


class ProcessDyingWithParent(mp.get_context("spawn").Process):
    """A spawned process that dies with its parent from its first instruction (`_DIE_WITH_PARENT`; Linux). The OS
    signals it when the *thread* that started it exits: start it from the trainer's main thread (TRL does)."""

    @staticmethod
    def _Popen(process_obj):
        if not sys.platform.startswith("linux") or getattr(sys, "frozen", False):
            return mp.get_context("spawn").Process._Popen(process_obj)
        return _popen_dying_with_parent()(process_obj)


def exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Leave the process as soon as the trainer that started it is gone (re-parented: `getppid` changes)."""
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    os._exit(3)
