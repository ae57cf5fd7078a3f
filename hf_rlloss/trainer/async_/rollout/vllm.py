"""`VLLMRolloutWorker`: the asynchronous trainer's rollout worker process, sampling with a vLLM engine instead of HF
`generate`, on any machine vLLM runs on (its CPU build included), without a server or NCCL.

It is a `worker.RolloutWorker` (prompts, queues, heartbeat, weight lag, and the weights through
`worker.QueueWeightTransfer`; the group scoring of `rollout/scoring.py`), as `hf_generate.HFGenerateRolloutWorker` is,
with two things of its own in the worker process:

* the policy copy is a vLLM engine (`LLM`, in-process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so that the weights can be
  loaded into its model) built with `logprobs_mode="processed_logprobs"`: the per-token log-probs it reports are those
  of the distribution it samples from (after temperature, penalties and top-k/top-p/min-p), the rollout log-probs of
  rollout IS and the mismatch metrics;
* the trainer's weights, when they arrive, go into the engine's model through `load_weights` (on vLLM's CPU backend
  after `vllm_cpu.use_reloadable_cpu_linear`, applied in the worker process before the engine is built).

The engine computes in `args.dtype` (vLLM's own choice for `"auto"`: bfloat16 for a float32 checkpoint on CPU).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import torch
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ...common.sampling import cut_at_eos
from ...common.vllm_cpu import silence_trl_vllm_version_warning, use_reloadable_cpu_linear
from .loop import WorkerLoop, id_list
from .worker import RolloutWorker

__all__ = ["VLLMRolloutWorker", "VLLMWorkerLoop"]


class _EngineWeights:
    """The engine's model seen as `WorkerLoop` sees its policy copy: `load_state_dict` loads through vLLM."""

    def __init__(self, llm: Any):
        self.llm = llm

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = False) -> tuple[list[str], list[str]]:
        # vLLM's load_weights takes checkpoint names (it fuses q/k/v, gate/up itself) and raises on unknown ones
        self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(state.items())
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the previous weights
        return [], []


