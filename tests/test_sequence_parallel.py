"""sp_split / sp_gather: padding values, shard layout, and the split-then-gather identity (2 processes)."""

import pytest
import torch
from _dist import run_distributed

from hf_rlloss import sp_gather, sp_split
from hf_rlloss.parallel.sequence import pad_to_multiple


def test_identity_without_mesh():
    x = torch.arange(5).reshape(1, 5)
    assert sp_split(x, None) is x and sp_gather(x, None) is x


def test_pad_to_multiple_any_dim_and_dtype():
    x = torch.arange(6).reshape(2, 3)
    torch.testing.assert_close(pad_to_multiple(x, 2, 1, -100), torch.tensor([[0, 1, 2, -100], [3, 4, 5, -100]]))
    torch.testing.assert_close(pad_to_multiple(x.float(), 4, 0, 1.0)[2:], torch.ones(2, 3))
    assert pad_to_multiple(x, 3, 1, 0) is x


def _split_gather_worker(rank, world_size, out_dir):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    labels = torch.arange(7).reshape(1, 7)
    shard = sp_split(labels, mesh, 1, -100)
    gathered = sp_gather(shard, mesh, 1)
    weights = sp_split(torch.full((2, 5), 0.5), mesh, 1, 1.0)
    torch.save((shard, gathered, weights), f"{out_dir}/rank{rank}.pt")


@pytest.mark.distributed
def test_split_then_gather_is_identity_after_trimming(tmp_path):
    run_distributed(_split_gather_worker, 2, str(tmp_path), timeout=120)
    shard0, gathered, w0 = torch.load(tmp_path / "rank0.pt")
    shard1, _, w1 = torch.load(tmp_path / "rank1.pt")
    assert shard0.tolist() == [[0, 1, 2, 3]] and shard1.tolist() == [[4, 5, 6, -100]]
    assert gathered[:, :7].tolist() == [list(range(7))] and gathered[0, 7] == -100
    assert w0.shape == (2, 3) and w1[:, -1].tolist() == [1.0, 1.0] and w1[:, :2].eq(0.5).all()


def _exit_hook_worker(rank, world_size):
    import atexit

    import torch.distributed as dist

    from hf_rlloss.parallel.sequence import build_sp_mesh, destroy_process_groups

    calls = []
    real_register = atexit.register
    atexit.register = lambda fn: calls.append(fn) or real_register(fn)
    try:
        build_sp_mesh(2)
        build_sp_mesh(2)
    finally:
        atexit.register = real_register
    assert calls == [destroy_process_groups, destroy_process_groups]  # re-registered, unregistered in between
    destroy_process_groups()  # what runs at exit: every group gone, and a second call is harmless
    assert not dist.is_initialized()
    destroy_process_groups()


def test_sp_mesh_destroys_its_process_groups_at_exit():
    """A rank that leaves with live gloo subgroups can abort in their destructors: `build_sp_mesh` registers an exit
    hook that destroys every group."""
    run_distributed(_exit_hook_worker, 2, timeout=120)
