"""Run a function in N gloo processes from a test, with a hard timeout so that a hang fails instead of blocking."""

from __future__ import annotations

import os
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp
from _launch import kill_tree

from hf_rlloss.parallel.sequence import destroy_process_groups


def _entry(rank, world_size, init_file, fn, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        destroy_process_groups()  # unless the test already did


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; fail on error or after ``timeout``."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        context = mp.start_processes(
            _entry, args=(world_size, init_file, fn, args), nprocs=world_size, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    kill_tree(process.pid)  # by PID, with anything it started
                raise TimeoutError(f"distributed test did not finish within {timeout:.0f} s (hang?)")


class FakeSPMesh:
    """What `sp_split`, `sp_shard_inputs` and `sp_rank` read from an SP mesh: its size and this rank's index, for
    tests of one rank's shard without process groups."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank
