"""Rollout importance sampling: correct (and measure) the mismatch between the rollout engine and the trainer.

Tokens are sampled by the rollout engine (vLLM, SGLang, ...) with log-probs ``log μ``, while the loss uses the
trainer's log-probs of the policy before the update, ``log π_old``. Their per-token log ratio

    δ_t = log π_old(o_t) − log μ(o_t),        ρ_t = exp(δ_t) = π_old / μ

is the rollout importance sampling (IS) ratio. :func:`compute_rollout_is` turns it into constant per-token weights
(multiplied into the policy loss) and a keep-mask (rejected tokens get ``ignore_idx`` labels), and emits the sums,
counts and extrema from which :func:`finalize_rollout_is_metrics` computes global mismatch diagnostics.

Levels (every log ratio is clamped to ``±20`` before ``exp``, the *safety bound*):

| level | weight of every valid token ``t`` of sequence ``i`` |
|---|---|
| ``token`` | ``ρ_t = exp(clamp(δ_t))`` |
| ``sequence`` | ``ρ_i = exp(clamp(Σ_t δ_t))``: the product of the token ratios (unbiased, high variance) |
| ``geometric`` | ``ρ_i = exp(clamp(mean_t δ_t))``: their geometric mean (length-normalized) |

Modes: ``truncate`` (TIS) clamps the weight to ``upper`` (and to ``lower`` too with ``truncate_lower=True``, as
XTuner does); ``mask`` (MIS / IcePop) rejects the tokens (token level) or whole sequences (sequence and geometric
levels) whose ratio lies outside ``[mask_lower, mask_upper]``, keeping the ratio itself as the weight; ``both`` does
both. The veto rejects a whole sequence as soon as one of its valid tokens has ``ρ_t`` (unclamped) outside
``[veto_lower, veto_upper]``, at every level. Valid tokens whose old or rollout log-prob is NaN or ±inf are always
rejected, counted in ``rollout_is/nonfinite_tokens``, and left out of every sum below, as if they were masked.

Metrics. ``V`` is the set of valid finite tokens, ``S`` the set of sequences with at least one token in ``V``
(padding rows and empty sequences are not sequences here). :func:`compute_rollout_is` emits sums, counts and extrema
over them (the ``rollout_is_acc/*`` keys); every logged key, its formula and what it is a mean of are declared once,
in `hf_rlloss.loss.metrics.METRICS` (table: `hf_rlloss.loss.metrics.metrics_table()`, in docs/rollout_is.md).
Token-weighted metrics average over ``V``, sequence-weighted ones over ``S``, both over every micro-batch and rank of
the step; a metric whose count is 0 is ``0.0``. Metrics that need the bounds (``fraction_*``, ``seq_fraction_*``),
the mask band (``masked_fraction``, ``seq_masked_fraction``) or the veto (``veto_fraction``,
``catastrophic_token_fraction``) are emitted only when it is configured. Weights are 0 at rejected tokens; all
statistics use every valid finite token, rejected or not.

The ``mismatch/*`` names are XTuner's; its ``mismatch/rollout_is_<x>`` keys (logged there as
``rollout_is/mismatch/rollout_is_<x>``) are ``rollout_is/<x>`` here. Differences from XTuner v1 (its bugs fixed):
mismatch metrics are per sequence, not per pack, and true global means rather than means of per-pack means; padding
rows and empty sequences never enter any metric; ``fraction_high``/``_low`` are token-weighted at every level
(``seq_fraction_*`` are the sequence-weighted ones); the k3 estimate is clamped; bounds are named fields, validated
at construction (``lower < upper``) instead of an ``(upper, lower)`` tuple; truncation is upper-only unless
``truncate_lower=True``; the inputs are never modified.
``mismatch/mismatch_ppl_ratio`` is XTuner's training ppl / rollout ppl (``exp(d_i)``), averaged over sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, model_validator
from torch.distributed.device_mesh import DeviceMesh

from ..parallel.collectives import all_reduce
from ..parallel.sequence import on_first_sp_rank, sp_group, sp_world_size
from .metrics import (
    IS_MASK_TOKENS,
    IS_NONFINITE_TOKENS,
    IS_SEQUENCES,
    IS_VALID_TOKENS,
    ROLLOUT_IS_ACC,
    finalize_reduced,
    reduce_metrics,
)

SAFETY_BOUND = 20.0
"""Every log ratio is clamped to ``[-SAFETY_BOUND, SAFETY_BOUND]`` before ``exp``."""


class RolloutImportanceSampling(BaseModel):
    """Rollout importance sampling: weights ``π_old / μ`` and rejection of mismatched tokens or sequences.

    With `upper` unset (the default) nothing is weighted or rejected, apart from tokens with non-finite log-probs:
    only the mismatch metrics are computed (*metrics-only mode*). See the module docstring for the formulas.

    Args:
        level (`str`, *optional*, defaults to `"token"`): `"token"` (per-token ratio), `"sequence"` (product of the
            ratios of the sequence) or `"geometric"` (their geometric mean).
        mode (`str`, *optional*, defaults to `"truncate"`): `"truncate"` clamps the weights (TIS), `"mask"` rejects
            what lies outside `[mask_lower, mask_upper]` and keeps the ratio as the weight (MIS / IcePop), `"both"`
            rejects and then clamps.
        lower (`float`, *optional*): lower bound of the weight, > 0. Defaults to `1 / upper` (so `upper` must then be
            > 1). Used for the `low` metrics, `std`/`eff_sample_size`, the default mask band, and truncation only with
            `truncate_lower=True`.
        upper (`float`, *optional*): upper bound of the weight, > `lower`. Setting it turns weighting and rejection on.
        mask_lower (`float`, *optional*): lower end of the acceptance band (`mask`/`both`); defaults to `lower`.
        mask_upper (`float`, *optional*): upper end of the acceptance band (`mask`/`both`); defaults to `upper`.
        veto_lower (`float`, *optional*): a sequence with a valid token whose `ρ_t < veto_lower` is rejected whole
            (verl used 1e-4); > 0. Unset: no lower veto.
        veto_upper (`float`, *optional*): a sequence with a valid token whose `ρ_t > veto_upper` is rejected whole;
            > `veto_lower`. Unset: no upper veto.
        truncate_lower (`bool`, *optional*, defaults to `False`): truncation clamps to `[lower, upper]` instead of
            only to `upper` (verl TIS). `True` reproduces XTuner v1.
        m2_threshold (`float`, *optional*): M2PO's second-moment trust region τ > 0 (the paper uses 0.04): before the
            step's denominators are counted, the tokens with the largest `δ_t²` are rejected until the mean `δ²` of
            the step's kept tokens, over every micro-batch and rank, is at most τ (`hf_rlloss.loss.second_moment`).
            Token-wise at every level; needs `upper` (the kept tokens are weighted as configured: the paper's
            untruncated ratio is `upper` large, e.g. 1000). Unset: no second-moment mask.

    Example:

    ```python
    >>> RolloutImportanceSampling(level="token", mode="truncate", upper=2.0)  # TIS, w = min(ρ, 2)
    >>> RolloutImportanceSampling(level="geometric", mode="mask", lower=0.5, upper=2.0, veto_lower=1e-4)
    >>> RolloutImportanceSampling(level="token", upper=1000.0, m2_threshold=0.04)  # M2PO
    >>> RolloutImportanceSampling()  # metrics only
    ```
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    level: Literal["token", "sequence", "geometric"] = "token"
    mode: Literal["truncate", "mask", "both"] = "truncate"
    lower: float | None = None
    upper: float | None = None
    mask_lower: float | None = None
    mask_upper: float | None = None
    veto_lower: float | None = None
    veto_upper: float | None = None
    truncate_lower: bool = False
    m2_threshold: float | None = None

    @model_validator(mode="after")
    def _validate(self) -> RolloutImportanceSampling:
        if self.m2_threshold is not None and self.m2_threshold <= 0:
            raise ValueError(f"m2_threshold={self.m2_threshold} must be > 0 (a bound on the mean squared log-ratio)")
        for name in ("lower", "upper", "mask_lower", "mask_upper", "veto_lower", "veto_upper"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}={value} must be > 0 (it bounds a ratio of probabilities)")
        if self.upper is None:
            names = ("lower", "mask_lower", "mask_upper", "veto_lower", "veto_upper", "m2_threshold")
            needs = [n for n in names if getattr(self, n)]
            if needs:
                raise ValueError(
                    f"{', '.join(needs)} set without upper: set upper to turn rollout IS on, or unset them for "
                    "metrics-only mode"
                )
            return self
        if self.lower is None and self.upper <= 1:
            raise ValueError(f"upper={self.upper} must be > 1 when lower is unset (lower defaults to 1/upper)")
        if self.lower is not None and self.lower >= self.upper:
            raise ValueError(f"lower={self.lower} must be < upper={self.upper}")
        if self.mode == "truncate" and (self.mask_lower is not None or self.mask_upper is not None):
            raise ValueError("mask_lower/mask_upper are only used with mode='mask' or mode='both', not 'truncate'")
        if self.mode != "truncate":
            low, high = self.mask_bounds
            if low >= high:
                raise ValueError(
                    f"mask_lower={low} must be < mask_upper={high} (mask_lower defaults to lower, mask_upper to upper)"
                )
        if self.veto_lower is not None and self.veto_upper is not None and self.veto_lower >= self.veto_upper:
            raise ValueError(f"veto_lower={self.veto_lower} must be < veto_upper={self.veto_upper}")
        return self

    @property
    def enabled(self) -> bool:
        """Whether weights and rejection are active (`upper` is set); otherwise metrics only."""
        return self.upper is not None

    @property
    def bounds(self) -> tuple[float, float] | None:
        """`(lower, upper)` in effect (`lower` defaults to `1 / upper`), or `None` in metrics-only mode."""
        if self.upper is None:
            return None
        return (self.lower if self.lower is not None else 1.0 / self.upper), self.upper

    @property
    def mask_bounds(self) -> tuple[float, float] | None:
        """The acceptance band `(mask_lower, mask_upper)` in effect, or `None` when nothing is masked."""
        if self.upper is None or self.mode == "truncate":
            return None
        lower, upper = self.bounds
        return (
            self.mask_lower if self.mask_lower is not None else lower,
            self.mask_upper if self.mask_upper is not None else upper,
        )

    @property
    def has_veto(self) -> bool:
        return self.veto_lower is not None or self.veto_upper is not None

    @classmethod
    def from_xtuner(
        cls,
        rollout_is_level: str = "token",
        rollout_is_mode: str = "truncate",
        rollout_is_threshold: tuple[float, float] | None = None,
        rollout_is_mask_threshold: tuple[float, float] | None = None,
        rollout_is_veto_threshold: tuple[float, float] | None = None,
    ) -> RolloutImportanceSampling:
        """The config equivalent to XTuner v1's, whose thresholds are `(upper, lower)` tuples (two-sided clamp).

        A veto bound of 0 (XTuner's "never") becomes unset.
        """
        kwargs: dict[str, Any] = {"level": rollout_is_level, "mode": rollout_is_mode, "truncate_lower": True}
        if rollout_is_threshold is not None:
            kwargs["upper"], kwargs["lower"] = rollout_is_threshold
        if rollout_is_mask_threshold is not None and rollout_is_mode != "truncate":
            kwargs["mask_upper"], kwargs["mask_lower"] = rollout_is_mask_threshold
        if rollout_is_veto_threshold is not None:
            upper, lower = rollout_is_veto_threshold
            kwargs["veto_upper"] = upper if upper and upper > 0 else None
            kwargs["veto_lower"] = lower if lower and lower > 0 else None
        return cls(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# compute_rollout_is, in stages: inputs checked → tokens of V → per-sequence sums → ratios and keep → weights →
# metrics. The metric keys and how they are finalized are declared in `hf_rlloss.loss.metrics`.

# Per-sequence columns summed with one index_add_ (and one all-reduce over the SP group), by name.
_SEQ_COLUMNS = ("tokens", "mask_tokens", "delta", "old", "rollout", "rho", "catastrophic", "outside_band")


@dataclass
class _Tokens:
    """The valid tokens with finite log-probs (the set V), flat, at the flat positions `pos` of the micro-batch."""

    mask: torch.Tensor  # (B·T,) bool: every valid token, finite or not
    pos: torch.Tensor  # (N,) flat positions of V
    ids: torch.Tensor  # (N,) sequence of each token
    mask_ids: torch.Tensor  # (M,) sequence of each valid token, finite or not
    old: torch.Tensor  # (N,) float64 log π_old
    rollout: torch.Tensor  # (N,) float64 log μ
    delta: torch.Tensor  # (N,) δ = log π_old − log μ
    clamped: torch.Tensor  # (N,) δ̂ = clamp(δ, ±SAFETY_BOUND)
    rho: torch.Tensor  # (N,) ρ_t = exp(δ̂)
    catastrophic: torch.Tensor  # (N,) bool: ρ_t (unclamped) outside the veto bounds
    outside_band: torch.Tensor  # (N,) bool: ρ_t outside the mask band (token level only)


@dataclass
class _Decision:
    """The level's ratio and what is rejected: per token of V and per sequence."""

    rho: torch.Tensor  # (N,) ρ of each token: ρ_t, or its sequence's ρ_i
    seq_rho: torch.Tensor  # (S,) s_i
    keep: torch.Tensor  # (N,) bool
    masked: torch.Tensor  # (N,) bool: rejected by the mask band
    seq_masked: torch.Tensor  # (S,) bool
    vetoed: torch.Tensor  # (S,) bool


def _check_inputs(named: dict[str, torch.Tensor | None], mask: torch.Tensor, seq_ids: torch.Tensor) -> None:
    shape = tuple(mask.shape)
    if len(shape) != 2:
        raise ValueError(f"mask must be 2-D (B, T); got shape {shape}")
    for name, value in named.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)} but mask has shape {shape}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor; got {mask.dtype}")
    if seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool:
        raise ValueError(f"seq_ids must be an integer tensor; got {seq_ids.dtype}")


