"""Faults: empty ranks join every collective, a raising rank fails the test fast, nothing hangs."""

import time

import pytest
import torch
from _data import IGNORE, assert_equals_one_process, averaged_over_ranks, make_step, run_step
from _dist import run_distributed
from torch.multiprocessing import ProcessRaisedException

from hf_rlloss import GRPOLossConfig


def _config():
    return GRPOLossConfig(
        policy_loss_cfg={"loss_type": "gspo"},
        use_kl_loss=True,
        kl_loss_type="k3",
        rollout_is={"level": "sequence", "mode": "both", "upper": 3.0},
    )


def _step_with_empty_half():
    step = make_step(seed=9)
    step["labels"][4:] = IGNORE  # rows 4..7 carry no loss: the rank that gets them has nothing to train on
    return step


def _empty_rank_worker(rank, world_size, out_dir):
    step = _step_with_empty_half()
    rows = [0, 1, 2, 3] if rank == 0 else [4, 5, 6, 7]
    results = {}
    for path in ("logprobs", "hidden"):
        loss, _, grad_w, metrics = run_step(_config(), step, [rows[:2], rows[2:]], path)
        results[path] = averaged_over_ranks(loss, grad_w, metrics)
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.mark.distributed
def test_rank_without_valid_tokens_joins_every_collective_and_contributes_zero(tmp_path):
    run_distributed(_empty_rank_worker, 2, str(tmp_path), timeout=120)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for path, result in results.items():
            assert_equals_one_process(result, _config(), _step_with_empty_half(), path)


def _fails_within(seconds, worker, error, match, timeout):
    """`run_distributed(worker, 2, timeout=timeout)` raises `error` (matching `match`) in less than `seconds`."""
    start = time.monotonic()
    with pytest.raises(error, match=match):
        run_distributed(worker, 2, timeout=timeout)
    assert time.monotonic() - start < seconds


def _raising_worker(rank, world_size):
    if rank == 1:
        raise RuntimeError("injected failure on rank 1")
    torch.distributed.barrier()  # rank 0 waits in a collective its peer never joins


@pytest.mark.distributed
def test_a_raising_rank_fails_the_test_instead_of_hanging():
    # whichever rank reports first, it fails: rank 1's own error, or rank 0 failing on the dead peer, in its barrier
    # or, when rank 1 died before rank 0 finished connecting, in gloo's rendezvous ("Connection closed by peer")
    _fails_within(
        60,
        _raising_worker,
        ProcessRaisedException,
        "injected failure on rank 1|barrier|Connection closed by peer",
        timeout=60,
    )


def _hanging_worker(rank, world_size):
    if rank == 0:
        torch.distributed.barrier()
    else:
        time.sleep(600)


@pytest.mark.distributed
def test_a_hang_is_killed_at_the_timeout():
    _fails_within(40, _hanging_worker, TimeoutError, "did not finish within 15 s", timeout=15)
