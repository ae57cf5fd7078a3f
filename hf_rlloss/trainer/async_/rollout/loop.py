"""The rollout worker's process: what it is given (`WorkerSettings`), and its loop (`WorkerLoop`): which weights sample
the next batch, the batch sampled (by the backend's subclass) and scored (`scoring.GroupScoring`), its samples put on
the queue, the heartbeat ticked.

Which policy version samples which batch: without `fixed_lag` the newest the worker received, `weight_lag` versions
late; with it, the version of the batch (`staleness.version_for_batch`), a function of the batch's index alone,
waited for if needed. Each batch is sampled under a seed derived from `(seed, index of its first prompt)`
(`batch_seed`). The trainer's side of the worker (the process handle, its health, the weight transfer) is
`rollout/worker.py`.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ..staleness import version_for_batch
from .process import exit_with_parent
from .scoring import GroupScoring
from .tool_calling import AgentSpec, MultiTurnRollouts

__all__ = ["WorkerLoop", "WorkerSettings", "batch_seed", "id_list", "worker_main"]


def batch_seed(seed: int, first_group: int) -> int:
    """The sampling seed of the batch whose first prompt is the `first_group`-th served (counted from the start of
    training, over epochs): a function of the two alone, so a resumed worker samples a batch as an uninterrupted one
    did, whatever it generated before. (The worker's RNG state itself is not saved: it is re-seeded per batch.)"""
    return int(np.random.SeedSequence([int(seed), int(first_group)]).generate_state(1)[0])


def id_list(value: int | Sequence[int] | None) -> list[int]:
    """A config's token id field (`eos_token_id`: none, one or several) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


@dataclasses.dataclass
class WorkerSettings:
    """What the worker process needs (picklable). `loop_class` is the backend's `WorkerLoop`, and `backend` its own
    options (`vllm.VLLMRolloutWorker`'s engine size)."""

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
    agent: AgentSpec | None = None  # tools / environments: multi-turn rollouts (`rollout/tool_calling/rollouts.py`)
    max_completion_length: int = 0
    max_model_len: int = 0
    scale_rewards: str = "group"  # TRL's meanings (`common.advantages.group_advantages`)
    max_dropped_groups: int = 0  # consecutive groups dropped by `on_rollout_error="drop"` before the worker stops
    loop_class: type[WorkerLoop] | None = None  # the backend's loop, run in the worker process
    backend: dict[str, Any] = dataclasses.field(default_factory=dict)  # the backend's own options


def worker_main(settings, rollout_buffer, metrics_queue, weights, stop, ready, failed, errors, heartbeat) -> None:
    """The worker process: `settings.loop_class`'s loop until `stop`; what it raises is reported on `errors`."""
    if settings.parent_pid:
        threading.Thread(target=exit_with_parent, args=(settings.parent_pid,), daemon=True).start()
    try:
        settings.loop_class(settings, rollout_buffer, metrics_queue, weights, stop, heartbeat).run(ready)
    except BaseException:  # report, then leave: the trainer's health check raises with this traceback
        try:  # the tail of the traceback, short enough for one atomic pipe write
            errors.put_nowait(traceback.format_exc()[-2000:])
        except queue.Full:
            pass
        failed.set()


def _prompt_text(tok: Any, prompt: Any, chat_template_kwargs: dict[str, Any]) -> str:
    """A row's prompt as text: chat messages rendered by the chat template, with the generation prompt."""
    if isinstance(prompt, list):
        return tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **chat_template_kwargs)
    return prompt


class WorkerLoop(GroupScoring):
    """The loop of the worker process: which weights sample the next batch, the batch sampled (by the backend) and
    scored (`GroupScoring`), its samples put on the queue, the heartbeat.

    A backend defines `load` (its policy copy as `model`, with `load_state_dict`, and `eos_ids`; then
    `load_multiturn()`), `_generate_single_turn_batch` and `_generate_ids` (one completion per prompt, for the
    multi-turn loop).

    Args:
        settings (`WorkerSettings`): what the worker does.
        rollout_buffer, metrics_queue, weights, stop, heartbeat: the worker's channels (`RolloutWorker`'s).
    """

    def __init__(self, settings: WorkerSettings, rollout_buffer, metrics_queue, weights, stop, heartbeat):
        self.s = settings
        self.rollout_buffer, self.metrics_queue, self.weights = rollout_buffer, metrics_queue, weights
        self.stop, self.heartbeat = stop, heartbeat
        self.pending: deque[tuple[int, dict[str, torch.Tensor]]] = deque()  # received, not yet applied (weight_lag)
        self.received = 0  # the newest version read from `weights`
        self.version = 0  # the version of the weights the worker samples from (0: not synced yet)
        self.next_prompt = settings.start_group  # counted over epochs
        self.next_group = 0  # the samples' group_id, from the start position on (TRL's convention)
        self.dropped: dict[str, int] = {}  # groups dropped in a row, by kind (`on_rollout_error="drop"`)
        self.multiturn: MultiTurnRollouts | None = None

    def load(self) -> None:
        raise NotImplementedError

    def _generate_single_turn_batch(self) -> list[RolloutSample]:
        raise NotImplementedError

    def _generate_ids(self, prompt_ids: list[list[int]], seed: int, budgets: list[int] | None = None
                      ) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
        raise NotImplementedError

    def tick(self) -> None:
        """Progress: a batch put samples, a tool call ended (`MultiTurnRollouts`' tick), or the worker waits on the
        trainer."""
        if self.heartbeat is not None:
            self.heartbeat.value = time.time()

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

    def _next_rows(self) -> list[dict]:
        """The next `groups_per_batch` prompt rows (cycling over the prompts)."""
        s = self.s
        rows = [s.prompts[(self.next_prompt + i) % len(s.prompts)] for i in range(s.groups_per_batch)]
        self.next_prompt += len(rows)
        return rows

    def _next_prompts(self) -> tuple[list[dict], list[str], Any]:
        """The next `groups_per_batch` prompt rows, their texts, and the texts tokenized with each repeated
        `num_generations` times, left padded: the layout `_score_groups` reads the prompt ids from."""
        s, tok = self.s, self.s.tokenizer
        rows = self._next_rows()
        texts = [_prompt_text(tok, row["prompt"], s.chat_template_kwargs) for row in rows]
        encoded = tok([t for t in texts for _ in range(s.num_generations)], return_tensors="pt", padding=True,
                      padding_side="left", add_special_tokens=False)  # fmt: skip
        return rows, texts, encoded

    @torch.no_grad()
    def _generate_batch(self) -> list[RolloutSample]:
        """The next batch's samples: conversations with tools (`MultiTurnRollouts`), or one completion per row."""
        if self.multiturn is not None:
            return self._generate_multiturn_batch()
        return self._generate_single_turn_batch()

    def _generate_multiturn_batch(self) -> list[RolloutSample]:
        """The next prompts' conversations (TRL's tool-calling loop, `MultiTurnRollouts`), every turn sampled from the
        version loaded now; call `c` of the batch is sampled under `SeedSequence([seed, first prompt, c])`."""
        s = self.s
        first = self.next_prompt
        rows = self._next_rows()
        version = self.version

        def generate(prompt_ids: list[list[int]], call: int, budgets: list[int]):
            seed = int(np.random.SeedSequence([int(s.seed), int(first), int(call)]).generate_state(1)[0])
            return self._generate_ids(prompt_ids, seed, budgets)

        episodes = self.multiturn.rollout(rows, s.num_generations, generate)
        return self._score_episodes(rows, episodes, version)
