"""Asynchronous GRPO without vLLM or NCCL: a rollout worker that generates with HF `generate` in its own process,
and a weight transfer through a `torch.multiprocessing` queue (shared memory).

`HFGenerateRolloutWorker` implements TRL's `RolloutWorkerProtocol`: a spawned process holds its own copy of the
policy, cycles over the prompts, samples `num_generations` completions per prompt, records each sampled token's
log-prob as the synchronous trainer's recorder does (`rollout_recording.SampledTokenLogprobs`: the same support under
top-k/top-p/min-p), scores the completions with the reward functions, computes the group advantage as TRL's vLLM
worker does, and puts TRL `RolloutSample`s tagged with the policy version they were sampled from on its queue.
`QueueWeightTransfer` implements `WeightTransferProtocol`: `send_weights` puts the trainer's parameters on a queue the
worker drains between two `generate` calls (it loads them then, so a batch is never sampled from two policies).

Health: the worker ticks a heartbeat after every batch (and while it waits on a full queue); `check_health` raises,
naming the cause, when the process died, raised (its traceback is chained), or has not ticked for `stale_after_s`
seconds; TRL's trainer calls it whenever its queue stays empty for 5 s. Samples come through a `SampleChannel`
(`async_/channel.py`), whose reads time out and see the worker's death even in the middle of a message, and the
weights through `LatestWeights` (only the newest kept). The worker exits within a second when the trainer's process
dies (it polls its parent's PID), so neither side can hang on, or outlive, the other.

Reproducibility: each batch is sampled under a seed derived from `(args.seed, index of its first prompt)`
(`batch_seed`), so the samples of a batch do not depend on what the process generated before it. With `fixed_lag`
the policy version each batch is sampled from is a function of the batch's index (`version_for_group`), not of
timing; a run is then repeatable, and resumable bit-exactly from a checkpoint (`async_/resume.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import queue
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from transformers.utils import logging
from trl.experimental.async_grpo import AsyncGRPOConfig
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ..common.rollout_recording import SampledTokenLogprobs, recording_logprobs
from ..common.routing_replay import RoutingReplay, generation_routes
from ..common.shared_prefill import sharing_prompts
from .channel import LatestWeights, SampleChannel, SharedFlag
from .multiturn import AgentSpec, BudgetCutError, Episode, MultiTurnRollouts, NonFiniteRewardError, prepare_tokenizer
from .routing import sample_routes
from .staleness import check_weight_lag, least_trained_lag

logger = logging.get_logger(__name__)

__all__ = [
    "HFGenerateRolloutWorker",
    "NoRolloutSamplesError",
    "QueueWeightTransfer",
    "RolloutWorkerDiedError",
    "VLLM_ONLY_OPTIONS",
    "batch_seed",
    "check_weight_lag",
    "group_advantages",
    "least_trained_lag",
]


class RolloutWorkerDiedError(RuntimeError):
    """The rollout process exited (killed, crashed) or raised; the message names it, its exit code or traceback."""


class NoRolloutSamplesError(RuntimeError):
    """The rollout worker makes no trainable sample: every prompt group of `max_dropped_groups` in a row was dropped
    by `on_rollout_error="drop"` (the message counts them by kind)."""


# AsyncGRPOConfig options that configure TRL's vLLM worker and mean nothing to HF `generate` in a process of its own
VLLM_ONLY_OPTIONS = (
    "vllm_server_base_url",
    "vllm_server_timeout",
    "request_timeout",
    "max_inflight_tasks",
)


def _default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(AsyncGRPOConfig) if f.name == name)


def _nanstd(values: np.ndarray) -> float:
    """TRL's `nanstd`: the unbiased standard deviation of the finite values (0 with fewer than two)."""
    values = values[~np.isnan(values)]
    return float(values.std(ddof=1)) if values.size > 1 else 0.0


def group_advantages(rewards: np.ndarray, scale_rewards: str = "group", batch_std: float | None = None):
    """`(G,)` advantages of one group's summed rewards as TRL's `GRPOTrainer` computes them: `r − mean`, divided by
    `std + 1e-4` (TRL's unbiased std: the group's under `"group"`, `batch_std` under `"batch"`; not divided under
    `"none"`), over the scorable completions; 0 for a completion every reward function skipped (NaN). Also the
    group's reward mean and std (NaN when nothing was scorable)."""
    scored = ~np.isnan(rewards)
    advantages = np.zeros_like(rewards)
    if not scored.any():
        return advantages, float("nan"), float("nan")
    values = rewards[scored]
    std = _nanstd(values)
    advantages[scored] = values - values.mean()
    if scale_rewards != "none":
        advantages[scored] /= (std if scale_rewards == "group" else batch_std) + 1e-4
    return advantages, float(values.mean()), std


def batch_seed(seed: int, first_group: int) -> int:
    """The sampling seed of the batch whose first prompt is the `first_group`-th served (counted from the start of
    training, over epochs): a function of the two alone, so a resumed worker samples a batch as an uninterrupted one
    did, whatever it generated before. (The worker's RNG state itself is not saved: it is re-seeded per batch.)"""
    return int(np.random.SeedSequence([int(seed), int(first_group)]).generate_state(1)[0])


def version_for_batch(batch: int, fixed_lag: int, weight_sync_steps: int) -> int:
    """Under `fixed_lag`, the policy version batch `batch` (0-based, one optimizer step's samples) is sampled from:
    the version of the policy after optimizer step `batch − fixed_lag` (the cold sync's, version 1, for the first
    ones). TRL bumps the version after every `weight_sync_steps`-th step."""
    return 1 + max(0, batch - fixed_lag) // weight_sync_steps


