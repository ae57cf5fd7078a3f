"""Policy losses: one small pure function per loss, registered by name.

Every loss works on flat vectors of the *valid* tokens of a micro-batch (shape ``(N,)``) and returns
``(per_token_loss, indicators)``: the loss to minimise for each token, before any aggregation weight, and a dict of
0/1 per-token tensors (clipping events) that the context turns into counts. Aggregation over tokens and sequences
is not the loss's business: it is done by per-token weights (see :mod:`hf_rlloss.loss.aggregation`).

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
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .metrics import TRL_FAMILIES

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
            per-sequence mean (or sum, see `sequence_reduction`) the loss needs as ``seq_mean``; `None` for
            token-separable losses.
        default_agg_mode (`str`): aggregation used when the config leaves ``loss_agg_mode`` unset (the paper's).
        defaults (`dict`): values of unset ``policy_loss_cfg`` fields for this loss (e.g. GSPO's tiny clip ranges).
        sequence_reduction (`str`, defaults to `"mean"`): `"mean"` or `"sum"`, how `sequence_statistic` is reduced
            over each sequence (VESPO's weight is a function of the *sum* of the log-ratios).
        absorbs_rollout_is (`bool`, defaults to `False`): the rollout IS weights enter the loss through its sequence
            statistic (called with ``rollout_is_weights=...``), instead of multiplying the per-token loss.
        rollout_is_per_sequence (`bool`, defaults to `False`): the objective is per sequence (GMPO), so its rollout
            IS weight is one per sequence: the geometric mean ``exp(mean_t log w_t)`` of the token weights over the
            sequence's valid tokens (verl's definition), folded by ``build_batches``. Sequence- and geometric-level
            weights are constant over a sequence, so they are unchanged.
        trl_metrics (`str`, *optional*): the TRL `loss_type` whose loss-specific metrics this loss logs under TRL's
            names (see `hf_rlloss.loss.metrics.TRL_FAMILIES`): `"clip"` (`clip_ratio/*`), `"cispo"`
            (`cispo_clip_ratio`) or `"vespo"` (`vespo/phi_seq_mean`); `None` for a loss TRL does not have.
        trl_sequence_level (`bool`, defaults to `False`): TRL's `importance_sampling_level="sequence"` form, whose
            metrics TRL averages over sequences instead of tokens.
    """

    fn: PolicyLossFn
    sequence_statistic: Callable[..., torch.Tensor] | None = None
    default_agg_mode: str = "token-mean"
    defaults: dict[str, Any] = field(default_factory=dict)
    sequence_reduction: str = "mean"
    absorbs_rollout_is: bool = False
    rollout_is_per_sequence: bool = False
    trl_metrics: str | None = None
    trl_sequence_level: bool = False


_REGISTRY: dict[str, PolicyLossSpec] = {}


