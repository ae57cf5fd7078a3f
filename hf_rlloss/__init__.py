"""hf_rlloss: a configurable RL loss layer (config → kwargs → context) for TRL and Accelerate."""

from .chunked_logprobs import chunked_kept_logmass, chunked_logprobs, chunked_objective
from .config import BaseRLLossConfig, GRPOLossConfig, PolicyLossConfig
from .context import BaseRLLossContext, BaseRLLossKwargs, GRPOLossContext, train_policy_metrics
from .kl import KL_TYPES, compute_kl_loss_weight, kl_penalty
from .metrics import Reduction, accumulate_metrics, finalize_train_policy_metrics, reduce_metrics, register_metric
from .policy_losses import AGG_MODES, PolicyLossSpec, get_policy_loss, register_policy_loss, registered_policy_losses
from .rollout_is import RolloutImportanceSampling, compute_rollout_is, finalize_rollout_is_metrics
from .sequence_parallel import sp_gather, sp_split

__version__ = "0.1.0"


def __getattr__(name: str):
    # The trainer pulls in trl and transformers: import it on first use, so the loss layer stays light.
    if name == "RLLossGRPOTrainer":
        from .trainer import RLLossGRPOTrainer

        return RLLossGRPOTrainer
    if name == "RLLossGRPOConfig":
        from .trainer_config import RLLossGRPOConfig

        return RLLossGRPOConfig
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
    "register_metric",
    "register_policy_loss",
    "registered_policy_losses",
    "sp_gather",
    "sp_split",
    "train_policy_metrics",
]
