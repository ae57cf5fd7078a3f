"""The rollout worker's life, through its public behaviour (the spawned worker, the trainer, the config):

* it dies with its trainer in every phase, start-up included (the trainer killed while the worker still imports torch,
  transformers and TRL);
* a reward function it cannot be sent (a lambda) is refused at construction with its own error, and a `start` that
  fails leaves nothing to join or stop;
* `scale_rewards` gives TRL's `GRPOTrainer` advantages (unbiased std + 1e-4; "group", "batch", "none").
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from _async import ASYNC_ARGS, NoWeightTransfer
from _trainer_utils import make_dataset, reward_length

from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker
from hf_rlloss.trainer.common.advantages import group_advantages

torch.set_num_threads(1)

EXITS_WITHIN_S = 2.0


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _trainer_starting_a_worker(policy, tok, out, report) -> None:
    """A stand-in trainer: builds the worker, reports the worker's PID as soon as its process exists, and starts it
    (from its main thread, as TRL does); it is killed while the worker still loads."""
    import threading

    args = RLLossAsyncGRPOConfig(output_dir=out, **ASYNC_ARGS)
    worker = HFGenerateRolloutWorker(policy, make_dataset(), [reward_length], tok, args)

    def send_pid():
        while worker._process is None:
            time.sleep(0.005)
        report.send(worker._process.pid)

    threading.Thread(target=send_pid, daemon=True).start()
    worker.start()
    time.sleep(120)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_the_worker_dies_with_a_trainer_killed_during_its_start_up(policy, tok, tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    trainer = ctx.Process(target=_trainer_starting_a_worker, args=(policy, tok, str(tmp_path), send))
    trainer.start()
    worker_pid = None
    try:
        assert receive.poll(60.0), "the worker was not started"
        worker_pid = receive.recv()
        time.sleep(0.3)  # the worker is importing torch/transformers/TRL (seconds): start-up
        assert _running(worker_pid)
        os.kill(trainer.pid, signal.SIGKILL)
        killed = time.monotonic()
        while _running(worker_pid) and time.monotonic() - killed < 30.0:
            time.sleep(0.02)
        exited_after = time.monotonic() - killed
        print(f"the worker exited {exited_after:.2f} s after its trainer was killed during start-up")
        assert exited_after < EXITS_WITHIN_S, f"the worker outlived its trainer by {exited_after:.1f} s"
    finally:
        trainer.join(timeout=10)
        for pid in (trainer.pid, worker_pid):
            if pid is not None and _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_reward_function_that_cannot_be_sent_is_refused_by_name(policy, tok, tmp_path):
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **ASYNC_ARGS)
    match = r"reward_funcs\[1\] \(.*<lambda>\) is sent to the rollout process and must be picklable"
    with pytest.raises(TypeError, match=match):
        HFGenerateRolloutWorker(policy, make_dataset(), [reward_length, lambda completions, **kw: [0.0]], tok, args)


def test_a_start_that_fails_raises_its_own_error_and_leaves_nothing_to_join(policy, tok, tmp_path):
    """An unpicklable object reaching `start` (set after construction here): the trainer raises the pickling error
    itself, not `can only join a started process` from stopping a process that never started."""
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1, **ASYNC_ARGS)
    worker = HFGenerateRolloutWorker(policy, make_dataset(), [reward_length], tok, args)
    worker._settings.reward_funcs = [lambda completions, **kw: [0.0] * len(completions)]
    trainer = RLLossAsyncGRPOTrainer(policy, [reward_length], args, make_dataset(), tok, rollout_worker=worker,
                                     weight_transfer=NoWeightTransfer())  # fmt: skip
    with pytest.raises(Exception) as caught:
        trainer.train()
    assert "lambda" in str(caught.value) and not isinstance(caught.value, AssertionError), repr(caught.value)
    assert worker._process is None
    worker.stop()  # nothing to stop


def _trl_advantages(rewards: np.ndarray, group: int, scale: str) -> np.ndarray:
    """TRL `GRPOTrainer`'s advantages (sum_then_normalize), with its own `nanstd`."""
    from trl.trainer.utils import nanstd

    r = torch.tensor(rewards, dtype=torch.float64)
    mean = r.view(-1, group).mean(1).repeat_interleave(group)
    std = nanstd(r.view(-1, group), dim=1).repeat_interleave(group) if scale != "batch" else nanstd(r).expand_as(r)
    advantages = r - mean
    return (advantages if scale == "none" else advantages / (std + 1e-4)).numpy()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scale_rewards_gives_trls_advantages(scale):
    rewards = np.random.default_rng(0).normal(size=12)
    groups = rewards.reshape(3, 4)
    batch_std = float(np.std(rewards, ddof=1))
    ours = np.concatenate([group_advantages(g, scale, batch_std)[0] for g in groups])
    np.testing.assert_allclose(ours, _trl_advantages(rewards, 4, scale), rtol=1e-6, atol=1e-9)


def test_scale_rewards_is_validated_and_defaults_to_the_synchronous_trainers(tmp_path):
    from hf_rlloss.trainer import RLLossGRPOConfig

    assert RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True).scale_rewards == "group"
    assert RLLossGRPOConfig(output_dir=str(tmp_path), use_cpu=True).scale_rewards == "group"
    assert RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, scale_rewards=False).scale_rewards == "none"
    with pytest.raises(ValueError, match=r"scale_rewards='std': allowed values are \('group', 'batch', 'none'\)"):
        RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, scale_rewards="std")
