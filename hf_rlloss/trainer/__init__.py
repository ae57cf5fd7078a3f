"""The trainer layer: TRL's `GRPOTrainer` with its loss delegated to the loss layer.

- `grpo_config`: `RLLossGRPOConfig`, TRL's `GRPOConfig` plus the `rl_loss:` block and the options TRL lacks.
- `grpo_trainer`: `RLLossGRPOTrainer`, TRL's override points, each labelled with the TRL method it replaces.
- `async_grpo_config`, `async_grpo_trainer`: `RLLossAsyncGRPOConfig`, `RLLossAsyncGRPOTrainer`, TRL's experimental
  async trainer with the loss layer (imported on first use: `trl.experimental` warns on import); `async_cpu`: its
  rollout worker (HF `generate` in a separate process) and weight transfer for machines without vLLM/NCCL.
- `forwards`: the training and no-grad forwards (hidden states, chunked head, log-probs).
- `lm_head`: finding and calling the LM head under PEFT and engines.
- `engines`: DeepSpeed/FSDP2 helpers (gathering the head, preparing the reference model).
- `rollout_recording`: the log-probs of sampled tokens recorded during HF `generate`.
- `multimodal`: TRL's vision-language inputs.
- `vllm_rollouts`, `vllm_cpu`, `vllm_worker`: vLLM rollouts (checks around TRL's engine, vLLM's CPU build made
  reloadable, the async trainer's vLLM rollout process).
- `sp_batch`: the sequence-parallel micro-batches (pooling, shared shuffle, packing). It is about sequence
  parallelism, but it pads each loss field with the value the loss layer's field table gives, so it imports the
  loss layer and lives above it.

The layer imports TRL; it sits on the loss layer (`hf_rlloss.loss`) and the parallelism layer
(`hf_rlloss.parallel`), and of the recipe support only the Hub card helper.
"""

from .vllm_cpu import silence_trl_vllm_version_warning

silence_trl_vllm_version_warning()  # before TRL is imported: it warns at import when vLLM 0.32 is installed

from .grpo_config import RLLossGRPOConfig  # noqa: E402
from .grpo_trainer import RLLossGRPOTrainer  # noqa: E402

_ASYNC = {"RLLossAsyncGRPOConfig": "async_grpo_config", "RLLossAsyncGRPOTrainer": "async_grpo_trainer"}


def __getattr__(name: str):
    if name in _ASYNC:
        import importlib

        return getattr(importlib.import_module(f".{_ASYNC[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RLLossAsyncGRPOConfig", "RLLossAsyncGRPOTrainer", "RLLossGRPOConfig", "RLLossGRPOTrainer"]
