"""The loss layer: config → kwargs → context, on tensors, without TRL.

Three stages, a module each: a pydantic config (`config`) builds, for each micro-batch, loss kwargs (`kwargs`: the
validated per-token tensors, split for SP) and a loss context (`context`: the base; `grpo_context`: the GRPO family);
the contexts of one optimizer step are normalized together. What the context computes is split one concept per file:
the policy losses (`policy_losses`), the KL penalty (`kl`), the aggregation weights (`aggregation`), rollout importance
sampling (`rollout_is`), M2PO's second-moment mask (`second_moment`), the chunked LM-head log-probs and objective
(`chunked_logprobs`), the train-policy metrics and their cross-rank reduction (`metrics`), and the table of per-token
fields (`fields`).

It sits on the parallelism layer (`hf_rlloss.parallel`: collectives, SP split/gather, since a context under sequence
parallelism keeps only its shard of each field) and imports neither TRL nor the trainer, so it can be used with any
training loop.
"""

from .chunked_logprobs import chunked_kept_logmass, chunked_logprobs, chunked_objective
from .config import BaseRLLossConfig, GRPOLossConfig, PolicyLossConfig
from .context import BaseRLLossContext
from .grpo_context import GRPOLossContext, train_policy_metrics
from .kl import KL_TYPES, compute_kl_loss_weight, kl_penalty
from .kwargs import BaseRLLossKwargs
from .metrics import (
    Reduction,
    accumulate_metrics,
    finalize_train_policy_metrics,
    reduce_metrics,
    register_finalizer,
    register_metric,
)
from .policy_losses import AGG_MODES, PolicyLossSpec, get_policy_loss, register_policy_loss, registered_policy_losses
from .rollout_is import RolloutImportanceSampling, compute_rollout_is, finalize_rollout_is_metrics

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
    "train_policy_metrics",
]
