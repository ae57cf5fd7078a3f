"""The asynchronous trainer's rollout worker, whatever samples in it: the process, its health, the weights it receives
and which policy version samples which batch. The backends (`hf_generate.HFGenerateRolloutWorker`,
`vllm.VLLMRolloutWorker`) add only how a batch is sampled (`loop.WorkerLoop`'s `load`,
`_generate_single_turn_batch` and `_generate_ids`); the process' loop is `rollout/loop.py`'s, the group scoring
`rollout/scoring.py`'s, the conversations with tools `rollout/tool_calling/rollouts.py`'s.

`RolloutWorker` implements TRL's `RolloutWorkerProtocol`: a spawned process (`rollout/process.py`) holds its own copy
of the policy, cycles over the prompts, samples `num_generations` completions per prompt, scores them, and puts TRL
`RolloutSample`s tagged with the policy version they were sampled from on its queue. `QueueWeightTransfer` implements
`WeightTransferProtocol`: `send_weights` puts the trainer's parameters on a queue the worker drains between two batches
(it loads them then, so a batch is never sampled from two policies).

Health: the worker ticks a heartbeat after every batch (and while it waits on a full queue); `check_health` raises,
naming the cause, when the process died, raised (its traceback is chained), or has not ticked for `stale_after_s`
seconds; TRL's trainer calls it whenever its queue stays empty for 5 s. Samples come through a `SampleChannel`
(`rollout/channel.py`), whose reads time out and see the worker's death even in the middle of a message, and the
weights through `LatestWeights` (only the newest kept). The worker exits within a second when the trainer's process
dies (it polls its parent's PID), so neither side can hang on, or outlive, the other.

Reproducibility: each batch is sampled under a seed derived from `(args.seed, index of its first prompt)`
(`batch_seed`), so the samples of a batch do not depend on what the process generated before it. With `fixed_lag`
the policy version each batch is sampled from is a function of the batch's index (`version_for_group`), not of
timing; a run is then repeatable, and resumable bit-exactly from a checkpoint (`async_/resume.py`).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp
from trl.experimental.async_grpo import AsyncGRPOConfig

from ..staleness import check_fixed_lag, check_weight_lag, version_for_batch
from .channel import LatestWeights, SampleChannel, SharedFlag
from .loop import WorkerLoop, WorkerSettings, worker_main
from .process import ProcessDyingWithParent
from .tool_calling import AgentSpec, MultiTurnRollouts, prepare_tokenizer

__all__ = ["VLLM_ONLY_OPTIONS", "QueueWeightTransfer", "RolloutWorker", "RolloutWorkerDiedError"]


class RolloutWorkerDiedError(RuntimeError):
    """The rollout process exited (killed, crashed) or raised; the message names it, its exit code or traceback."""


# AsyncGRPOConfig options that configure TRL's vLLM worker and mean nothing to a worker in a process of its own
VLLM_ONLY_OPTIONS = (
    "vllm_server_base_url",
    "vllm_server_timeout",
    "request_timeout",
    "max_inflight_tasks",
)


def _check_args(args: AsyncGRPOConfig, model: Any, weight_lag: int, fixed_lag: int | None, name: str) -> None:
    """Refuse, naming the option, what the worker cannot honour."""
    for option in VLLM_ONLY_OPTIONS:
        if getattr(args, option) != _default(option):
            raise ValueError(
                f"{option}={getattr(args, option)!r} configures TRL's vLLM rollout worker; {name} generates in its "
                f"own process and does not use it: leave {option} at its default ({_default(option)!r})"
            )
    check_weight_lag(weight_lag, args)
    if fixed_lag is not None:
        check_fixed_lag(fixed_lag, weight_lag, args)
    if not isinstance(model, str):
        raise TypeError(f"{name} loads its own copy of the policy: pass the model's path")


def _default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(AsyncGRPOConfig) if f.name == name)


def _picklable_reward_funcs(reward_funcs: Sequence[Callable] | None) -> list[Callable]:
    """The reward functions, each refused by name unless it pickles (they are sent to the process: refused here
    rather than at `start`)."""
    funcs = list(reward_funcs or [])
    for k, func in enumerate(funcs):
        try:
            pickle.dumps(func)
        except Exception as error:
            name = getattr(func, "__qualname__", repr(func))
            raise TypeError(
                f"reward_funcs[{k}] ({name}) is sent to the rollout process and must be picklable (a module-level "
                f"function or class, not a lambda or a closure): {type(error).__name__}: {error}"
            ) from error
    return funcs


def _scale_rewards(args: AsyncGRPOConfig) -> str:
    """TRL's `scale_rewards` (`True`/`False` as `"group"`/`"none"`), checked."""
    value = getattr(args, "scale_rewards", "group")
    value = {True: "group", False: "none"}.get(value, None) or value
    if value not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards={value!r}: allowed values are ('group', 'batch', 'none')")
    return value