@dataclasses.dataclass
class _Settings:
    """What the worker process needs (picklable)."""

    model_path: str
    prompts: list[dict[str, Any]]
    reward_funcs: list[Callable]
    reward_names: list[str]
    tokenizer: Any
    num_generations: int
    groups_per_batch: int
    generation_kwargs: dict[str, Any]
    support: str
    record_logprobs: bool
    shared_prompt_generation: bool
    weight_lag: int
    threads: int
    dtype: str
    chat_template_kwargs: dict[str, Any]
    routing_replay: str = "off"  # "rollout": record the routers during generate, ship the routes with the samples
    parent_pid: int = 0  # the trainer's process: the worker exits when it is gone
    seed: int = 0  # `batch_seed`'s
    fixed_lag: int | None = None
    weight_sync_steps: int = 1
    start_group: int = 0  # the first prompt served, counted over epochs (a resumed run's position)
    resume_weights: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (version, safetensors file)
    agent: AgentSpec | None = None  # tools / environments: multi-turn rollouts (`async_/multiturn.py`)
    max_completion_length: int = 0
    max_model_len: int = 0
    scale_rewards: str = "group"  # TRL's meanings (`group_advantages`)
    max_dropped_groups: int = 0  # consecutive groups dropped by `on_rollout_error="drop"` before the worker stops


