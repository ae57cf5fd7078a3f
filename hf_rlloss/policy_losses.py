"""Policy losses: one small pure function per loss, registered by name.

Every loss works on flat vectors of the *valid* tokens of a micro-batch (shape ``(N,)``) and returns
``(per_token_loss, indicators)``: the loss to minimise for each token, before any aggregation weight, and a dict of
0/1 per-token tensors (clipping events) that the context turns into counts. Aggregation over tokens and sequences
is not the loss's business: it is done by per-token weights (see :mod:`hf_rlloss.aggregation`).

Sequence-level losses (GSPO, GMPO) need a per-sequence mean of a per-token statistic before any token's loss can be
computed. They declare that statistic (``sequence_statistic``); the context computes its mean over each sequence
(across sequence-parallel shards too) and passes it back per token as ``seq_mean``, a detached constant. Each loss is
written so that the gradient is still exact: with its paper's aggregation (``seq-mean-token-mean``) the result equals
the sequence-level objective in value and gradient (see the GSPO and GMPO docstrings).

Formulas follow verl's ``core_algos.py`` (https://github.com/volcengine/verl). Notation: ``r = π_θ/π_old`` per token,
``A`` the advantage, ``ε_low``/``ε_high`` the clip ranges, ``sg`` stop-gradient.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]
PolicyLossFn = Callable[..., LossOutput]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered policy loss.

    Args:
        fn (`Callable`): ``fn(logprobs, old_logprobs, advantages, cfg, seq_mean=None)`` returning
            ``(per_token_loss, indicators)``.
        sequence_statistic (`Callable` or `None`): ``stat(logprobs, old_logprobs, advantages, cfg) -> (N,)``, whose
            per-sequence mean the loss needs as ``seq_mean``; `None` for token-separable losses.
        default_agg_mode (`str`): aggregation used when the config leaves ``loss_agg_mode`` unset (the paper's).
        defaults (`dict`): values of unset ``policy_loss_cfg`` fields for this loss (e.g. GSPO's tiny clip ranges).
    """

    fn: PolicyLossFn
    sequence_statistic: Callable[..., torch.Tensor] | None = None
    default_agg_mode: str = "token-mean"
    defaults: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, PolicyLossSpec] = {}


