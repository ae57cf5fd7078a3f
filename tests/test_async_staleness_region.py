"""The admissible region of the asynchronous trainer's staleness rule (`staleness.least_trained_lag`): a
configuration is accepted at construction exactly when samples can still be fresh enough to train.

Three checks of the one formula (`weight_lag + ceil(num_mini_batches / weight_sync_steps) <= max_staleness`):

* a simulation of the trainer's pulls (`simulate`: Accelerate's one-micro-batch prefetch, `gradient_accumulation_steps`
  micro-batches per step, `num_mini_batches` steps per batch, a weight sync every `weight_sync_steps` steps, the pull
  filter against the version a micro-batch will be trained at, the stale bound) fed by an ideal rollout worker (it
  samples from the newest weights it may use, `weight_lag` behind, in batches, into a FIFO queue of `queue_maxsize`)
  over a grid of 7 knobs: the configurations it can train are exactly those accepted;
* short real runs of `RLLossAsyncGRPOTrainer` with such an ideal worker in-process, on the configurations of the
  grid's edge (each starving one forced past the construction check): accepted ones train every step, refused ones
  stop with `NoTrainableSamplesError`;
* construction: `RLLossAsyncGRPOConfig` and `HFGenerateRolloutWorker` refuse the others, naming the knobs and the
  bound.
"""

from __future__ import annotations

import itertools
import math
import queue
from collections import deque

import pytest
import torch
from _async import ASYNC_ARGS, NoWeightTransfer, fixed_samples, prompts_dataset
from _trainer_utils import make_dataset, reward_length

from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker
from hf_rlloss.trainer.async_.staleness import check_weight_lag, least_trained_lag
from hf_rlloss.trainer.async_grpo_trainer import NoTrainableSamplesError, portable_async_trl

torch.set_num_threads(1)