class HFGenerateRolloutWorker:
    """TRL `RolloutWorkerProtocol` with HF `generate` in a spawned process holding its own copy of the policy.

    Args:
        model (`str`): the policy's path (the worker loads its own copy; the trainer's weights arrive through
            `QueueWeightTransfer`, the first before generation starts).
        dataset (`datasets.Dataset` or `list[dict]`): rows with a `prompt` (text or chat messages); the other columns
            go to the reward functions as keywords, as in TRL.
        reward_funcs (`list[Callable]`): TRL reward functions (picklable: module-level functions), summed.
        processing_class (`PreTrainedTokenizerBase`): the tokenizer.
        args (`AsyncGRPOConfig`): sampling (`num_generations`, `max_completion_length`, `temperature`, `top_p`,
            `top_k`, `min_p`, `repetition_penalty`), `queue_maxsize`, `rollout_logprobs_support` (when present) and
            `dtype`. The vLLM worker's options (`VLLM_ONLY_OPTIONS`) must be left at their defaults.
        record_logprobs (`bool`, *optional*, defaults to `True`): record the sampled tokens' log-probs (rollout IS
            and the mismatch metrics need them); `False` sends NaN.
        shared_prompt_generation (`bool`, *optional*, defaults to `True`): prefill each prompt once for its
            `num_generations` rows (`shared_prefill.sharing_prompts`); `False` prefills every row. Under
            `args.routing_replay="rollout"` every row is prefilled (the routes are recorded row by row), and each
            sample carries its tokens' MoE routes (`routed_experts`, `async_/routing.py`).
        groups_per_batch (`int`, *optional*): prompts per `generate` call; defaults to one optimizer step's worth.
        weight_lag (`int`, *optional*, defaults to `0`): apply the trainer's weights this many versions late (an
            experiment's knob: samples then lag the trainer by at least `weight_lag` versions). A value under which
            samples can only be too stale when trained is refused (`check_weight_lag`: `weight_lag +
            ceil(num_mini_batches / weight_sync_steps) <= max_staleness`, `least_trained_lag`).
        fixed_lag (`int`, *optional*): sample batch `b` (one optimizer step's samples) from exactly the policy after
            optimizer step `b − fixed_lag` (`version_for_batch`), waiting for it if needed; the trainer's weight sync
            waits until the worker has copied the previous version, so none is skipped. Which policy samples which
            batch then does not depend on timing: a run is repeatable and resumes from a checkpoint bit-exactly.
            At least 1 (the trainer's dataloader fetches the next step's first micro-batch before it steps) and at
            least `num_mini_batches`; needs `max_staleness >= ceil(fixed_lag / weight_sync_steps)` and one batch
            per optimizer step. Unset (the default), the worker samples from the newest weights it has.
        threads (`int`, *optional*, defaults to `1`): torch threads of the worker process.
        ready_timeout (`float`, *optional*, defaults to `600`): seconds `start` waits for the process to load.
        tools (`list[Callable]`, *optional*): TRL tools; the worker runs TRL's tool-calling loop
            (`args.max_tool_calling_iterations` turns at most), multi-turn samples with the replies masked
            (`async_/multiturn.py`). Module-level functions (they are pickled to the process).
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*): TRL's environments (`reset`, public
            methods as tools, optional `get_reward`); the reward functions also receive `environments=`.
        tool_timeout_s (`float`, *optional*, defaults to `60`): how long one tool call may run
            (`multiturn.ToolTimeoutError`).
        on_rollout_error (`str`, *optional*, defaults to `"feed_back"`): what a multi-turn sample that met a
            `multiturn.RolloutError` becomes: `"feed_back"` (TRL's behaviour: the error is the tool's reply),
            `"drop"` (its group is dropped) or `"raise"`; every case is counted in `rollout/errors/*` metrics.
        on_budget_cut (`str`, *optional*, defaults to `"keep"`): a turn cut by the completion budget in the middle of
            a tool call (`multiturn.BudgetCutError`, counted): `"keep"` (trained as a truncated completion) or
            `"rollout_error"` (follows `on_rollout_error`).
        tool_processes (`int`, *optional*, defaults to `4`): processes the tools run in, side by side; a call that
            does not return within `tool_timeout_s` is stopped with its process (`async_/tool_calls.py`). `0`: the
            tools run in threads of the rollout process.
        max_hung_tool_threads (`int`, *optional*, defaults to `16`): tool calls run in threads (an environment's
            methods, tools under `tool_processes=0` or defined in the main script) that timed out and still run,
            beyond which the worker stops with `HungToolCallsError`.
    """

    def __init__(
        self,
        model: str,
        dataset: Any,
        reward_funcs: list[Callable],
        processing_class: Any,
        args: AsyncGRPOConfig,
        *,
        record_logprobs: bool = True,
        shared_prompt_generation: bool = True,
        groups_per_batch: int | None = None,
        weight_lag: int = 0,
        fixed_lag: int | None = None,
        threads: int = 1,
        ready_timeout: float = 600.0,
        tools: Sequence[Callable] | None = None,
        environment_factory: Any = None,
        tool_timeout_s: float = 60.0,
        on_rollout_error: str = "feed_back",
        on_budget_cut: str = "keep",
        tool_processes: int = 4,
        max_hung_tool_threads: int = 16,
    ):
        for name in VLLM_ONLY_OPTIONS:
            if getattr(args, name) != _default(name):
                raise ValueError(
                    f"{name}={getattr(args, name)!r} configures TRL's vLLM rollout worker; HFGenerateRolloutWorker "
                    f"generates with HF generate in its own process and does not use it: leave {name} at its "
                    f"default ({_default(name)!r})"
                )
        check_weight_lag(weight_lag, args)
        if fixed_lag is not None:
            _check_fixed_lag(fixed_lag, weight_lag, args)
        if not isinstance(model, str):
            raise TypeError("HFGenerateRolloutWorker loads its own copy of the policy: pass the model's path")
        samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        agent = AgentSpec(list(tools or []), environment_factory, args.max_tool_calling_iterations, tool_timeout_s,
                          on_rollout_error, on_budget_cut, tool_processes, max_hung_tool_threads)  # fmt: skip
        if not agent.enabled and args.max_tool_calling_iterations is not None:
            raise ValueError(
                f"max_tool_calling_iterations={args.max_tool_calling_iterations} without tools or "
                "environment_factory: pass them to the rollout worker (HFGenerateRolloutWorker(..., tools=[...]))"
            )
        rows = [dict(row) for row in dataset]
        if not rows or ("prompt" not in rows[0] and agent.environment_factory is None):
            raise ValueError("HFGenerateRolloutWorker needs a dataset with a 'prompt' column")
        funcs = list(reward_funcs or [])
        for k, func in enumerate(funcs):  # sent to the process: refused here, by name, rather than at `start`
            try:
                pickle.dumps(func)
            except Exception as error:
                name = getattr(func, "__qualname__", repr(func))
                raise TypeError(
                    f"reward_funcs[{k}] ({name}) is sent to the rollout process and must be picklable (a module-level "
                    f"function or class, not a lambda or a closure): {type(error).__name__}: {error}"
                ) from error
        scale_rewards = {True: "group", False: "none"}.get(getattr(args, "scale_rewards", "group"), None)
        scale_rewards = scale_rewards or getattr(args, "scale_rewards", "group")
        if scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"scale_rewards={scale_rewards!r}: allowed values are ('group', 'batch', 'none')")
        self.records_logprobs = record_logprobs
        routing_replay = getattr(args, "routing_replay", "off")
        self.records_routes = routing_replay == "rollout"  # read by RLLossAsyncGRPOTrainer
        if self.records_routes and shared_prompt_generation:
            logger.warning(
                "HFGenerateRolloutWorker: shared_prompt_generation is set aside: routing_replay='rollout' records the "
                "routers during generate row by row, and a prompt prefilled once would give its completions one row"
            )
        max_model_len = 0
        if agent.enabled:
            from transformers import AutoConfig

            if routing_replay == "rollout":
                raise ValueError(
                    "routing_replay='rollout' with tools/environment_factory: the routes of a conversation's turns "
                    "are not stitched into one sample; use routing_replay='old_policy'"
                )
            processing_class = prepare_tokenizer(processing_class)
            max_model_len = AutoConfig.from_pretrained(model).get_text_config().max_position_embeddings
            MultiTurnRollouts(agent, processing_class, dict(args.chat_template_kwargs or {}),
                              args.max_completion_length, max_model_len)  # fmt: skip  # refuses bad input here
        self._settings = _Settings(
            model_path=model,
            prompts=rows,
            reward_funcs=funcs,
            reward_names=[getattr(f, "__name__", type(f).__name__) for f in funcs],
            tokenizer=processing_class,
            num_generations=args.num_generations,
            groups_per_batch=groups_per_batch or max(1, samples_per_step // args.num_generations),
            generation_kwargs=dict(
                do_sample=True,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k or None,
                min_p=args.min_p,
                repetition_penalty=args.repetition_penalty,
                max_new_tokens=args.max_completion_length,
            ),
            support=getattr(args, "rollout_logprobs_support", "full"),
            record_logprobs=record_logprobs,
            shared_prompt_generation=shared_prompt_generation,
            weight_lag=weight_lag,
            threads=threads,
            dtype=args.dtype,
            chat_template_kwargs=dict(args.chat_template_kwargs or {}),
            seed=args.seed,
            fixed_lag=fixed_lag,
            weight_sync_steps=args.weight_sync_steps,
            routing_replay=routing_replay,
            agent=agent if agent.enabled else None,
            max_completion_length=args.max_completion_length,
            max_model_len=max_model_len,
            scale_rewards=scale_rewards,
            max_dropped_groups=getattr(args, "max_consecutive_empty_steps", 8)
            * max(1, samples_per_step // args.num_generations),
        )
        self.agent = self._settings.agent  # read by RLLossAsyncGRPOTrainer
        self.fixed_lag = fixed_lag
        self.weight_lag = weight_lag  # read by RLLossAsyncGRPOTrainer (check_weight_lag with its own arguments)
        ctx = mp.get_context("spawn")
        self._ctx = ctx
        self.rollout_buffer = SampleChannel(ctx, maxsize=args.queue_maxsize)
        self.rollout_buffer.health = lambda: self._raise_if_dead()
        self.metrics_queue = ctx.Queue(maxsize=4096)
        self.weights = LatestWeights(ctx)
        # Shared with the process without a lock (see async_/channel.py): each written by one side only, so a worker
        # killed anywhere leaves nothing the trainer waits on (an Event or a synchronized Value would: their shared
        # lock is taken on every read and write)
        self._model_version = ctx.Value("q", 0, lock=False)
        self._stop = SharedFlag(ctx)
        self._ready = SharedFlag(ctx)
        self._failed = SharedFlag(ctx)
        self._errors = ctx.Queue(maxsize=1)
        self._heartbeat = ctx.Value("d", 0.0, lock=False)
        self._ready_timeout = ready_timeout
        self._process = None

    @property
    def model_version(self) -> int:
        return int(self._model_version.value)

    def update_model_version(self, model_version: int) -> None:
        self._model_version.value = int(model_version)

    @property
    def groups_per_batch(self) -> int:
        return self._settings.groups_per_batch

    @property
    def samples_per_batch(self) -> int:
        """The samples of one `generate` batch, all sampled from one policy version (read by the trainer's stale
        bound)."""
        return self._settings.groups_per_batch * self._settings.num_generations

    @property
    def start_group(self) -> int:
        """The first prompt this worker serves, counted from the start of training over epochs (0, or a resumed
        run's position); the `group_id` of its samples counts from there (TRL's convention)."""
        return self._settings.start_group

    def version_for_group(self, group: int) -> int:
        """Under `fixed_lag`: the policy version the batch holding the `group`-th prompt (counted as `start_group`)
        is sampled from."""
        if self.fixed_lag is None:
            raise ValueError("version_for_group: the worker has no fixed_lag (it samples from the newest weights)")
        s = self._settings
        return version_for_batch(group // s.groups_per_batch, self.fixed_lag, s.weight_sync_steps)

    def restore(self, start_group: int, weights: Sequence[tuple[int, str]] = ()) -> None:
        """Resume at the `start_group`-th prompt (counted over epochs), before `start`. `weights`: `(version,
        safetensors file)` of the policy versions the batches from there are sampled from under `fixed_lag` (older
        than the trainer's checkpoint): the worker loads them at start, before any weights of the trainer."""
        if self._process is not None:
            raise RuntimeError("HFGenerateRolloutWorker.restore must be called before start")
        if start_group < 0:
            raise ValueError(f"start_group={start_group} must be >= 0")
        if weights and self.fixed_lag is None:
            raise ValueError("restored rollout weights need fixed_lag (without it the worker samples the newest)")
        self._settings.start_group = int(start_group)
        self._settings.resume_weights = sorted((int(v), str(path)) for v, path in weights)

    def start(self) -> None:
        if self._process is not None:
            return
        self._heartbeat.value = time.time()
        self._settings.parent_pid = os.getpid()
        process = _ProcessDyingWithParent(
            target=_worker_main,
            args=(self._settings, self.rollout_buffer, self.metrics_queue, self.weights, self._stop,
                  self._ready, self._failed, self._errors, self._heartbeat),
            name="hf-generate-rollout-worker",
            daemon=True,
        )  # fmt: skip
        process.start()  # raises (a pickling error, ...) before anything is left to join or stop
        self._process = process
        self.rollout_buffer.close_writer()  # the worker holds the write end now: its death is an end of file here
        deadline = time.monotonic() + self._ready_timeout
        while not self._ready.wait(timeout=0.5):
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise RuntimeError(f"HFGenerateRolloutWorker did not load its policy within {self._ready_timeout}s")

    def _raise_if_dead(self) -> None:
        if self._failed.is_set():
            try:
                cause = RuntimeError(self._errors.get(timeout=5.0))  # put before the event was set
            except queue.Empty:
                cause = None
            raise RolloutWorkerDiedError(
                "HFGenerateRolloutWorker: the rollout process failed (its traceback is chained)"
            ) from cause
        if self._process is not None and not self._process.is_alive():
            raise RolloutWorkerDiedError(
                f"HFGenerateRolloutWorker: the rollout process exited (exit code {self._process.exitcode}) while the "
                "trainer waits for samples"
            )

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the process died, raised, or has not produced (heartbeat) for `stale_after_s` seconds."""
        self._raise_if_dead()
        age = time.time() - self._heartbeat.value
        if age > stale_after_s:
            raise RuntimeError(
                f"HFGenerateRolloutWorker: no progress for {age:.0f}s > heartbeat_stale_after_s={stale_after_s:.0f}s; "
                "the rollout process is stalled"
            )

    def stop(self) -> None:
        if self._process is None:
            return
        self._stop.set()
        self._process.join(timeout=15)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        self._process = None


class QueueWeightTransfer:
    """TRL `WeightTransferProtocol` without NCCL: the trainer's parameters go to `HFGenerateRolloutWorker` through a
    `torch.multiprocessing` queue (tensors in shared memory), tagged with the version they will be.

    Under the worker's `fixed_lag` it also keeps a copy of the last versions that batches not trained yet can still
    be sampled from (`history`, `ceil(fixed_lag / weight_sync_steps) + 1` of them): a checkpoint saves them, since
    the resumed worker samples those batches from them (`async_/resume.py`). Each send then waits until the worker
    has copied the previous version.

    Args:
        worker (`HFGenerateRolloutWorker`): the worker whose policy copy receives the weights.
        timeout_s (`float`, *optional*, defaults to `600`): how long `send_weights` may wait for the queue.
    """

    def __init__(self, worker: HFGenerateRolloutWorker, timeout_s: float = 600.0):
        self.worker = worker
        self.timeout_s = timeout_s
        self.history: dict[int, dict[str, torch.Tensor]] = {}  # version -> CPU copy (under fixed_lag only)
        lag = worker.fixed_lag
        self._keep = 0 if lag is None else -(-lag // worker._settings.weight_sync_steps) + 1

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...  # the worker swaps weights between two generate calls: nothing to pause

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        # TRL bumps the version right after this transfer: these weights are the policy of the next version
        health = self.worker._raise_if_dead if self.worker._process is not None else lambda: None
        version = self.worker.model_version + 1
        if self._keep:
            state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in iterator}
            self.keep(version, state)
            iterator = iter(state.items())
        self.worker.weights.publish(version, iterator, health=health, wait_read=self._keep > 0)

    def keep(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Keep `state` as `version` in `history`, dropping the versions no batch can be sampled from any more."""
        self.history[version] = state
        for old in sorted(self.history)[: -self._keep]:
            del self.history[old]

    def resume(self) -> None: ...

    def destroy(self) -> None: ...


# ------------------------------------------------------------------------------------------------------------------
# The worker process


# Run first in the spawned interpreter, before it unpickles (and so imports) anything: the OS is asked to SIGKILL the
# process when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`), and a parent already gone ends it at once. Without
# it a trainer killed while its worker imports torch, transformers and TRL (seconds) would leave the worker running
# until `_exit_with_parent`'s watch starts.
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


class _ProcessDyingWithParent(mp.get_context("spawn").Process):
    """A spawned process that dies with its parent from its first instruction (`_DIE_WITH_PARENT`; Linux). The OS
    signals it when the *thread* that started it exits: start it from the trainer's main thread (TRL does)."""

    @staticmethod
    def _Popen(process_obj):
        if not sys.platform.startswith("linux") or getattr(sys, "frozen", False):
            return mp.get_context("spawn").Process._Popen(process_obj)
        return _popen_dying_with_parent()(process_obj)


def _exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Leave the process as soon as the trainer that started it is gone (re-parented: `getppid` changes)."""
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    os._exit(3)


def _worker_main(settings, rollout_buffer, metrics_queue, weights, stop, ready, failed, errors, heartbeat):
    if settings.parent_pid:
        threading.Thread(target=_exit_with_parent, args=(settings.parent_pid,), daemon=True).start()
    try:
        loop = getattr(settings, "loop_class", _WorkerLoop)  # vllm_rollout.VLLMRolloutWorker sets its own
        loop(settings, rollout_buffer, metrics_queue, weights, stop, heartbeat).run(ready)
    except BaseException:  # report, then leave: the trainer's health check raises with this traceback
        try:  # the tail of the traceback, short enough for one atomic pipe write
            errors.put_nowait(traceback.format_exc()[-2000:])
        except queue.Full:
            pass
        failed.set()


class _WorkerLoop:
    def __init__(self, settings: _Settings, rollout_buffer, metrics_queue, weights, stop, heartbeat):
        self.s = settings
        self.rollout_buffer, self.metrics_queue, self.weights = rollout_buffer, metrics_queue, weights
        self.stop, self.heartbeat = stop, heartbeat
        self.pending: deque[tuple[int, dict[str, torch.Tensor]]] = deque()  # received, not yet applied (weight_lag)
        self.received = 0  # the newest version read from `weights`
        self.version = 0  # the version of the weights the worker samples from (0: not synced yet)
        self.next_prompt = settings.start_group  # counted over epochs
        self.next_group = 0  # the samples' group_id, from the start position on (TRL's convention)
        self.dropped: dict[str, int] = {}  # groups dropped in a row, by kind (`on_rollout_error="drop"`)

    def tick(self) -> None:
        """Progress: a batch put samples, a tool call ended (`MultiTurnRollouts`' tick), or the worker waits on the
        trainer."""
        if self.heartbeat is not None:
            self.heartbeat.value = time.time()

    def load(self) -> None:
        """Load the worker's own copy of the policy (float32 unless `dtype` says otherwise, SDPA attention)."""
        from transformers import AutoModelForCausalLM

        dtype = {"auto": "auto"}.get(self.s.dtype, getattr(torch, self.s.dtype))
        self.model = AutoModelForCausalLM.from_pretrained(self.s.model_path, dtype=dtype, attn_implementation="sdpa")
        self.model.eval()
        self.routing = RoutingReplay().attach(self.model) if self.s.routing_replay == "rollout" else None
        self.eos_ids = [self.s.tokenizer.eos_token_id, *_as_list(self.model.generation_config.eos_token_id)]
        self.load_multiturn()

    def load_multiturn(self) -> None:
        s = self.s
        self.multiturn = None
        if s.agent is not None:
            self.multiturn = MultiTurnRollouts(s.agent, s.tokenizer, s.chat_template_kwargs, s.max_completion_length,
                                               s.max_model_len, tick=self.tick)  # fmt: skip

    def load_resume_weights(self) -> None:
        """A resumed run's policy versions (`restore`): kept as if received, before any weights of the trainer."""
        from safetensors.torch import load_file

        for version, path in self.s.resume_weights:
            self.pending.append((version, load_file(path)))
            self.received = version

    def run(self, ready) -> None:
        torch.set_num_threads(self.s.threads)
        self.load()
        self.load_resume_weights()
        ready.set()
        while not self.stop.is_set():
            if not self._weights_for_next_batch():
                continue
            samples = self._generate_batch()
            for sample in samples:
                self._put(sample)
            if samples:  # an empty or all-dropped batch is no progress: it does not tick the heartbeat
                self.tick()

    def _weights_for_next_batch(self) -> bool:
        """Load the weights the next batch is sampled from; False when they have not arrived yet (after waiting up
        to half a second). Without `fixed_lag`: the newest (`weight_lag` versions late); with it, the version of the
        batch (`version_for_batch`), never a newer one."""
        if self.s.fixed_lag is None:
            self._apply_weights(block=self.version == 0)
            return self.version != 0
        batch = self.next_prompt // self.s.groups_per_batch
        needed = version_for_batch(batch, self.s.fixed_lag, self.s.weight_sync_steps)
        self._read_weights(block=self.received < needed)
        if 0 < self.weights.version < self.received:  # it would wait for ever for `needed`
            raise RuntimeError(
                f"the trainer sent policy version {self.weights.version}, older than version {self.received} the "
                "worker has: the trainer's version counter does not continue the worker's (a resume that did not "
                "restore model_version?)"
            )
        if self.received < needed:
            return False
        while self.pending and self.pending[0][0] < needed:
            self.pending.popleft()  # no later batch is sampled from it
        if not self.pending or self.pending[0][0] != needed:
            raise RuntimeError(f"policy version {needed} of batch {batch} was never received (fixed_lag)")
        if self.version != needed:
            self._load(*self.pending[0])
        return True

    def _load(self, version: int, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected:
            raise RuntimeError(f"weights the rollout policy does not have: {unexpected[:5]}")
        self.version = version

    def _read_weights(self, block: bool) -> None:
        """Copy the newest weights into `pending` when newer than the last read (waiting up to half a second for
        them when `block`)."""
        deadline = time.monotonic() + (0.5 if block else 0.0)
        while True:
            version = self.weights.read_newer(self.received, self._receive)
            if version is not None:
                self.pending[-1] = (version, self.pending[-1][1])
                self.received = version
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if block:  # waiting on the trainer's weights is not a stall
            self.tick()

    def _apply_weights(self, block: bool) -> None:
        """Read the newest weights (a copy of them when `weight_lag` keeps several); load the ones `weight_lag`
        versions behind the newest (the first at once: nothing older exists, and waiting for later ones would wait on
        the trainer, which waits on samples). Versions the trainer overwrote before they were read are skipped."""
        self._read_weights(block)
        newest = self.pending[-1][0] if self.pending else self.version
        while len(self.pending) > 1 and self.pending[1][0] <= newest - self.s.weight_lag:
            self.pending.popleft()  # a newer version is also old enough: this one is never applied
        while self.pending and (self.pending[0][0] <= newest - self.s.weight_lag or self.version == 0):
            self._load(*self.pending.popleft())

    def _receive(self, shared: dict[str, torch.Tensor]) -> None:
        """Keep a copy of the newest weights (called under the weights' lock, which the trainer's next write waits
        on); its version is filled in by `_apply_weights`."""
        self.pending.append((0, {name: tensor.clone() for name, tensor in shared.items()}))

    def _put(self, sample: RolloutSample) -> None:
        sample.enqueued_at = time.time()
        while not self.stop.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=0.5)
                return
            except queue.Full:
                self.tick()  # waiting on the trainer is not a stall
                if self.s.fixed_lag is None:
                    self._apply_weights(block=False)
                else:
                    self._read_weights(block=False)  # the trainer's next send waits for this copy

    def _next_prompts(self) -> tuple[list[dict], list[str], Any]:
        """The next `groups_per_batch` prompt rows, their texts, and the texts tokenized with each repeated
        `num_generations` times, left padded: the layout `_score_group` reads the prompt ids from."""
        s, tok = self.s, self.s.tokenizer
        rows = [s.prompts[(self.next_prompt + i) % len(s.prompts)] for i in range(s.groups_per_batch)]
        self.next_prompt += len(rows)
        texts = [_prompt_text(tok, row["prompt"], s.chat_template_kwargs) for row in rows]
        encoded = tok([t for t in texts for _ in range(s.num_generations)], return_tensors="pt", padding=True,
                      padding_side="left", add_special_tokens=False)  # fmt: skip
        return rows, texts, encoded

    @torch.no_grad()
    def _generate_batch(self) -> list[RolloutSample]:
        if self.multiturn is not None:
            return self._generate_multiturn_batch()
        s, tok = self.s, self.s.tokenizer
        seed = batch_seed(s.seed, self.next_prompt)
        rows, _, encoded = self._next_prompts()
        version = self.version
        recorder = SampledTokenLogprobs()
        routing = contextlib.nullcontext([]) if self.routing is None else self.routing.recording()
        share = s.shared_prompt_generation and self.routing is None  # routes are recorded row by row
        with (
            torch.random.fork_rng(devices=[]),
            recording_logprobs(self.model, recorder),
            sharing_prompts(self.model, share),
            routing as records,
        ):
            torch.manual_seed(seed)
            out = self.model.generate(
                **encoded, **s.generation_kwargs, eos_token_id=self.eos_ids, pad_token_id=tok.pad_token_id
            )
        prompt_len = encoded["input_ids"].shape[1]
        completions = [_cut_at_eos(ids, self.eos_ids) for ids in out[:, prompt_len:].tolist()]
        recorded = recorder.per_completion(completions, s.support) if s.record_logprobs else None
        samples = self._score_groups(rows, encoded, completions, recorded, version)
        if self.routing is not None:  # MoE routing replay: each sample's (p + c, L, k) routes
            routes = generation_routes(records, encoded["attention_mask"], [len(c) for c in completions])
            samples = [sample_routes(*parts) for parts in zip(samples, *routes, strict=True)]
        return samples

    def _score_groups(self, rows, encoded, completions, recorded, version) -> list[RolloutSample]:
        """Single-turn: each prompt's `num_generations` completions (consecutive in `completions`) scored as one
        group."""
        s, tok = self.s, self.s.tokenizer
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        episodes = []
        for i, completion in enumerate(completions):
            row = rows[i // s.num_generations]
            prompt = encoded["input_ids"][i][encoded["attention_mask"][i].bool()].tolist()
            logps = recorded[0][i] if recorded is not None else [math.nan] * len(completion)
            shown = [{"role": "assistant", "content": texts[i]}] if isinstance(row["prompt"], list) else texts[i]
            episodes.append(Episode(row["prompt"], prompt, completion, [1] * len(completion), list(logps), shown))
        return self._score_episodes(rows, episodes, version)

    def _score_episodes(self, rows, episodes: list[Episode], version) -> list[RolloutSample]:
        """Each prompt's `num_generations` episodes (consecutive) scored as one group; under `on_rollout_error=
        "drop"` a group with a rollout error is dropped (and counted). A non-finite reward (an environment's
        `get_reward`, or ±inf from a reward function) is a `NonFiniteRewardError` of its episode: counted, and
        under `"feed_back"` the completion is left unscored (advantage 0, TRL's rule for a skipped completion)."""
        s, counts, kept = self.s, {}, []
        for g, row in enumerate(rows):
            group = episodes[g * s.num_generations : (g + 1) * s.num_generations]
            per_func, names = self._rewards(row, group)
            for kind in (e.kind for episode in group for e in episode.errors):
                counts[f"rollout/errors/{kind}_total"] = counts.get(f"rollout/errors/{kind}_total", 0.0) + 1.0
            errors = [e for episode in group for e in episode.errors if self._follows_policy(e)]
            kinds = sorted({e.kind for e in errors})
            if kinds and s.agent is not None and s.agent.on_rollout_error == "raise":
                raise errors[0]
            if kinds and s.agent is not None and s.agent.on_rollout_error == "drop":
                for kind in kinds:
                    key = f"rollout/dropped_groups/{kind}_total"
                    counts[key] = counts.get(key, 0.0) + 1.0
                    self.dropped[kind] = self.dropped.get(kind, 0) + 1
                self._check_dropped()
                continue
            self.dropped = {}
            kept.append((group, per_func, names))
        rewards = [self._summed(per_func) for _, per_func, _ in kept]
        batch_std = _nanstd(np.concatenate(rewards)) if rewards else 0.0
        samples = []
        for (group, per_func, names), summed in zip(kept, rewards, strict=True):
            samples += self._score_group(group, per_func, names, summed, batch_std, version)
        if self.multiturn is not None:
            n = float(len(episodes))
            counts["tools/loop_exhausted_frac"] = (float(sum(e.loop_exhausted for e in episodes)), n)
            counts["rollout/turns_mean"] = (float(sum(e.turns for e in episodes)), n)
        if counts:
            try:
                self.metrics_queue.put_nowait(counts)
            except queue.Full:
                pass
        return samples

    def _follows_policy(self, error) -> bool:
        """Whether a counted rollout error follows `on_rollout_error`: all but a budget cut under
        `on_budget_cut="keep"`."""
        agent = self.s.agent
        return not (isinstance(error, BudgetCutError) and agent is not None and agent.on_budget_cut == "keep")

    def _check_dropped(self) -> None:
        """Stop (`NoRolloutSamplesError`) after `max_dropped_groups` groups in a row dropped by the policy: the worker
        would otherwise make empty batches for ever while the trainer waits."""
        total = max(self.dropped.values(), default=0)
        limit = self.s.max_dropped_groups
        if limit and total >= limit:
            kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.dropped.items()))
            raise NoRolloutSamplesError(
                f"the last {total} prompt groups were all dropped by on_rollout_error='drop' ({kinds}; "
                f"max_consecutive_empty_steps x groups per step = {limit}): the worker makes no trainable sample. "
                "Fix what fails (the rollout/errors/* metrics count it), or use on_rollout_error='feed_back'"
                + (", or on_budget_cut='keep' (budget_cut: conversations cut by max_completion_length in the middle "
                   "of a tool call; or raise max_completion_length)" if "budget_cut" in self.dropped else "")
            )  # fmt: skip

    def _rewards(self, row, episodes: list[Episode]) -> tuple[np.ndarray, list[str]]:
        """`(F, G)` rewards of one group, a row per reward function and then per environment class with a
        `get_reward` (TRL's rule); NaN where skipped. A non-finite reward becomes NaN and a `NonFiniteRewardError`
        of its episode."""
        s = self.s
        n = len(episodes)
        shown = [e.messages for e in episodes]
        extra = {k: [v] * n for k, v in row.items() if k != "prompt"}
        environments = [e.environment for e in episodes]
        if self.multiturn is not None and self.multiturn.factories is not None:
            extra["environments"] = environments
        columns = [
            [math.nan if r is None else float(r) for r in fn(prompts=[e.prompt for e in episodes], completions=shown,
                                                              completion_ids=[e.completion_ids for e in episodes],
                                                              **extra)]
            for fn in s.reward_funcs
        ]  # fmt: skip
        names = list(s.reward_names)
        if self.multiturn is not None:  # an environment's get_reward: a column per environment class (TRL's rule)
            for env_type in self.multiturn.reward_types:
                columns.append([float(e.get_reward()) if type(e) is env_type else math.nan for e in environments])
                names.append(env_type.__name__)
        per_func = np.array(columns, dtype=float).reshape(len(columns), n)
        types = [None] * len(s.reward_funcs) + (self.multiturn.reward_types if self.multiturn is not None else [])
        for k, j in np.ndindex(per_func.shape):
            value = per_func[k, j]  # NaN is a reward function's "skipped" (TRL's None), never an environment's
            if math.isinf(value) or (math.isnan(value) and type(environments[j]) is types[k]):
                episodes[j].errors.append(
                    NonFiniteRewardError(f"{names[k]} returned {value} for completion {j} of its group")
                )
                per_func[k, j] = math.nan
        return per_func, names

    @staticmethod
    def _summed(per_func: np.ndarray) -> np.ndarray:
        rewards = np.nansum(per_func, axis=0)
        rewards[np.all(np.isnan(per_func), axis=0)] = np.nan
        return rewards

    def _score_group(self, episodes: list[Episode], per_func, names, rewards, batch_std, version) -> list:
        advantages, mean, std = group_advantages(rewards, self.s.scale_rewards, batch_std)
        group = self.next_group
        self.next_group += 1
        samples = []
        for j, e in enumerate(episodes):
            metrics = {"reward": float(rewards[j]), "reward_std": std}
            metrics.update({f"rewards/{name}": float(per_func[k, j]) for k, name in enumerate(names)})
            if self.multiturn is not None:
                metrics["tools/call_frequency"] = float(e.tool_calls)
                metrics["tools/failure_frequency"] = e.tool_failures / e.tool_calls if e.tool_calls else 0.0
            p = len(e.prompt_ids)
            samples.append(
                RolloutSample(
                    prompt=e.prompt, completion=e.messages, input_ids=np.asarray(e.prompt_ids + e.completion_ids,
                                                                                 np.int64),
                    completion_mask=np.asarray([0] * p + list(e.mask), np.int64),
                    old_log_probs=np.asarray([0.0] * p + list(e.logprobs), np.float32),
                    advantage=float(advantages[j]), model_version=version, group_id=group, metrics=metrics,
                )
            )  # fmt: skip
        try:
            self.metrics_queue.put_nowait({"rollout/reward_mean": mean, "rollout/version": float(version)})
        except queue.Full:
            pass
        return samples

    # Multi-turn (tools, environments: `async_/multiturn.py`)

    @torch.no_grad()
    def _generate_ids(self, prompt_ids: list[list[int]], seed: int, budgets: list[int] | None = None
                      ) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
        """One completion per prompt (ids up to and including the EOS) and its tokens' behaviour log-probs (NaN when
        not recorded), sampled under `seed`; the prompts left padded into one `generate` call of the largest of the
        `budgets` new tokens (the multi-turn loop cuts each completion to its own)."""
        s, tok = self.s, self.s.tokenizer
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids in prompt_ids])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
        recorder = SampledTokenLogprobs()
        with torch.random.fork_rng(devices=[]), recording_logprobs(self.model, recorder):
            torch.manual_seed(seed)
            kwargs = dict(s.generation_kwargs, max_new_tokens=max(budgets or [s.generation_kwargs["max_new_tokens"]]))
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, **kwargs, eos_token_id=self.eos_ids,
                                      pad_token_id=tok.pad_token_id)  # fmt: skip
        completions = [_cut_at_eos(ids, self.eos_ids) for ids in out[:, width:].tolist()]
        if not s.record_logprobs:
            return completions, [[math.nan] * len(c) for c in completions]
        return completions, [list(lp) for lp in recorder.per_completion(completions, s.support)[0]]

    def _generate_multiturn_batch(self) -> list[RolloutSample]:
        """The next prompts' conversations (TRL's tool-calling loop, `MultiTurnRollouts`), every turn sampled from the
        version loaded now; call `c` of the batch is sampled under `SeedSequence([seed, first prompt, c])`."""
        s = self.s
        first = self.next_prompt
        rows = [s.prompts[(self.next_prompt + i) % len(s.prompts)] for i in range(s.groups_per_batch)]
        self.next_prompt += len(rows)
        version = self.version

        def generate(prompt_ids: list[list[int]], call: int, budgets: list[int]):
            seed = int(np.random.SeedSequence([int(s.seed), int(first), int(call)]).generate_state(1)[0])
            return self._generate_ids(prompt_ids, seed, budgets)

        episodes = self.multiturn.rollout(rows, s.num_generations, generate)
        return self._score_episodes(rows, episodes, version)