def register_policy_loss(
    name: str,
    *,
    sequence_statistic: Callable[..., torch.Tensor] | None = None,
    default_agg_mode: str = "token-mean",
    defaults: dict[str, Any] | None = None,
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` (see :class:`PolicyLossSpec` for the arguments)."""
    if default_agg_mode not in AGG_MODES:
        raise ValueError(f"default_agg_mode={default_agg_mode!r}; allowed: {', '.join(AGG_MODES)}")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        _REGISTRY[name] = PolicyLossSpec(fn, sequence_statistic, default_agg_mode, dict(defaults or {}))
        return fn

    return decorator


def registered_policy_losses() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_policy_loss(name: str) -> PolicyLossSpec:
    """The spec registered as ``name``, or the function at the dotted import path ``name`` (``"pkg.mod.fn"``).

    A dotted path may point at a :class:`PolicyLossSpec` or at a plain token-level loss function.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"policy_loss_cfg.loss_type={name!r}: cannot import it ({err})") from err
        return obj if isinstance(obj, PolicyLossSpec) else PolicyLossSpec(obj)
    raise ValueError(
        f"policy_loss_cfg.loss_type={name!r} is not registered; allowed: {', '.join(_REGISTRY)}, "
        "or a dotted import path to a loss function"
    )


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, cfg) -> torch.Tensor:
    # The clamp keeps exp() finite; where it is active the token's gradient is zero, as in verl and XTuner.
    return (logprobs - old_logprobs).clamp(cfg.log_prob_diff_min, cfg.log_prob_diff_max)


def _ppo_clip(ratio: torch.Tensor, advantages: torch.Tensor, cfg) -> LossOutput:
    """``max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))`` and which branch was chosen."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cfg.cliprange_low, 1 + cfg.cliprange_high)
    clip_active = (clipped > unclipped).detach()
    indicators = {"clip_low": clip_active & (advantages < 0), "clip_high": clip_active & (advantages > 0)}
    return torch.maximum(unclipped, clipped), indicators


@register_policy_loss("vanilla", defaults={"cliprange_low": 0.2, "cliprange_high": 0.2})
def vanilla_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """Dual-clip PPO (Ye et al. 2019, https://arxiv.org/abs/1912.09729) with asymmetric clip ranges (DAPO).

    ``ℓ = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))``, and for ``A < 0`` additionally ``min(ℓ, −c·A)`` with
    ``c = clip_ratio_c``. ``log r`` is clamped to ``[log_prob_diff_min, log_prob_diff_max]``.
    """
    ratio = _log_ratio(logprobs, old_logprobs, cfg).exp()  # (N,)
    loss, indicators = _ppo_clip(ratio, advantages, cfg)
    dual_bound = -cfg.clip_ratio_c * advantages
    dual_active = ((advantages < 0) & (dual_bound < loss)).detach()
    indicators["dual_clip"] = dual_active
    return torch.where(dual_active, dual_bound, loss), indicators


def _gspo_statistic(logprobs, old_logprobs, advantages, cfg) -> torch.Tensor:
    return logprobs - old_logprobs


@register_policy_loss(
    "gspo",
    sequence_statistic=_gspo_statistic,
    default_agg_mode="seq-mean-token-mean",
    defaults={"cliprange_low": 3e-4, "cliprange_high": 4e-4},
)
def gspo_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071) in its token form, as verl.

    ``s_t = sg(s_i) · π_θ(o_t)/sg(π_θ(o_t))`` with ``log s_i = mean_t log r_t`` over sequence ``i`` (clamped ≤ 10),
    then the PPO clip on ``s_t``. Its value is ``s_i`` on every token of the sequence and its gradient w.r.t.
    ``log π_θ(o_t)`` is ``s_i``; under ``seq-mean-token-mean`` this is exactly GSPO's sequence objective, and it also
    accepts per-token advantages.
    """
    log_seq_ratio = (seq_mean + logprobs - logprobs.detach()).clamp(max=10.0)
    return _ppo_clip(log_seq_ratio.exp(), advantages, cfg)


@register_policy_loss("cispo", defaults={"cliprange_low": 0.2, "cliprange_high": 0.2})
def cispo_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): ``ℓ = −sg(clip(r, 1−ε_low, 1+ε_high))·A·log π_θ``.

    The IS weight is clipped, never the gradient, so every token keeps contributing. The paper effectively disables
    the lower bound: set ``cliprange_low`` close to 1 for that. TRL's absolute cap ``ε_max`` is ``1 + cliprange_high``.
    """
    ratio = _log_ratio(logprobs, old_logprobs, cfg).exp()
    clipped_ratio = ratio.clamp(1 - cfg.cliprange_low, 1 + cfg.cliprange_high).detach()
    ratio = ratio.detach()
    indicators = {"clip_low": ratio < 1 - cfg.cliprange_low, "clip_high": ratio > 1 + cfg.cliprange_high}
    return -clipped_ratio * advantages * logprobs, indicators


@register_policy_loss("gpg")
def gpg_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """Plain policy gradient (GPG, https://arxiv.org/abs/2504.02546; REINFORCE): ``ℓ = −A·log π_θ``."""
    return -advantages * logprobs, {}


@register_policy_loss("sapo", default_agg_mode="seq-mean-token-mean")
def sapo_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """SAPO (https://arxiv.org/abs/2511.20347): a soft gate in place of the hard clip.

    ``ℓ = −σ(τ·(r − 1))·(4/τ)·A`` with ``τ = tau_pos`` where ``A > 0`` and ``tau_neg`` otherwise. Its gradient at
    ``r = 1`` equals the unclipped PPO gradient.
    """
    ratio = _log_ratio(logprobs, old_logprobs, cfg).exp()
    tau = torch.where(advantages > 0, cfg.tau_pos, cfg.tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    return -gate * advantages, {}


def _gmpo_clipped_log_ratio(logprobs, old_logprobs, advantages, cfg) -> torch.Tensor:
    # Clip log r on the side that the advantage's sign makes pessimistic: sgn(A)·min(sgn(A)·x, sgn(A)·clip(x)).
    log_ratio = logprobs - old_logprobs
    sign = torch.sign(advantages)
    clipped = log_ratio.clamp(-cfg.cliprange_low, cfg.cliprange_high)
    return sign * torch.minimum(sign * log_ratio, sign * clipped)


@register_policy_loss(
    "geo_mean",
    sequence_statistic=_gmpo_clipped_log_ratio,
    default_agg_mode="seq-mean-token-mean",
    defaults={"cliprange_low": 0.4, "cliprange_high": 0.4},
)
def geo_mean_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """GMPO (Zhao et al. 2025, https://arxiv.org/abs/2507.20673): ``ℓ_i = −A_i·exp(mean_t clip(log r_t))``.

    The clip range is in log space (``cliprange_low/high`` = 0.4 gives the paper's ``(e^−0.4, e^0.4)``). Written per
    token as ``−A·sg(R_i)·(1 + q_t − sg(q_t))``, ``q_t`` the clipped log-ratio: every token's value is ``ℓ_i`` and the
    gradient of the ``seq-mean-token-mean`` aggregate equals that of the sequence objective exactly.
    """
    q = _gmpo_clipped_log_ratio(logprobs, old_logprobs, advantages, cfg)
    seq_ratio = seq_mean.exp()
    log_ratio = (logprobs - old_logprobs).detach()
    indicators = {"clip_low": q.detach() > log_ratio, "clip_high": q.detach() < log_ratio}
    return -advantages * seq_ratio * (1 + q - q.detach()), indicators