def simulate(lag, staleness, every, mini, accumulation, depth, batch, empty_steps=2, per_device=1, steps=48) -> bool:
    """Whether the trainer trains `steps` optimizer steps (`False`: it stops on the stale bound), by the event order
    of the real data path, with a worker as fast as can be (the most favourable case: if this one starves, any does).

    The worker samples a batch of `batch` samples from version `max(1, newest received - lag)` whenever its hand is
    empty and the queue has room; the queue holds `depth`. The trainer's `get_batch_samples` takes `accumulation *
    mini` micro-batches of `per_device` samples; the dataloader fills micro-batch `m + 1` when it hands out `m`; a
    sample is dropped at pull when `version trained at - version sampled > staleness`, and `depth + batch +
    empty_steps * per step` drops in a row stop training. The trainer syncs (the worker receives the next version)
    after every `every`-th optimizer step."""
    per_call = accumulation * mini
    limit = depth + batch + empty_steps * per_device * accumulation
    newest, fifo, hand = 1, deque(), []

    def refill():
        while len(fifo) < depth:
            if not hand:
                hand.extend([max(1, newest - lag)] * batch)
            fifo.append(hand.pop())

    def trained_at(m: int) -> int:  # the version of the optimizer step that trains micro-batch m
        step = (m // per_call) * mini + (m % per_call) // accumulation
        return 1 + step // every

    filled, dropped = set(), 0

    def fill(m: int) -> bool:
        nonlocal dropped
        kept = 0
        while kept < per_device:
            refill()
            version = fifo.popleft()
            if trained_at(m) - version > staleness:
                dropped += 1
                if dropped >= limit:
                    return False
                continue
            dropped, kept = 0, kept + 1
        filled.add(m)
        return True

    m = step = 0
    while step < steps:
        for _ in range(per_call):
            if (m not in filled and not fill(m)) or not fill(m + 1):
                return False
            m += 1
        for _ in range(mini):
            step += 1
            newest += step % every == 0
    return True


def _args(**options):
    return RLLossAsyncGRPOConfig(output_dir="unused", **{**ASYNC_ARGS, **options})


GRID = list(
    itertools.product(
        range(4),  # weight_lag
        range(1, 5),  # max_staleness
        range(1, 5),  # weight_sync_steps
        range(1, 5),  # num_mini_batches
        (1, 2, 3),  # gradient_accumulation_steps
        (1, 4, 16),  # queue_maxsize
        (1, 3, 8),  # samples of a worker batch
    )
)


def test_the_admissible_region_is_where_the_simulated_trainer_trains():
    accepted = refused = 0
    for lag, staleness, every, mini, accumulation, depth, batch in GRID:
        admissible = least_trained_lag(lag, every, mini) <= staleness
        trains = simulate(lag, staleness, every, mini, accumulation, depth, batch)
        assert trains == admissible, (lag, staleness, every, mini, accumulation, depth, batch)
        accepted, refused = accepted + admissible, refused + (not admissible)
    assert accepted > 1000 and refused > 1000  # both sides of the boundary are exercised


def test_construction_refuses_exactly_outside_the_region():
    """`check_weight_lag` (the config with `weight_lag` 0, the workers and the trainer) over the knobs the
    construction sees, against the formula; the error names the knobs and the bound."""
    for lag, staleness, every, mini, accumulation in {g[:5] for g in GRID}:
        args = _args(max_staleness=staleness + 8, weight_sync_steps=every, num_mini_batches=mini,
                     gradient_accumulation_steps=accumulation)  # fmt: skip
        args.max_staleness = staleness
        least = lag + math.ceil(mini / every)
        if least <= staleness:
            check_weight_lag(lag, args)
            continue
        with pytest.raises(ValueError) as caught:
            check_weight_lag(lag, args)
        message = str(caught.value)
        for knob in (f"weight_lag={lag}", f"weight_sync_steps={every}", f"num_mini_batches={mini}",
                     f"max_staleness={staleness}", f"= {least} versions", f"max_staleness >= {least}"):  # fmt: skip
            assert knob in message, (knob, message)


# The configurations that trained 0-3 of 6 steps, and their neighbours that train
EDGE = [
    # (weight_lag, max_staleness, weight_sync_steps, num_mini_batches, gradient_accumulation_steps)
    (1, 1, 2, 1, 1),
    (1, 1, 2, 1, 2),
    (0, 1, 1, 2, 1),
    (1, 1, 1, 2, 1),
    (1, 2, 1, 2, 1),
    (0, 1, 2, 1, 1),
    (0, 1, 2, 2, 2),
    (1, 2, 2, 1, 2),
    (1, 3, 1, 2, 1),
]


class IdealWorker:
    """An in-process rollout worker as fast as can be: each sample taken from its queue is drawn at that moment from
    the newest weights it may use (`lag` versions behind the newest the trainer sent, at least the first)."""

    def __init__(self, lag: int):
        self.lag, self.newest = lag, 0
        self.content = fixed_samples(4)
        self.taken = 0
        self.rollout_buffer = self
        self.metrics_queue = queue.Queue()

    def get(self, timeout=None):
        sample = self.content[self.taken % len(self.content)]
        self.taken += 1
        sample.model_version = max(1, self.newest - self.lag)
        return sample

    def qsize(self) -> int:
        return 1

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def update_model_version(self, version: int) -> None:
        self.newest = version

    def check_health(self, stale_after_s: float) -> None: ...


@pytest.mark.parametrize("lag, staleness, every, mini, accumulation", EDGE)
def test_short_real_runs_train_inside_the_region_and_starve_outside(policy, tok, tmp_path, lag, staleness, every,
                                                                    mini, accumulation):  # fmt: skip
    admissible = least_trained_lag(lag, every, mini) <= staleness
    assert simulate(lag, staleness, every, mini, accumulation, depth=4, batch=4, per_device=4) == admissible
    options = dict(max_steps=6, weight_sync_steps=every, num_mini_batches=mini,
                   gradient_accumulation_steps=accumulation, queue_maxsize=4, max_consecutive_empty_steps=2,
                   optim="sgd", learning_rate=1e-3)  # fmt: skip
    if not admissible:
        with pytest.raises(ValueError, match=f"max_staleness={staleness}: a sample is trained at least"):
            worker_args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **{**ASYNC_ARGS, **options,
                                                                              "max_staleness": staleness})  # fmt: skip
            HFGenerateRolloutWorker(policy, make_dataset(), [reward_length], tok, worker_args, weight_lag=lag)
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **{**ASYNC_ARGS, **options, "max_staleness": 8})
    args.max_staleness = staleness  # past the construction check: does it train?
    with portable_async_trl():
        trainer = RLLossAsyncGRPOTrainer(policy, [], args, prompts_dataset(), tok, rollout_worker=IdealWorker(lag),
                                         weight_transfer=NoWeightTransfer())  # fmt: skip
    if admissible:
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss/total" in h]
        assert trainer.state.global_step == 6 and len(logs) == 6
        lags = [log["async/version_lag_max"] for log in logs if "async/version_lag_max" in log]
        assert lags and max(lags) <= staleness
    else:
        with pytest.raises(NoTrainableSamplesError, match="too stale to train"):
            trainer.train()
        assert trainer.state.global_step < 6
