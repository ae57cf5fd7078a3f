"""Offline pieces for the async trainer's tests: a tiny policy saved to disk (TRL's async trainer loads its model from
a path), fixed rollout samples, and an in-process rollout worker and weight transfer that inject them."""

from __future__ import annotations

import math
import queue

import numpy as np
import torch
from _trainer_utils import BASE_ARGS, SPECIALS, make_model, make_tokenizer
from datasets import Dataset
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

# The synchronous tests' base arguments, plus what TRL's async trainer needs here
ASYNC_ARGS = dict(
    BASE_ARGS,
    gradient_accumulation_steps=1,
    dtype="float32",
    token_budget=0,  # fixed count per micro-batch: no vLLM server to ask for max_model_len
    max_staleness=100,
)


def save_tiny_policy(path, seed: int = 0) -> str:
    """A tiny random Qwen2 and its byte tokenizer, saved under `path`; returns the path as a string."""
    tok = make_tokenizer()
    make_model(tok, seed=seed).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def fixed_samples(n_groups: int, group_size: int = 4, max_len: int = 8, seed: int = 0, version: int = 0):
    """`n_groups × group_size` rollout samples: a shared prompt per group, random completions, sampler log-probs near
    the tiny model's (about log 1/259), group-normalized advantages from a length reward, all tagged `version`."""
    tok = make_tokenizer()
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group in range(n_groups):
        prompt = torch.randint(len(SPECIALS), len(tok), (5 + group % 3,), generator=g).tolist()
        completions = [
            torch.randint(len(SPECIALS), len(tok), (int(torch.randint(2, max_len + 1, (1,), generator=g)),),
                          generator=g).tolist()
            for _ in range(group_size)
        ]  # fmt: skip
        rewards = np.array([len(c) / max_len for c in completions])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
        for j, completion in enumerate(completions):
            ids = prompt + completion
            logps = [0.0] * len(prompt) + [-5.56 + 0.25 * math.sin(t + 3 * j) for t in range(len(completion))]
            samples.append(
                RolloutSample(
                    prompt=[], completion=[], input_ids=np.asarray(ids, dtype=np.int64),
                    completion_mask=np.asarray([0] * len(prompt) + [1] * len(completion), dtype=np.int64),
                    old_log_probs=np.asarray(logps, dtype=np.float32), advantage=float(advantages[j]),
                    model_version=version, group_id=group, metrics={"reward": float(rewards[j])},
                )
            )  # fmt: skip
    return samples


class FixedRolloutWorker:
    """`RolloutWorkerProtocol` in-process: queues fixed samples on `start` (each sample's `model_version` as given)."""

    def __init__(self, samples):
        self.samples = samples
        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()
        self.versions: list[int] = []

    def start(self) -> None:
        for sample in self.samples:
            self.rollout_buffer.put_nowait(sample)

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        raise RuntimeError("FixedRolloutWorker: out of samples")


class NoWeightTransfer:
    """`WeightTransferProtocol` that sends nothing (the fixed samples do not depend on the policy)."""

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...

    def send_weights(self, iterator) -> None:
        for _ in iterator:
            pass

    def resume(self) -> None: ...

    def destroy(self) -> None: ...


def prompts_dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [f"p{i}" for i in range(n)]})


# The loss of the synchronous/asynchronous parity tests: decoupled objective, token-level rollout IS truncated close to
# 1 (so that it acts), k3 KL to the reference.
PARITY_RL_LOSS = {
    "policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
    "loss_agg_mode": "token-mean",
    "use_kl_loss": True,
    "kl_loss_type": "k3",
    "kl_loss_coef": 0.05,
    "rollout_is": {"level": "token", "mode": "truncate", "upper": 1.02},
}

# The loss of the multi-process parity test: decoupled objective, token-level rollout IS, k3 KL to the reference.
DIST_RL_LOSS = {
    "policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
    "use_kl_loss": True,
    "kl_loss_type": "k3",
    "kl_loss_coef": 0.05,
    "rollout_is": {"level": "token", "mode": "truncate", "upper": 1.5},
}


def shared_locks(*objects) -> list:
    """The shared (inter-process) locks `objects` expose, and those of their attributes: a synchronized `Value`'s
    (`get_lock`), an `Event`'s (its condition's), a `Lock` or `RLock` itself. (Semaphores are not held by a process:
    skipped.) What a worker may hold at the instant it is killed while it uses these objects."""
    from multiprocessing import synchronize

    found = []
    for obj in objects:
        for value in [obj, *getattr(obj, "__dict__", {}).values()]:
            if hasattr(value, "get_lock"):
                found.append(value.get_lock())
            elif isinstance(value, synchronize.Event):
                found.append(value._cond)
            elif isinstance(value, (synchronize.Lock, synchronize.RLock)):
                found.append(value)
    return found


def die_holding_locks(*objects, before=None) -> None:
    """In a rollout worker's process: run `before` (its work so far), take every shared lock of `objects`
    (`shared_locks`), then SIGKILL the process: a worker killed inside each of their critical sections."""
    import os
    import signal

    if before is not None:
        before()
    for lock in shared_locks(*objects):
        lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)