def register_policy_loss(
    name: str,
    *,
    sequence_statistic: Callable[..., torch.Tensor] | None = None,
    default_agg_mode: str = "token-mean",
    defaults: dict[str, Any] | None = None,
    sequence_reduction: str = "mean",
    absorbs_rollout_is: bool = False,
    rollout_is_per_sequence: bool = False,
    trl_metrics: str | None = None,
    trl_sequence_level: bool = False,
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` (see :class:`PolicyLossSpec` for the arguments)."""
    if default_agg_mode not in AGG_MODES:
        raise ValueError(f"default_agg_mode={default_agg_mode!r}; allowed: {', '.join(AGG_MODES)}")
    if sequence_reduction not in ("mean", "sum"):
        raise ValueError(f"sequence_reduction={sequence_reduction!r}; allowed: mean, sum")
    if trl_metrics is not None and trl_metrics not in TRL_FAMILIES:
        raise ValueError(f"trl_metrics={trl_metrics!r}; allowed: None, {', '.join(TRL_FAMILIES)}")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        _REGISTRY[name] = PolicyLossSpec(
            fn,
            sequence_statistic,
            default_agg_mode,
            dict(defaults or {}),
            sequence_reduction,
            absorbs_rollout_is,
            rollout_is_per_sequence,
            trl_metrics,
            trl_sequence_level,
        )
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
    """``max(−A·r', −A·clip(r, 1−ε_low, 1+ε_high))`` and which branch was chosen.

    ``r' = min(r, δ)`` with ``δ = cfg.delta`` (INTELLECT-2's two-sided clip, TRL's ``delta``), else ``r' = r``.
    """
    unclipped = -advantages * (ratio if cfg.delta is None else ratio.clamp(max=cfg.delta))
    clipped = -advantages * ratio.clamp(1 - cfg.cliprange_low, 1 + cfg.cliprange_high)
    clip_active = (clipped > unclipped).detach()
    indicators = {"clip_low": clip_active & (advantages < 0), "clip_high": clip_active & (advantages > 0)}
    return torch.maximum(unclipped, clipped), indicators


@register_policy_loss("vanilla", defaults={"cliprange_low": 0.2, "cliprange_high": 0.2}, trl_metrics="clip")
def vanilla_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """Dual-clip PPO (Ye et al. 2019, https://arxiv.org/abs/1912.09729) with asymmetric clip ranges (DAPO).

    ``ℓ = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))``, and for ``A < 0`` additionally ``min(ℓ, −c·A)`` with
    ``c = clip_ratio_c`` (none when `None`). ``log r`` is clamped to ``[log_prob_diff_min, log_prob_diff_max]``.
    With ``delta`` set, the unclipped branch uses ``min(r, δ)`` (INTELLECT-2, https://arxiv.org/abs/2505.07291):
    TRL's ``-min(min(r, δ)·A, clip(r)·A)``.
    """
    ratio = _log_ratio(logprobs, old_logprobs, cfg).exp()  # (N,)
    loss, indicators = _ppo_clip(ratio, advantages, cfg)
    if cfg.clip_ratio_c is None:
        indicators["dual_clip"] = torch.zeros_like(advantages, dtype=torch.bool)
        return loss, indicators
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
    trl_metrics="clip",
    trl_sequence_level=True,
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


@register_policy_loss("cispo", defaults={"cliprange_low": 0.2, "cliprange_high": 0.2}, trl_metrics="cispo")
def cispo_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): ``ℓ = −sg(clip(r, 1−ε_low, 1+ε_high))·A·log π_θ``.

    The IS weight is clipped, never the gradient, so every token keeps contributing. The paper disables the lower
    bound: ``cliprange_low=1`` does that exactly (a floor of 0). TRL's absolute cap ``ε_max`` is
    ``1 + cliprange_high``; for CISPO, ``cliprange_high`` may be negative (a cap below 1, as TRL allows).
    """
    ratio = _log_ratio(logprobs, old_logprobs, cfg).exp()
    return _cispo(ratio, logprobs, advantages, cfg)


def _cispo(ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, cfg) -> LossOutput:
    """``−sg(clip(w, 1−ε_low, 1+ε_high))·A·log π_θ`` for an IS weight ``w`` (token or sequence level)."""
    ratio = ratio.detach()
    clipped_ratio = ratio.clamp(1 - cfg.cliprange_low, 1 + cfg.cliprange_high)
    indicators = {"clip_low": ratio < 1 - cfg.cliprange_low, "clip_high": ratio > 1 + cfg.cliprange_high}
    return -clipped_ratio * advantages * logprobs, indicators


@register_policy_loss(
    "cispo_seq",
    sequence_statistic=_gspo_statistic,
    defaults={"cliprange_low": 0.2, "cliprange_high": 0.2},
    trl_metrics="cispo",
    trl_sequence_level=True,
)
def cispo_seq_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """Sequence-level CISPO (TRL's ``loss_type="cispo"`` with ``importance_sampling_level="sequence"``).

    ``ℓ_t = −sg(clip(s_i, 1−ε_low, 1+ε_high))·A·log π_θ(o_t)`` with ``log s_i = mean_t log r_t`` (GSPO's sequence
    ratio, clamped to ``[log_prob_diff_min, log_prob_diff_max]``). The weight is a constant, so the loss stays
    token-separable given ``s_i``: well defined under any aggregation and sequence-parallel split.
    """
    seq_ratio = seq_mean.clamp(cfg.log_prob_diff_min, cfg.log_prob_diff_max).exp()
    return _cispo(seq_ratio, logprobs, advantages, cfg)


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
    return _sapo_gate(_log_ratio(logprobs, old_logprobs, cfg).exp(), advantages, cfg)


def _sapo_gate(ratio: torch.Tensor, advantages: torch.Tensor, cfg) -> LossOutput:
    tau = torch.where(advantages > 0, cfg.tau_pos, cfg.tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    return -gate * advantages, {}


@register_policy_loss("sapo_seq", sequence_statistic=_gspo_statistic, default_agg_mode="seq-mean-token-mean")
def sapo_seq_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """Sequence-level SAPO (TRL's ``loss_type="sapo"`` with ``importance_sampling_level="sequence"``).

    SAPO's gate on GSPO's token form of the sequence ratio ``s_t = sg(s_i)·π_θ(o_t)/sg(π_θ(o_t))``, ``log s_i =
    mean_t log r_t`` (clamped to ``[log_prob_diff_min, log_prob_diff_max]``): every token's value is
    ``−σ(τ·(s_i − 1))·(4/τ)·A`` and, under ``seq-mean-token-mean`` (SAPO's), the gradient is that of the sequence
    objective exactly, as for GSPO.
    """
    log_seq_ratio = (seq_mean + logprobs - logprobs.detach()).clamp(cfg.log_prob_diff_min, cfg.log_prob_diff_max)
    return _sapo_gate(log_seq_ratio.exp(), advantages, cfg)


_VESPO_LOG_W_MIN = math.log(1e-8)  # TRL's (and the VESPO reference's) floor on the sequence log-weight


def _vespo_statistic(logprobs, old_logprobs, advantages, cfg, rollout_is_weights=None) -> torch.Tensor:
    # Summed over the sequence: log w_i = Σ_t clamp(log r_t, ±20) (+ Σ_t log of the rollout IS weights).
    stat = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    if rollout_is_weights is not None:
        stat = stat + rollout_is_weights.log().clamp(_VESPO_LOG_W_MIN, 20.0)
    return stat


@register_policy_loss(
    "vespo",
    sequence_statistic=_vespo_statistic,
    sequence_reduction="sum",
    absorbs_rollout_is=True,
    trl_metrics="vespo",
    trl_sequence_level=True,
)
def vespo_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """VESPO (https://huggingface.co/papers/2602.10693) as TRL's ``vespo``: ``ℓ_t = −sg(φ(w_i))·A·log π_θ(o_t)``.

    ``φ(w) = e^λ·w^k·e^{−λw}`` (a gamma kernel with ``φ(1) = 1``) of the sequence IS weight
    ``w_i = exp(clamp(Σ_t log r_t, log 1e-8, 20))``, with ``(k, λ) = (vespo_k_pos, vespo_lambda_pos)`` where
    ``A ≥ 0`` and ``(vespo_k_neg, vespo_lambda_neg)`` otherwise. Here ``seq_mean`` is the per-sequence *sum*. The
    rollout IS weights (e.g. TRL's vLLM correction) multiply ``w_i`` instead of the loss, as in TRL.
    """
    log_w = seq_mean.clamp(_VESPO_LOG_W_MIN, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).to(log_w.dtype)
    phi = (lam + k * log_w - lam * log_w.exp()).exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()
    return -phi * advantages * logprobs, {"phi": phi}


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
    rollout_is_per_sequence=True,
)
def geo_mean_loss(logprobs, old_logprobs, advantages, cfg, seq_mean=None) -> LossOutput:
    """GMPO (Zhao et al. 2025, https://arxiv.org/abs/2507.20673): ``ℓ_i = −A_i·exp(mean_t clip(log r_t))``.

    The clip range is in log space (``cliprange_low/high`` = 0.4 gives the paper's ``(e^−0.4, e^0.4)``). Written per
    token as ``−A·sg(R_i)·(1 + q_t − sg(q_t))``, ``q_t`` the clipped log-ratio: every token's value is ``ℓ_i`` and the
    gradient of the ``seq-mean-token-mean`` aggregate equals that of the sequence objective exactly.

    Rollout IS weights multiply ``ℓ_i`` once per sequence, as in verl: token-level weights are folded into their
    geometric mean over the sequence's valid tokens, ``exp(mean_t log w_t)`` (``rollout_is_per_sequence``).
    """
    q = _gmpo_clipped_log_ratio(logprobs, old_logprobs, advantages, cfg)
    seq_ratio = seq_mean.exp()
    log_ratio = (logprobs - old_logprobs).detach()
    indicators = {"clip_low": q.detach() > log_ratio, "clip_high": q.detach() < log_ratio}
    return -advantages * seq_ratio * (1 + q - q.detach()), indicators