def _check_fixed_lag(fixed_lag: int, weight_lag: int, args: AsyncGRPOConfig) -> None:
    if not isinstance(fixed_lag, int) or fixed_lag < 1:
        raise ValueError(
            f"fixed_lag={fixed_lag!r} must be an integer >= 1: the trainer's dataloader fetches the next step's first "
            "micro-batch before it steps, so a batch cannot wait for the policy of the step before it is trained"
        )
    if weight_lag:
        raise ValueError(f"weight_lag={weight_lag} and fixed_lag={fixed_lag}: set one of the two")
    needed = -(-fixed_lag // args.weight_sync_steps)
    staleness = getattr(args, "max_staleness", None)
    if staleness is not None and staleness < needed:
        raise ValueError(
            f"fixed_lag={fixed_lag} with weight_sync_steps={args.weight_sync_steps} trains samples up to {needed} "
            f"versions old: max_staleness={staleness} would drop them; set max_staleness >= {needed}"
        )


def _as_list(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _prompt_text(tok, prompt, chat_template_kwargs: dict[str, Any]) -> str:
    if isinstance(prompt, list):
        return tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **chat_template_kwargs)
    return prompt


def _cut_at_eos(ids: list[int], eos_ids: list[int]) -> list[int]:
    """The completion up to and including its first EOS (the padding after it dropped)."""
    for t, token in enumerate(ids):
        if token in eos_ids:
            return ids[: t + 1]
    return ids
