"""A rollout worker SIGKILLed inside a critical section of a primitive it shares with the trainer: the trainer names
the dead worker within seconds, for each primitive (the sample channel's count, the weights' version, the stop flag).

The worker is a forked child given the real worker's primitives: it does its work, takes every shared lock the
primitive exposes (`_async.die_holding_locks`: what a worker killed in the middle of using it would hold) and kills
itself. A primitive with a lock the trainer waits on without a deadline (a synchronized `Value`, an `Event`) leaves
the trainer blocked for ever: the trainer's side runs in a thread, and a thread still running at the deadline fails
the test.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import torch
from _async import ASYNC_ARGS, die_holding_locks, prompts_dataset

from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker, QueueWeightTransfer, RolloutWorkerDiedError

torch.set_num_threads(1)

NAMED_WITHIN_S = 10.0


def _worker(policy, tok, tmp_path, **options):
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **{**ASYNC_ARGS, **options})
    return HFGenerateRolloutWorker(policy, prompts_dataset(), [], tok, args), args


def _start_dying(worker, *objects, before=None) -> None:
    """Start, as `worker`'s process, a child that runs `before`, takes the shared locks of `objects` and is
    SIGKILLed; the trainer's copy of the channel's write end is closed, as `HFGenerateRolloutWorker.start` does."""
    child = multiprocessing.get_context("fork").Process(
        target=die_holding_locks, args=objects, kwargs={"before": before}, daemon=True
    )
    worker._process = child
    child.start()
    worker.rollout_buffer.close_writer()
    child.join(timeout=30)
    assert child.exitcode == -9


def _run_within(seconds: float, fn):
    """`fn()` in a thread: `(its result or exception, seconds taken)`; fails the test if it runs past `seconds`."""
    outcome = []

    def run():
        try:
            outcome.append(fn())
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            outcome.append(err)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert not thread.is_alive(), f"the trainer is still blocked after {seconds:.0f} s"
    return outcome[0], time.monotonic() - start


def _assert_named(error, elapsed):
    assert isinstance(error, RolloutWorkerDiedError), repr(error)
    assert "rollout process exited (exit code -9)" in str(error)
    assert elapsed < NAMED_WITHIN_S
    print(f"named in {elapsed:.2f} s")


def test_killed_holding_the_sample_channel_count(policy, tok, tmp_path):
    """The worker sends a sample and is killed inside the next `put`: the trainer reads the sample, asks the queue's
    size (TRL's dataset does after each sample), and its next read names the dead worker."""
    worker, _ = _worker(policy, tok, tmp_path)
    channel = worker.rollout_buffer
    _start_dying(worker, channel, before=lambda: channel.put({"sample": 1}))
    seen = []

    def trainer_side():
        seen.append(channel.get(timeout=30.0))
        seen.append(channel.qsize())
        return channel.get(timeout=30.0)

    error, elapsed = _run_within(NAMED_WITHIN_S, trainer_side)
    assert seen == [{"sample": 1}, 0]
    _assert_named(error, elapsed)


def test_killed_holding_the_weights_version(policy, tok, tmp_path):
    """The worker is killed while it reads the weights (the weights' lock and their version counters held): the
    trainer's weight syncs, as TRL makes them (send, then bump the version), name the dead worker."""
    worker, _ = _worker(policy, tok, tmp_path)
    transfer = QueueWeightTransfer(worker)
    _start_dying(worker, worker.weights)
    state = {"w": torch.zeros(4)}

    def trainer_side():
        for version in (1, 2, 3):
            transfer.send_weights(iter(state.items()))
            worker.update_model_version(version)

    error, elapsed = _run_within(NAMED_WITHIN_S, trainer_side)
    _assert_named(error, elapsed)


def test_killed_holding_the_stop_flag_the_error_reaches_the_user(policy, tok, tmp_path):
    """The worker is killed while it checks its stop flag (and ticks its heartbeat): `train` raises the error naming
    it (TRL stops the worker on the way out, which must not block)."""
    worker, args = _worker(policy, tok, tmp_path, max_steps=1)
    worker.start = lambda: _start_dying(worker, worker._stop, worker._heartbeat)
    trainer = RLLossAsyncGRPOTrainer(policy, [], args, prompts_dataset(), tok, rollout_worker=worker,
                                     weight_transfer=QueueWeightTransfer(worker))  # fmt: skip
    error, elapsed = _run_within(60.0, trainer.train)
    _assert_named(error, elapsed)
    assert worker._process is None  # stopped