class VLLMWorkerLoop(WorkerLoop):
    """The worker process' loop sampling with a vLLM engine in the process (`VLLMRolloutWorker`)."""

    def load(self) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its model takes weights
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.s.backend["kv_cache_gib"]))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        silence_trl_vllm_version_warning()
        use_reloadable_cpu_linear()
        from vllm import LLM

        self.llm = LLM(
            model=self.s.model_path,
            tokenizer=self.s.model_path,
            dtype=self.s.dtype,
            max_model_len=self.s.backend["max_model_len"],
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            seed=0,
        )
        self.model = _EngineWeights(self.llm)
        eos = self.llm.llm_engine.model_config.hf_config.eos_token_id
        self.eos_ids = [self.s.tokenizer.eos_token_id, *id_list(eos)]
        self.load_multiturn()
        import vllm

        # one line on the worker's stderr, with what only a built engine knows (its context length)
        context = self.llm.llm_engine.model_config.max_model_len
        print(f"VLLMRolloutWorker: vLLM {vllm.__version__} engine ready (max_model_len={context})", file=sys.stderr,
              flush=True)  # fmt: skip

    def _sampling_params(self, n: int | None = None, seed: int | None = None, max_tokens: int | None = None) -> Any:
        from vllm import SamplingParams

        g = self.s.generation_kwargs
        return SamplingParams(
            n=self.s.num_generations if n is None else n,
            seed=seed,
            temperature=g["temperature"],
            top_p=g.get("top_p") or 1.0,
            top_k=g.get("top_k") or 0,
            min_p=g.get("min_p") or 0.0,
            repetition_penalty=g.get("repetition_penalty") or 1.0,
            max_tokens=g["max_new_tokens"] if max_tokens is None else max_tokens,
            stop_token_ids=list(set(self.eos_ids)),
            logprobs=0,
        )

    def _completions(self, outputs: list) -> tuple[list[list[int]], list[list[float]]]:
        """The engine's completions (cut after their EOS) and their tokens' log-probs, in request order."""
        completions, logprobs = [], []
        for output in outputs:
            for sample in output.outputs:
                ids = cut_at_eos(list(sample.token_ids), self.eos_ids)
                completions.append(ids)
                logprobs.append([step[token].logprob for token, step in zip(ids, sample.logprobs)])
        return completions, logprobs

    @torch.no_grad()
    def _generate_ids(self, prompt_ids: list[list[int]], seed: int, budgets: list[int] | None = None
                      ) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
        """Multi-turn (`loop.WorkerLoop._generate_multiturn_batch`): one completion per prompt, request `i`
        sampled under seed `seed + i`, of at most `budgets[i]` tokens (the completion budget its conversation has
        left)."""
        budgets = budgets or [None] * len(prompt_ids)
        params = [self._sampling_params(n=1, seed=(seed + i) % 2**63, max_tokens=budgets[i])
                  for i in range(len(prompt_ids))]  # fmt: skip
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        completions, logprobs = self._completions(outputs)
        if not self.s.record_logprobs:
            logprobs = [[math.nan] * len(c) for c in completions]
        return completions, logprobs

    def _generate_single_turn_batch(self) -> list[RolloutSample]:
        """The next prompts' `num_generations` completions each, one request per prompt, and scored."""
        s, tok = self.s, self.s.tokenizer
        rows, texts, encoded = self._next_prompts()
        version = self.version
        prompts = [{"prompt_token_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]
        outputs = self.llm.generate(prompts, self._sampling_params(), use_tqdm=False)
        completions, logprobs = self._completions(outputs)
        recorded = (logprobs, None) if s.record_logprobs else None
        return self._score_groups(rows, encoded, completions, recorded, version)


class VLLMRolloutWorker(RolloutWorker):
    """TRL `RolloutWorkerProtocol` with a vLLM engine in a spawned process; the arguments are
    `worker.RolloutWorker`'s (as `HFGenerateRolloutWorker`'s), plus:

    Args:
        max_model_len (`int`, *optional*): the engine's context length (prompt + completion); defaults to the
            model's.
        kv_cache_gib (`int`, *optional*, defaults to `1`): on CPU, the engine's KV-cache size in whole GiB
            (`VLLM_CPU_KVCACHE_SPACE`, which vLLM reads as an integer).

    Under truncated sampling (top-k/top-p/min-p) vLLM reports log-probs on the sampled support only: set
    `rollout_logprobs_support="sampled"` (the trainer then renormalizes π_old over the replayed support).

    Example:

    ```python
    >>> from hf_rlloss.trainer.async_.rollout import VLLMRolloutWorker
    >>> worker = VLLMRolloutWorker(model_path, dataset, [reward], tokenizer, args, kv_cache_gib=2)  # doctest: +SKIP
    ```
    """

    worker_name = "VLLMRolloutWorker"
    loop_class = VLLMWorkerLoop

    def __init__(self, *args: Any, max_model_len: int | None = None, kv_cache_gib: int = 1, **kwargs: Any):
        if isinstance(kv_cache_gib, float) and kv_cache_gib.is_integer():
            kv_cache_gib = int(kv_cache_gib)
        if isinstance(kv_cache_gib, bool) or not isinstance(kv_cache_gib, int) or kv_cache_gib < 1:
            raise ValueError(f"kv_cache_gib={kv_cache_gib!r}: a whole number of GiB >= 1 (vLLM reads "
                             "VLLM_CPU_KVCACHE_SPACE as an integer)")  # fmt: skip
        super().__init__(*args, **kwargs)
        s = self._settings
        if s.routing_replay == "rollout":
            raise ValueError(
                "routing_replay='rollout' with VLLMRolloutWorker: its samples carry no routed experts (the engine "
                "would need enable_return_routed_experts=True and its per-token routes mapped onto the samples); use "
                "HFGenerateRolloutWorker, or routing_replay='old_policy'"
            )
        g = s.generation_kwargs
        truncated = (g.get("top_k") or 0) > 0 or (g.get("top_p") or 1.0) < 1.0 or (g.get("min_p") or 0.0) > 0.0
        if truncated and s.record_logprobs and s.support == "full":
            raise ValueError(
                "rollout_logprobs_support='full' with VLLMRolloutWorker and truncated sampling (top_k/top_p/min_p): "
                "vLLM reports the log-probs of the truncated distribution only; set rollout_logprobs_support="
                "'sampled'"
            )
        s.backend = {"max_model_len": max_model_len, "kv_cache_gib": kv_cache_gib}  # read by `VLLMWorkerLoop.load`
        if s.agent is not None and max_model_len:  # the engine's context bounds a conversation
            s.max_model_len = min(s.max_model_len, max_model_len)
