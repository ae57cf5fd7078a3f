"""Asynchronous GRPO without vLLM or NCCL: a rollout worker that samples with HF `generate` in its own process, and
the weight transfer to it through a `torch.multiprocessing` queue (shared memory).

`HFGenerateRolloutWorker` is a `worker.RolloutWorker` (the process, its health, the weights and which policy samples
which batch: `rollout/worker.py`, `rollout/loop.py`; the group scoring: `rollout/scoring.py`) whose process
samples with HF `generate`: the prompts left padded into one call (`common.sampling.generate_and_cut`), each sampled
token's log-prob recorded as the synchronous trainer's recorder does (`rollout_recording.SampledTokenLogprobs`: the
same support under top-k/top-p/min-p), each prompt prefilled once for its completions
(`shared_prefill.sharing_prompts`), and under `routing_replay="rollout"` the MoE routes recorded with the samples
(`async_/routing_replay.py`).

The names of the worker framework a user imports with it are importable from here too (`QueueWeightTransfer`,
`RolloutWorkerDiedError`, `NoRolloutSamplesError`, `group_advantages`, `batch_seed`, ...).
"""

from __future__ import annotations

import contextlib
import math

import torch
from transformers.utils import logging
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ...common.rollout_recording import SampledTokenLogprobs, recording_logprobs
from ...common.routing_replay import RoutingReplay, generation_routes
from ...common.sampling import generate_and_cut
from ...common.shared_prefill import sharing_prompts
from ..routing_replay import sample_routes
from .loop import WorkerLoop, batch_seed, id_list
from .worker import RolloutWorker

logger = logging.get_logger(__name__)

__all__ = ["HFGenerateLoop", "HFGenerateRolloutWorker"]


class HFGenerateLoop(WorkerLoop):
    """The worker process' loop sampling with HF `generate` on its own copy of the policy."""

    def load(self) -> None:
        """Load the worker's own copy of the policy (float32 unless `dtype` says otherwise, SDPA attention)."""
        from transformers import AutoModelForCausalLM

        dtype = {"auto": "auto"}.get(self.s.dtype, getattr(torch, self.s.dtype))
        self.model = AutoModelForCausalLM.from_pretrained(self.s.model_path, dtype=dtype, attn_implementation="sdpa")
        self.model.eval()
        self.routing = RoutingReplay().attach(self.model) if self.s.routing_replay == "rollout" else None
        self.eos_ids = [self.s.tokenizer.eos_token_id, *id_list(self.model.generation_config.eos_token_id)]
        self.load_multiturn()

    def _generate_single_turn_batch(self) -> list[RolloutSample]:
        """The next prompts' `num_generations` completions each, sampled in one `generate` call under the batch's
        seed (`batch_seed`), their log-probs recorded, and scored."""
        s, tok = self.s, self.s.tokenizer
        seed = batch_seed(s.seed, self.next_prompt)
        rows, _, encoded = self._next_prompts()
        version = self.version
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"],
                                                                     strict=True)]  # fmt: skip
        recorder = SampledTokenLogprobs()
        routing = contextlib.nullcontext([]) if self.routing is None else self.routing.recording()
        share = s.shared_prompt_generation and self.routing is None  # routes are recorded row by row
        with recording_logprobs(self.model, recorder), sharing_prompts(self.model, share), routing as records:
            completions = generate_and_cut(self.model, prompt_ids, tok.pad_token_id, self.eos_ids, seed,
                                           **s.generation_kwargs)  # fmt: skip
        recorded = recorder.per_completion(completions, s.support) if s.record_logprobs else None
        samples = self._score_groups(rows, encoded, completions, recorded, version)
        if self.routing is not None:  # MoE routing replay: each sample's (p + c, L, k) routes
            routes = generation_routes(records, encoded["attention_mask"], [len(c) for c in completions])
            samples = [sample_routes(*parts) for parts in zip(samples, *routes, strict=True)]
        return samples

    @torch.no_grad()
    def _generate_ids(self, prompt_ids: list[list[int]], seed: int, budgets: list[int] | None = None
                      ) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
        """One completion per prompt (ids up to and including the EOS) and its tokens' behaviour log-probs (NaN when
        not recorded), sampled under `seed`; the prompts left padded into one `generate` call of the largest of the
        `budgets` new tokens (the multi-turn loop cuts each completion to its own)."""
        s = self.s
        recorder = SampledTokenLogprobs()
        kwargs = dict(s.generation_kwargs, max_new_tokens=max(budgets or [s.generation_kwargs["max_new_tokens"]]))
        with recording_logprobs(self.model, recorder):
            completions = generate_and_cut(self.model, prompt_ids, s.tokenizer.pad_token_id, self.eos_ids, seed,
                                           **kwargs)  # fmt: skip
        if not s.record_logprobs:
            return completions, [[math.nan] * len(c) for c in completions]
        return completions, [list(lp) for lp in recorder.per_completion(completions, s.support)[0]]


class HFGenerateRolloutWorker(RolloutWorker):
    """TRL `RolloutWorkerProtocol` with HF `generate` in a spawned process holding its own copy of the policy. Its
    arguments are `worker.RolloutWorker`'s (the module docstring says how it samples).

    Args:
        model (`str`): the policy's path.
        dataset (`datasets.Dataset` or `list[dict]`): rows with a `prompt`.
        reward_funcs (`list[Callable]`): TRL reward functions (picklable), summed.
        processing_class (`PreTrainedTokenizerBase`): the tokenizer.
        args (`AsyncGRPOConfig`): sampling, `queue_maxsize`, `rollout_logprobs_support` and `dtype`.

    The keyword options (`record_logprobs`, `shared_prompt_generation`, `groups_per_batch`, `weight_lag`,
    `fixed_lag`, `threads`, `ready_timeout`, `tools`, `environment_factory`, `tool_timeout_s`, `on_rollout_error`,
    `on_budget_cut`, `tool_processes`, `max_hung_tool_threads`) are `RolloutWorker`'s, described there.

    Example:

    ```python
    >>> from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker, QueueWeightTransfer
    >>> worker = HFGenerateRolloutWorker(model_path, dataset, [reward], tokenizer, args)  # doctest: +SKIP
    >>> transfer = QueueWeightTransfer(worker)  # doctest: +SKIP
    ```
    """

    worker_name = "HFGenerateRolloutWorker"
    loop_class = HFGenerateLoop

    def _check_backend(self) -> None:
        if self.records_routes and self._settings.shared_prompt_generation:
            logger.warning(
                "HFGenerateRolloutWorker: shared_prompt_generation is set aside: routing_replay='rollout' records the "
                "routers during generate row by row, and a prompt prefilled once would give its completions one row"
            )