def _agent_setup(agent: AgentSpec, model: str, processing_class: Any, args: AsyncGRPOConfig) -> tuple[Any, int]:
    """With tools or environments: the tokenizer prepared for tool calls and the model's context, the multi-turn
    loop built once here so that it refuses bad input in the trainer's process; else the tokenizer and 0."""
    if not agent.enabled:
        return processing_class, 0
    from transformers import AutoConfig

    if getattr(args, "routing_replay", "off") == "rollout":
        raise ValueError(
            "routing_replay='rollout' with tools/environment_factory: the routes of a conversation's turns "
            "are not stitched into one sample; use routing_replay='old_policy'"
        )
    processing_class = prepare_tokenizer(processing_class)
    max_model_len = AutoConfig.from_pretrained(model).get_text_config().max_position_embeddings
    MultiTurnRollouts(agent, processing_class, dict(args.chat_template_kwargs or {}), args.max_completion_length,
                      max_model_len)  # fmt: skip
    return processing_class, max_model_len


def _generation_kwargs(args: AsyncGRPOConfig) -> dict[str, Any]:
    """The sampling options, as HF `generate` names them (the vLLM backend maps them to its `SamplingParams`)."""
    return dict(
        do_sample=True,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k or None,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_new_tokens=args.max_completion_length,
    )


