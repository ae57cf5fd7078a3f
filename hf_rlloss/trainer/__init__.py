"""The trainer layer: TRL's GRPO trainers with their loss delegated to the loss layer.

Two trainers, each a TRL-style config/trainer pair at the top of this package, and their parts in subpackages:

- synchronous: `grpo_config` (`RLLossGRPOConfig`, TRL's `GRPOConfig` plus the `rl_loss:` block and the options TRL
  lacks) and `grpo_trainer` (`RLLossGRPOTrainer`, TRL's override points, each labelled with the TRL method it
  replaces); its parts in `sync/` (checkpoints, non-finite guard, dynamic sampling, old log-probs, SP data, saving);
- asynchronous: `async_grpo_config`, `async_grpo_trainer` (`RLLossAsyncGRPOConfig`, `RLLossAsyncGRPOTrainer`, TRL's
  experimental async trainer with the loss layer, imported on first use: `trl.experimental` warns on import); its
  parts in `async_/` (the HF-`generate` and vLLM rollout workers and the weight transfer for machines without a
  vLLM server or NCCL);
- shared by both: `common/` (forwards, LM head, reference model, engines, packing, SP batches, rollout recording,
  multimodal inputs, vLLM's CPU build made reloadable).

The layer imports TRL; it sits on the loss layer (`hf_rlloss.loss`) and the parallelism layer (`hf_rlloss.parallel`),
and of the recipe support only the Hub card helper. `docs/layout.md` maps every module.
"""

from .common.vllm_cpu import silence_trl_vllm_version_warning

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