def _valid_finite_tokens(
    cfg: RolloutImportanceSampling, old_logprobs, rollout_logprobs, mask, seq_ids, num_sequences: int
) -> _Tokens:
    """Gather V (valid tokens whose old and rollout log-probs are finite) and their token-level ratios, from the
    `(B, T)` inputs of `compute_rollout_is`."""
    flat_mask = mask.reshape(-1)
    flat_old = old_logprobs.detach().reshape(-1).to(torch.float64)
    flat_rollout = rollout_logprobs.detach().reshape(-1).to(torch.float64)
    pos = (flat_mask & torch.isfinite(flat_old) & torch.isfinite(flat_rollout)).nonzero().squeeze(-1)
    mask_ids = seq_ids.reshape(-1)[flat_mask].long()
    if mask_ids.numel() and (int(mask_ids.min()) < 0 or int(mask_ids.max()) >= num_sequences):
        raise ValueError(f"seq_ids at valid tokens must lie in [0, num_sequences={num_sequences})")
    old, rollout = flat_old[pos], flat_rollout[pos]
    delta = old - rollout
    clamped = delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho = clamped.exp()
    catastrophic = torch.zeros_like(delta, dtype=torch.bool)
    if cfg.veto_lower is not None:
        catastrophic |= delta < math.log(cfg.veto_lower)
    if cfg.veto_upper is not None:
        catastrophic |= delta > math.log(cfg.veto_upper)
    band = cfg.mask_bounds
    outside_band = torch.zeros_like(catastrophic)
    if band is not None and cfg.level == "token":
        outside_band = (rho < band[0]) | (rho > band[1])
    ids = seq_ids.reshape(-1)[pos].long()
    return _Tokens(flat_mask, pos, ids, mask_ids, old, rollout, delta, clamped, rho, catastrophic, outside_band)