class RolloutWorker:
    """TRL `RolloutWorkerProtocol` in a spawned process holding its own copy of the policy; a backend subclass says
    how it samples (`loop_class`).

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
            sample carries its tokens' MoE routes (`routed_experts`, `async_/routing_replay.py`).
        groups_per_batch (`int`, *optional*): prompts per batch; defaults to one optimizer step's worth.
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
            (`rollout/tool_calling/rollouts.py`). Module-level functions (they are pickled to the process).
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*): TRL's environments (`reset`, public
            methods as tools, optional `get_reward`); the reward functions also receive `environments=`.
        tool_timeout_s (`float`, *optional*, defaults to `60`): how long one tool call may run
            (`episodes.ToolTimeoutError`).
        on_rollout_error (`str`, *optional*, defaults to `"feed_back"`): what a multi-turn sample that met a
            `episodes.RolloutError` becomes: `"feed_back"` (TRL's behaviour: the error is the tool's reply),
            `"drop"` (its group is dropped) or `"raise"`; every case is counted in `rollout/errors/*` metrics
            (`episodes.RolloutErrorPolicy`).
        on_budget_cut (`str`, *optional*, defaults to `"keep"`): a turn cut by the completion budget in the middle of
            a tool call (`episodes.BudgetCutError`, counted): `"keep"` (trained as a truncated completion) or
            `"rollout_error"` (follows `on_rollout_error`).
        tool_processes (`int`, *optional*, defaults to `4`): processes the tools run in, side by side; a call that
            does not return within `tool_timeout_s` is stopped with its process (`rollout/tool_calling/runner.py`).
            `0`: the tools run in threads of the rollout process.
        max_hung_tool_threads (`int`, *optional*, defaults to `16`): tool calls run in threads (an environment's
            methods, tools under `tool_processes=0` or defined in the main script) that timed out and still run,
            beyond which the worker stops with `HungToolCallsError`.

    Example:

    ```python
    >>> from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker, QueueWeightTransfer
    >>> worker = HFGenerateRolloutWorker(model_path, dataset, [reward], tokenizer, args)  # doctest: +SKIP
    >>> trainer = RLLossAsyncGRPOTrainer(model_path, args=args, train_dataset=dataset, rollout_worker=worker,
    ...                                  weight_transfer=QueueWeightTransfer(worker))  # doctest: +SKIP
    ```
    """

    worker_name = "RolloutWorker"  # named in its errors
    loop_class: type[WorkerLoop]  # the backend's: how the process samples

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
        _check_args(args, model, weight_lag, fixed_lag, self.worker_name)
        samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        agent = AgentSpec(list(tools or []), environment_factory, args.max_tool_calling_iterations, tool_timeout_s,
                          on_rollout_error, on_budget_cut, tool_processes, max_hung_tool_threads)  # fmt: skip
        if not agent.enabled and args.max_tool_calling_iterations is not None:
            raise ValueError(
                f"max_tool_calling_iterations={args.max_tool_calling_iterations} without tools or "
                f"environment_factory: pass them to the rollout worker ({self.worker_name}(..., tools=[...]))"
            )
        rows = [dict(row) for row in dataset]
        if not rows or ("prompt" not in rows[0] and agent.environment_factory is None):
            raise ValueError(f"{self.worker_name} needs a dataset with a 'prompt' column")
        funcs = _picklable_reward_funcs(reward_funcs)
        scale_rewards = _scale_rewards(args)
        routing_replay = getattr(args, "routing_replay", "off")
        processing_class, max_model_len = _agent_setup(agent, model, processing_class, args)
        groups = max(1, samples_per_step // args.num_generations)
        self._settings = WorkerSettings(
            model_path=model, prompts=rows, reward_funcs=funcs, tokenizer=processing_class,
            reward_names=[getattr(f, "__name__", type(f).__name__) for f in funcs],
            num_generations=args.num_generations, groups_per_batch=groups_per_batch or groups,
            generation_kwargs=_generation_kwargs(args), support=getattr(args, "rollout_logprobs_support", "full"),
            record_logprobs=record_logprobs, shared_prompt_generation=shared_prompt_generation,
            weight_lag=weight_lag, threads=threads, dtype=args.dtype,
            chat_template_kwargs=dict(args.chat_template_kwargs or {}), seed=args.seed, fixed_lag=fixed_lag,
            weight_sync_steps=args.weight_sync_steps, routing_replay=routing_replay,
            agent=agent if agent.enabled else None, max_completion_length=args.max_completion_length,
            max_model_len=max_model_len, scale_rewards=scale_rewards,
            max_dropped_groups=getattr(args, "max_consecutive_empty_steps", 8) * groups,
            loop_class=self.loop_class,
        )  # fmt: skip
        self.records_logprobs = record_logprobs
        self.records_routes = routing_replay == "rollout"  # read by RLLossAsyncGRPOTrainer
        self.agent = self._settings.agent  # read by RLLossAsyncGRPOTrainer
        self.fixed_lag = fixed_lag
        self.weight_lag = weight_lag  # read by RLLossAsyncGRPOTrainer (check_weight_lag with its own arguments)
        self._check_backend()
        self._open_channels(args.queue_maxsize, ready_timeout)

    def _check_backend(self) -> None:
        """The backend's own checks of the settings (refusing, or saying, what it cannot do)."""

    def _open_channels(self, queue_maxsize: int, ready_timeout: float) -> None:
        """The queues and flags shared with the process (before it starts)."""
        ctx = mp.get_context("spawn")
        self._ctx = ctx
        self.rollout_buffer = SampleChannel(ctx, maxsize=queue_maxsize)
        self.rollout_buffer.health = lambda: self._raise_if_dead()
        self.metrics_queue = ctx.Queue(maxsize=4096)
        self.weights = LatestWeights(ctx)
        # Shared with the process without a lock (see rollout/channel.py): each written by one side only, so a worker
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
        """The samples of one batch, all sampled from one policy version (read by the trainer's stale bound)."""
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
            raise RuntimeError(f"{self.worker_name}.restore must be called before start")
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
        process = ProcessDyingWithParent(
            target=worker_main,
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
                raise RuntimeError(f"{self.worker_name} did not load its policy within {self._ready_timeout}s")

    def _raise_if_dead(self) -> None:
        if self._failed.is_set():
            try:
                cause = RuntimeError(self._errors.get(timeout=5.0))  # put before the event was set
            except queue.Empty:
                cause = None
            raise RolloutWorkerDiedError(
                f"{self.worker_name}: the rollout process failed (its traceback is chained)"
            ) from cause
        if self._process is not None and not self._process.is_alive():
            raise RolloutWorkerDiedError(
                f"{self.worker_name}: the rollout process exited (exit code {self._process.exitcode}) while the "
                "trainer waits for samples"
            )

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the process died, raised, or has not produced (heartbeat) for `stale_after_s` seconds."""
        self._raise_if_dead()
        age = time.time() - self._heartbeat.value
        if age > stale_after_s:
            raise RuntimeError(
                f"{self.worker_name}: no progress for {age:.0f}s > heartbeat_stale_after_s={stale_after_s:.0f}s; "
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
    """TRL `WeightTransferProtocol` without NCCL: the trainer's parameters go to a `RolloutWorker` through a
    `torch.multiprocessing` queue (tensors in shared memory), tagged with the version they will be.

    Under the worker's `fixed_lag` it also keeps a copy of the last versions that batches not trained yet can still
    be sampled from (`history`, `ceil(fixed_lag / weight_sync_steps) + 1` of them): a checkpoint saves them, since
    the resumed worker samples those batches from them (`async_/resume.py`). Each send then waits until the worker
    has copied the previous version.

    Args:
        worker (`RolloutWorker`): the worker whose policy copy receives the weights (`HFGenerateRolloutWorker`,
            `VLLMRolloutWorker`).
        timeout_s (`float`, *optional*, defaults to `600`): how long `send_weights` may wait for the queue.

    Example:

    ```python
    >>> transfer = QueueWeightTransfer(worker)  # doctest: +SKIP
    >>> transfer.send_weights(iter(model.state_dict().items()))  # doctest: +SKIP
    ```
    """

    def __init__(self, worker: RolloutWorker, timeout_s: float = 600.0):
        self.worker = worker
        self.timeout_s = timeout_s
        self.history: dict[int, dict[str, torch.Tensor]] = {}  # version -> CPU copy (under fixed_lag only)
        lag = worker.fixed_lag
        self._keep = 0 if lag is None else -(-lag // worker._settings.weight_sync_steps) + 1

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...  # the worker swaps weights between two batches: nothing to pause

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
