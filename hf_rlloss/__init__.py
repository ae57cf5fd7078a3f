"""hf_rlloss: a configurable RL loss layer (config → kwargs → context) for TRL and Accelerate.

Three layers, each importing only the ones below it: `hf_rlloss.parallel` (collectives, the SP mesh, split/gather,
Ulysses attention) ← `hf_rlloss.loss` (config, context and the loss terms; no TRL) ← `hf_rlloss.trainer` (the TRL
subclass). `hf_rlloss.recipe_support` serves the recipes. The public names are importable from here.
"""

from typing import TYPE_CHECKING

from .loss import (
    AGG_MODES,
    KL_TYPES,
    BaseRLLossConfig,
    BaseRLLossContext,
    BaseRLLossKwargs,
    GRPOLossConfig,
    GRPOLossContext,
    PolicyLossConfig,
    PolicyLossSpec,
    Reduction,
    RolloutImportanceSampling,
    accumulate_metrics,
    chunked_kept_logmass,
    chunked_logprobs,
    chunked_objective,
    compute_kl_loss_weight,
    compute_rollout_is,
    finalize_rollout_is_metrics,
    finalize_train_policy_metrics,
    get_policy_loss,
    kl_penalty,
    reduce_metrics,
    register_finalizer,
    register_metric,
    register_policy_loss,
    registered_policy_losses,
    train_policy_metrics,
)
from .parallel import sp_gather, sp_split

if TYPE_CHECKING:  # imported on first use (`__getattr__`); named here for type checkers and the API reference
    from .trainer.async_grpo_config import RLLossAsyncGRPOConfig
    from .trainer.async_grpo_trainer import RLLossAsyncGRPOTrainer
    from .trainer.grpo_config import RLLossGRPOConfig
    from .trainer.grpo_trainer import RLLossGRPOTrainer

__version__ = "0.2.0"


def __getattr__(name: str):
    # The trainer pulls in trl and transformers: import it on first use, so the loss layer stays light.
    if name in ("RLLossGRPOTrainer", "RLLossGRPOConfig", "RLLossAsyncGRPOTrainer", "RLLossAsyncGRPOConfig"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hf_rlloss' has no attribute {name!r}")


__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "BaseRLLossConfig",
    "BaseRLLossContext",
    "BaseRLLossKwargs",
    "GRPOLossConfig",
    "GRPOLossContext",
    "PolicyLossConfig",
    "PolicyLossSpec",
    "RLLossAsyncGRPOConfig",
    "RLLossAsyncGRPOTrainer",
    "RLLossGRPOConfig",
    "RLLossGRPOTrainer",
    "Reduction",
    "RolloutImportanceSampling",
    "accumulate_metrics",
    "chunked_kept_logmass",
    "chunked_logprobs",
    "chunked_objective",
    "compute_kl_loss_weight",
    "compute_rollout_is",
    "finalize_rollout_is_metrics",
    "finalize_train_policy_metrics",
    "get_policy_loss",
    "kl_penalty",
    "reduce_metrics",
    "register_finalizer",
    "register_metric",
    "register_policy_loss",
    "registered_policy_losses",
    "sp_gather",
    "sp_split",
    "train_policy_metrics",
]