def _sequence_sums(tokens: _Tokens, num_sequences: int, sp_mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    """`_SEQ_COLUMNS` summed over each whole sequence (all SP shards): `(S,)` float64 each."""
    f64 = torch.float64
    values = {
        "tokens": torch.ones_like(tokens.delta),
        "mask_tokens": torch.zeros_like(tokens.delta),  # counted below, over the valid tokens finite or not
        "delta": tokens.delta,
        "old": tokens.old,
        "rollout": tokens.rollout,
        "rho": tokens.rho,
        "catastrophic": tokens.catastrophic.to(f64),
        "outside_band": tokens.outside_band.to(f64),
    }
    columns = torch.stack([values[name] for name in _SEQ_COLUMNS], dim=1)  # (N, C)
    per_seq = torch.zeros(num_sequences, len(_SEQ_COLUMNS), dtype=f64, device=columns.device)
    per_seq.index_add_(0, tokens.ids, columns)
    mask_column = _SEQ_COLUMNS.index("mask_tokens")
    per_seq[:, mask_column].index_add_(0, tokens.mask_ids, torch.ones_like(tokens.mask_ids, dtype=f64))
    if sp_world_size(sp_mesh) > 1:
        all_reduce(per_seq, group=sp_group(sp_mesh))
    return dict(zip(_SEQ_COLUMNS, per_seq.unbind(1)))


def _ratios_and_keep(cfg: RolloutImportanceSampling, tokens: _Tokens, seqs: dict[str, torch.Tensor]) -> _Decision:
    """The level's ratio ρ (safety-bounded, before truncation and rejection) and the rejection, on V."""
    nonempty = seqs["tokens"] > 0
    n_safe = seqs["tokens"].clamp(min=1)
    if cfg.level == "token":
        seq_rho = seqs["rho"] / n_safe  # s_i: mean token ratio of the sequence
        rho = tokens.rho
    else:
        log_rho = seqs["delta"] if cfg.level == "sequence" else seqs["delta"] / n_safe
        seq_rho = log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
        rho = seq_rho[tokens.ids]
    keep = torch.ones_like(tokens.delta, dtype=torch.bool)
    masked = torch.zeros_like(keep)
    seq_masked = torch.zeros_like(nonempty)
    band = cfg.mask_bounds
    if band is not None:
        if cfg.level == "token":
            masked = tokens.outside_band
            seq_masked = nonempty & (seqs["outside_band"] > 0)
        else:
            seq_masked = nonempty & ((seq_rho < band[0]) | (seq_rho > band[1]))
            masked = seq_masked[tokens.ids]
        keep &= ~masked
    vetoed = nonempty & (seqs["catastrophic"] > 0)
    if cfg.has_veto:
        keep &= ~vetoed[tokens.ids]
    return _Decision(rho, seq_rho, keep, masked, seq_masked, vetoed)


def _scatter(tokens: _Tokens, values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`(B, T)` tensor with `values` at the positions of V and zero (False) elsewhere."""
    flat = torch.zeros(tokens.mask.numel(), dtype=values.dtype, device=values.device)
    flat[tokens.pos] = values
    return flat.reshape(shape)


def _weights(cfg: RolloutImportanceSampling, decision: _Decision) -> torch.Tensor | None:
    """`(N,)` IS weights on V: the ratio (truncated unless `mode="mask"`), 0 at rejected tokens; `None` if off."""
    if not cfg.enabled:
        return None
    weight = decision.rho
    if cfg.mode != "mask":
        lower, upper = cfg.bounds
        weight = weight.clamp(min=lower if cfg.truncate_lower else None, max=upper)
    return torch.where(decision.keep, weight, 0.0)


def _masked_extreme(values: torch.Tensor, keep: torch.Tensor, largest: bool) -> torch.Tensor:
    identity = float("-inf") if largest else float("inf")
    chosen = values[keep]
    if chosen.numel() == 0:
        return torch.full((), identity, dtype=torch.float64, device=values.device)
    return chosen.max() if largest else chosen.min()


def _token_metrics(
    cfg: RolloutImportanceSampling, tokens: _Tokens, decision: _Decision, kept_logmass: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Sums, counts and extrema over the local tokens of V (disjoint across SP shards)."""
    f64 = torch.float64
    rho, everywhere = decision.rho, torch.ones_like(decision.keep)
    bounds = cfg.bounds
    clamped_weight = rho if bounds is None else rho.clamp(bounds[0], bounds[1])
    mask_tokens = tokens.mask.sum().to(f64)
    valid_tokens = torch.tensor(float(tokens.pos.numel()), dtype=f64, device=rho.device)
    metrics = {
        IS_MASK_TOKENS: mask_tokens,
        IS_VALID_TOKENS: valid_tokens,
        IS_NONFINITE_TOKENS: mask_tokens - valid_tokens,
        ROLLOUT_IS_ACC + "rejected_tokens": mask_tokens - decision.keep.sum().to(f64),
        ROLLOUT_IS_ACC + "delta_sum": tokens.delta.sum(),
        ROLLOUT_IS_ACC + "abs_delta_sum": tokens.delta.abs().sum(),
        ROLLOUT_IS_ACC + "k3_sum": (tokens.rho - tokens.clamped - 1).sum(),
        ROLLOUT_IS_ACC + "rho_token_sq_sum": tokens.rho.square().sum(),
        ROLLOUT_IS_ACC + "weight_sum": rho.sum(),
        ROLLOUT_IS_ACC + "clamped_weight_sum": clamped_weight.sum(),
        ROLLOUT_IS_ACC + "clamped_weight_sq_sum": clamped_weight.square().sum(),
        ROLLOUT_IS_ACC + "weight_max": _masked_extreme(rho, everywhere, largest=True),
        ROLLOUT_IS_ACC + "weight_min": _masked_extreme(rho, everywhere, largest=False),
    }
    if bounds is not None:
        metrics[ROLLOUT_IS_ACC + "high_tokens"] = (rho > bounds[1]).sum().to(f64)
        metrics[ROLLOUT_IS_ACC + "low_tokens"] = (rho < bounds[0]).sum().to(f64)
    if cfg.mask_bounds is not None:
        metrics[ROLLOUT_IS_ACC + "masked_tokens"] = decision.masked.sum().to(f64)
    if cfg.has_veto:
        metrics[ROLLOUT_IS_ACC + "catastrophic_tokens"] = tokens.catastrophic.sum().to(f64)
    if kept_logmass is not None:
        kept_mass = kept_logmass.detach().reshape(-1)[tokens.pos].to(f64).exp()
        metrics[ROLLOUT_IS_ACC + "kept_mass_sum"] = kept_mass.sum()
        metrics[ROLLOUT_IS_ACC + "kept_mass_min"] = _masked_extreme(kept_mass, everywhere, largest=False)
    return metrics


def _sequence_metrics(
    cfg: RolloutImportanceSampling, seqs: dict[str, torch.Tensor], decision: _Decision, sp_mesh: DeviceMesh | None
) -> dict[str, torch.Tensor]:
    """Sums and extrema over the non-empty sequences, each counted once (on SP rank 0)."""
    nonempty = seqs["tokens"] > 0
    n_safe = seqs["tokens"].clamp(min=1)
    counted = on_first_sp_rank(nonempty, sp_mesh)

    def seq_sum(values: torch.Tensor) -> torch.Tensor:
        return torch.where(counted, values, 0.0).sum()

    seq_rho = decision.seq_rho
    training_log_ppl = -seqs["old"] / n_safe
    rollout_log_ppl = -seqs["rollout"] / n_safe
    log_ppl_diff = training_log_ppl - rollout_log_ppl  # mean log μ − mean log π_old = −mean δ
    sums = {
        "training_ppl_sum": training_log_ppl.exp(),
        "training_log_ppl_sum": training_log_ppl,
        "rollout_ppl_sum": rollout_log_ppl.exp(),
        "rollout_log_ppl_sum": rollout_log_ppl,
        "log_ppl_diff_sum": log_ppl_diff,
        "log_ppl_abs_diff_sum": log_ppl_diff.abs(),
        "ppl_ratio_sum": log_ppl_diff.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp(),
        "seq_rho_sq_sum": (2 * seqs["delta"].clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp(),
        "seq_weight_sum": seq_rho,
        "seq_weight_sq_sum": seq_rho.square(),
    }
    if cfg.bounds is not None:
        sums["high_sequences"] = (seq_rho > cfg.bounds[1]).to(torch.float64)
        sums["low_sequences"] = (seq_rho < cfg.bounds[0]).to(torch.float64)
    if cfg.mask_bounds is not None:
        sums["masked_sequences"] = decision.seq_masked.to(torch.float64)
    if cfg.has_veto:
        sums["vetoed_sequences"] = decision.vetoed.to(torch.float64)
    extrema = {
        "log_ppl_diff_max": (log_ppl_diff, True),
        "log_ppl_diff_min": (log_ppl_diff, False),
        "seq_weight_max": (seq_rho, True),
        "seq_weight_min": (seq_rho, False),
        "seq_max_deviation": ((seq_rho - 1).abs(), True),
    }
    metrics = {IS_SEQUENCES: counted.sum().to(torch.float64)}
    metrics.update({ROLLOUT_IS_ACC + name: seq_sum(values) for name, values in sums.items()})
    for name, (values, largest) in extrema.items():
        metrics[ROLLOUT_IS_ACC + name] = _masked_extreme(values, nonempty, largest=largest)
    return metrics


@torch.no_grad()
def compute_rollout_is(
    cfg: RolloutImportanceSampling,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_sequences: int,
    sp_mesh: DeviceMesh | None = None,
    kept_logmass: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Rollout IS weights, keep-mask and accumulable metrics of one micro-batch (local tensors, after any SP split).

    Pure apart from one all-reduce over the SP group when `sp_world_size(sp_mesh) > 1` (all ranks of the group call
    it, with the same `num_sequences`). Nothing is differentiated and no input is modified.

    Args:
        cfg (`RolloutImportanceSampling`): the configuration.
        old_logprobs (`torch.Tensor`): `(B, T)` log π_old of the sampled tokens (computed by the trainer).
        rollout_logprobs (`torch.Tensor`): `(B, T)` log μ of the same tokens (reported by the rollout engine).
        mask (`torch.Tensor`): `(B, T)` bool, the valid (loss-carrying) tokens.
        seq_ids (`torch.Tensor`): `(B, T)` int64 index of each position's sequence in `[0, num_sequences)` (row index
            of a padded batch, segment index of a packed row); -1 (or anything) where `mask` is false.
        num_sequences (`int`): number of sequences of the micro-batch (the whole micro-batch under SP).
        sp_mesh (`DeviceMesh`, *optional*): 1-D sequence-parallel mesh; shards of one sequence lie on consecutive
            ranks of it, and per-sequence sums are all-reduced over it.
        kept_logmass (`torch.Tensor`, *optional*): `(B, T)` log of the probability mass the sampling truncation
            (top-k/top-p/min-p) kept at each token; only reported (`mismatch/kept_mass_mean`, `_min`). It does not
            enter the ratio: put both log-probs on the same support before calling (see `GRPOLossContext`).

    Returns:
        `(weights, keep, metrics)`: `weights` `(B, T)` detached, at least float32, 0 wherever `keep` is false, or
        `None` in metrics-only mode; `keep` `(B, T)` bool, `mask` minus rejected tokens (the caller turns the labels
        of `mask & ~keep` into `ignore_idx`, in a new tensor); `metrics` 0-dim float64 tensors to merge with
        `accumulate_metrics` and reduce with :func:`finalize_rollout_is_metrics` once per optimizer step.
    """
    named = {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs, "seq_ids": seq_ids}
    _check_inputs({**named, "kept_logmass": kept_logmass}, mask, seq_ids)
    num_sequences = int(num_sequences)
    shape = tuple(mask.shape)
    tokens = _valid_finite_tokens(cfg, old_logprobs, rollout_logprobs, mask, seq_ids, num_sequences)
    seqs = _sequence_sums(tokens, num_sequences, sp_mesh)
    decision = _ratios_and_keep(cfg, tokens, seqs)
    keep = _scatter(tokens, decision.keep, shape)
    weights = _weights(cfg, decision)
    if weights is not None:
        weights = _scatter(tokens, weights, shape).to(torch.promote_types(old_logprobs.dtype, torch.float32))
    metrics = _token_metrics(cfg, tokens, decision, kept_logmass)
    metrics.update(_sequence_metrics(cfg, seqs, decision, sp_mesh))
    return weights, keep, metrics


def finalize_rollout_is_metrics(
    accumulated: dict[str, Any],
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Reduce a rank's accumulated rollout-IS metrics across processes and turn them into global means.

    Collective when distributed: every rank of `group` must call it with the same configuration (hence the same
    keys). One all-reduce per reduction kind, for the rollout-IS keys only; other keys of `accumulated` are ignored
    (finalize them separately, e.g. with `finalize_train_policy_metrics`, which also finalizes these).

    Args:
        accumulated (`dict`): the metrics of `compute_rollout_is` over the micro-batches of one optimizer step on this
            rank, merged with `accumulate_metrics` (possibly together with other metrics).
        device (`torch.device` or `str`, *optional*): device of the all-reduce buffer (the backend's device).
        group (`ProcessGroup`, *optional*): every rank of the step (data × sequence parallel); defaults to the world.

    Returns:
        `dict[str, float]`: the `mismatch/*` and `rollout_is/*` metrics (see `hf_rlloss.loss.metrics.metrics_table`),
        finite; `{}` when `accumulated` holds no rollout-IS key.
    """
    values = {k: v for k, v in accumulated.items() if k.startswith(ROLLOUT_IS_ACC)}
    if not values:
        return {}
    return dict(sorted(finalize_reduced(reduce_metrics(values, device, group)).items()))
