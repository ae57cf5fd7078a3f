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

Metrics. ``V`` is the set of valid finite tokens (``N = |V|``), ``S`` the set of sequences with at least one token in
``V`` (``K = |S|``; padding rows and empty sequences are not sequences here), ``n_i`` the tokens of sequence ``i`` in
``V``. ``ρ`` is the level's weight before truncation and rejection (safety-bounded), ``w = clamp(ρ, lower, upper)``
(two-sided, as XTuner and verl; ``w = ρ`` when no bounds are set), ``s_i = mean_{t∈i} ρ_t`` (``= ρ_i`` at the sequence
and geometric levels), ``d_i = mean_{t∈i} log μ − mean_{t∈i} log π_old`` and ``δ̂ = clamp(δ, ±20)``. Token-weighted
metrics average over ``V``, sequence-weighted ones over ``S``, both over every micro-batch and rank of the step; a
metric whose count is 0 is ``0.0``.

| key | formula | weighted by |
|---|---|---|
| ``mismatch/mismatch_training_ppl`` | ``mean_i exp(−mean_{t∈i} log π_old)`` | sequence |
| ``mismatch/mismatch_training_log_ppl`` | ``mean_i (−mean_{t∈i} log π_old)`` | sequence |
| ``mismatch/mismatch_rollout_ppl`` | ``mean_i exp(−mean_{t∈i} log μ)`` | sequence |
| ``mismatch/mismatch_rollout_log_ppl`` | ``mean_i (−mean_{t∈i} log μ)`` | sequence |
| ``mismatch/mismatch_log_ppl_diff`` | ``mean_i d_i`` | sequence |
| ``mismatch/mismatch_log_ppl_abs_diff`` | ``mean_i |d_i|`` | sequence |
| ``mismatch/mismatch_log_ppl_diff_max`` / ``_min`` | ``max_i d_i`` / ``min_i d_i`` | sequence |
| ``mismatch/mismatch_ppl_ratio`` | ``mean_i exp(clamp(d_i, ±20))``: training ppl / rollout ppl (XTuner's) | sequence |
| ``mismatch/mismatch_kl`` | ``mean_t (log μ − log π_old)``: k1 estimate of KL(μ‖π_old) | token |
| ``mismatch/mismatch_k3_kl`` | ``mean_t (exp(δ̂) − δ̂ − 1)``: k3 estimate of KL(μ‖π_old) | token |
| ``mismatch/mismatch_logprob_abs_diff`` | ``mean_t |δ_t|`` | token |
| ``mismatch/mismatch_chi2_token`` | ``mean_t exp(δ̂_t)² − 1``: χ²(π_old‖μ) per token | token |
| ``mismatch/mismatch_chi2_seq`` | ``mean_i exp(clamp(Σ_{t∈i} δ_t, ±20))² − 1``: χ² of whole sequences | sequence |
| ``rollout_is/mean`` | ``mean_t ρ_t`` | token |
| ``rollout_is/std`` | ``sqrt(mean_t w² − (mean_t w)²)`` (population std) | token |
| ``rollout_is/eff_sample_size`` | ``(mean_t w)² / mean_t w²``, the normalized ESS in ``(0, 1]`` | token |
| ``rollout_is/max`` / ``min`` | ``max_t ρ_t`` / ``min_t ρ_t`` (above token level: extrema of ``ρ_i``) | token |
| ``rollout_is/fraction_high`` / ``_low`` | share of tokens with ``ρ_t > upper`` / ``< lower`` (bounds set) | token |
| ``rollout_is/seq_mean`` | ``mean_i s_i`` | sequence |
| ``rollout_is/seq_std`` | unbiased (Bessel) std of ``s_i``, 0 when ``K < 2`` | sequence |
| ``rollout_is/seq_max`` / ``seq_min`` | ``max_i s_i`` / ``min_i s_i`` | sequence |
| ``rollout_is/seq_max_deviation`` | ``max_i |s_i − 1|`` | sequence |
| ``rollout_is/seq_fraction_high`` / ``_low`` | share of sequences with ``s_i > upper`` / ``< lower`` | sequence |
| ``rollout_is/masked_fraction`` | share of tokens rejected by the band (``mask``/``both`` only) | token |
| ``rollout_is/seq_masked_fraction`` | share of sequences with a token rejected by the band | sequence |
| ``rollout_is/veto_fraction`` | share of sequences vetoed (veto set) | sequence |
| ``rollout_is/catastrophic_token_fraction`` | share of valid tokens outside the veto bounds (veto set) | token |
| ``rollout_is/rejected_token_fraction`` | share of ``mask`` tokens with ``keep=False`` (every cause) | ``mask`` |
| ``rollout_is/nonfinite_tokens`` | number of ``mask`` tokens with a NaN/±inf old or rollout log-prob | count |

Metrics that need the bounds (``fraction_*``, ``seq_fraction_*``), the mask band (``masked_fraction``,
``seq_masked_fraction``) or the veto (``veto_fraction``, ``catastrophic_token_fraction``) are emitted only when it is
configured. Weights are 0 at rejected tokens; all statistics above use every valid finite token, rejected or not.

The ``mismatch/*`` names are XTuner's; its ``mismatch/rollout_is_<x>`` keys (logged there as
``rollout_is/mismatch/rollout_is_<x>``) are ``rollout_is/<x>`` here. Differences from XTuner v1 (its bugs fixed):
mismatch metrics are per sequence, not per pack, and true global means rather than means of per-pack means; padding
rows and empty sequences never enter any metric; ``fraction_high``/``_low`` are token-weighted at every level
(``seq_fraction_*`` are the sequence-weighted ones); the k3 estimate is clamped; bounds are named fields, validated
at construction (``lower < upper``) instead of an ``(upper, lower)`` tuple; truncation is upper-only unless
``truncate_lower=True``; the inputs are never modified.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, model_validator
from torch.distributed.device_mesh import DeviceMesh

from .distributed import all_reduce
from .metrics import Reduction, reduce_metrics, register_finalizer, register_metric
from .sequence_parallel import sp_group, sp_rank, sp_size

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

    Example:

    ```python
    >>> RolloutImportanceSampling(level="token", mode="truncate", upper=2.0)  # TIS, w = min(ρ, 2)
    >>> RolloutImportanceSampling(level="geometric", mode="mask", lower=0.5, upper=2.0, veto_lower=1e-4)
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

    @model_validator(mode="after")
    def _validate(self) -> RolloutImportanceSampling:
        for name in ("lower", "upper", "mask_lower", "mask_upper", "veto_lower", "veto_upper"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}={value} must be > 0 (it bounds a ratio of probabilities)")
        if self.upper is None:
            needs = [n for n in ("lower", "mask_lower", "mask_upper", "veto_lower", "veto_upper") if getattr(self, n)]
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
# Accumulated (pre-finalize) metric keys and their declared reductions.

_A = "rollout_is_acc/"
MASK_TOKENS = _A + "mask_tokens"  # valid (mask) tokens, finite or not
VALID_TOKENS = _A + "valid_tokens"  # valid tokens with finite log-probs: N
SEQUENCES = _A + "sequences"  # sequences with at least one valid finite token: K (counted on SP rank 0)
NONFINITE_TOKENS = _A + "nonfinite_tokens"

_TOKEN_SUMS = (
    "rejected_tokens",
    "delta_sum",
    "abs_delta_sum",
    "k3_sum",
    "rho_token_sq_sum",
    "weight_sum",
    "clamped_weight_sum",
    "clamped_weight_sq_sum",
    "high_tokens",
    "low_tokens",
    "masked_tokens",
    "catastrophic_tokens",
    "kept_mass_sum",
)
_SEQ_SUMS = (
    "training_ppl_sum",
    "training_log_ppl_sum",
    "rollout_ppl_sum",
    "rollout_log_ppl_sum",
    "log_ppl_diff_sum",
    "log_ppl_abs_diff_sum",
    "ppl_ratio_sum",
    "seq_rho_sq_sum",
    "seq_weight_sum",
    "seq_weight_sq_sum",
    "high_sequences",
    "low_sequences",
    "masked_sequences",
    "vetoed_sequences",
)
_MAXES = ("weight_max", "log_ppl_diff_max", "seq_weight_max", "seq_max_deviation")
_MINS = ("weight_min", "log_ppl_diff_min", "seq_weight_min", "kept_mass_min")

ACCUMULATED_KEYS: dict[str, Reduction] = {
    MASK_TOKENS: Reduction.SUM,
    VALID_TOKENS: Reduction.SUM,
    SEQUENCES: Reduction.SUM,
    NONFINITE_TOKENS: Reduction.SUM,
    **{_A + k: Reduction.SUM for k in _TOKEN_SUMS + _SEQ_SUMS},
    **{_A + k: Reduction.MAX for k in _MAXES},
    **{_A + k: Reduction.MIN for k in _MINS},
}
for _key, _kind in ACCUMULATED_KEYS.items():
    register_metric(_key, _kind)

# Per-sequence columns summed with index_add_ (and over the SP group).
_COL_N, _COL_MASK, _COL_DELTA, _COL_OLD, _COL_ROLL, _COL_RHO, _COL_CAT, _COL_OUT = range(8)
_NUM_COLS = 8


def _masked_extreme(values: torch.Tensor, keep: torch.Tensor, largest: bool) -> torch.Tensor:
    identity = float("-inf") if largest else float("inf")
    chosen = values[keep]
    if chosen.numel() == 0:
        return torch.full((), identity, dtype=torch.float64, device=values.device)
    return chosen.max() if largest else chosen.min()


@torch.no_grad()
def compute_rollout_is(
    cfg: RolloutImportanceSampling,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_sequences: int,
    seq_token_counts: torch.Tensor | None = None,
    sp_mesh: DeviceMesh | None = None,
    kept_logmass: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Rollout IS weights, keep-mask and accumulable metrics of one micro-batch (local tensors, after any SP split).

    Pure apart from one all-reduce over the SP group when `sp_size(sp_mesh) > 1` (every rank of the group must call
    it, with the same `num_sequences`). Nothing is differentiated and no input is modified.

    Args:
        cfg (`RolloutImportanceSampling`): the configuration.
        old_logprobs (`torch.Tensor`): `(B, T)` log π_old of the sampled tokens (computed by the trainer).
        rollout_logprobs (`torch.Tensor`): `(B, T)` log μ of the same tokens (reported by the rollout engine).
        mask (`torch.Tensor`): `(B, T)` bool, the valid (loss-carrying) tokens.
        seq_ids (`torch.Tensor`): `(B, T)` int64 index of each position's sequence in `[0, num_sequences)` (row index
            of a padded batch, segment index of a packed row); -1 (or anything) where `mask` is false.
        num_sequences (`int`): number of sequences of the micro-batch (the whole micro-batch under SP).
        seq_token_counts (`torch.Tensor`, *optional*): `(num_sequences,)` valid tokens of each whole sequence, if the
            caller already has them; they are checked against `mask` (a `ValueError` on disagreement).
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
    shape = tuple(mask.shape)
    if len(shape) != 2:
        raise ValueError(f"mask must be 2-D (B, T); got shape {shape}")
    named = [("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs), ("seq_ids", seq_ids)]
    if kept_logmass is not None:
        named.append(("kept_logmass", kept_logmass))
    for name, value in named:
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)} but mask has shape {shape}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor; got {mask.dtype}")
    if seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool:
        raise ValueError(f"seq_ids must be an integer tensor; got {seq_ids.dtype}")
    num_sequences = int(num_sequences)
    device = old_logprobs.device
    f64 = torch.float64
    lo_hi = cfg.bounds
    mask_band = cfg.mask_bounds
    sp = sp_size(sp_mesh)

    flat_mask = mask.reshape(-1)
    flat_old = old_logprobs.detach().reshape(-1).to(f64)
    flat_roll = rollout_logprobs.detach().reshape(-1).to(f64)
    finite = flat_mask & torch.isfinite(flat_old) & torch.isfinite(flat_roll)
    pos = finite.nonzero().squeeze(-1)  # flat positions of the valid finite tokens: V
    ids = seq_ids.reshape(-1)[pos].long()
    mask_ids = seq_ids.reshape(-1)[flat_mask].long()
    if mask_ids.numel() and (int(mask_ids.min()) < 0 or int(mask_ids.max()) >= num_sequences):
        raise ValueError(f"seq_ids at valid tokens must lie in [0, num_sequences={num_sequences})")

    old = flat_old[pos]
    roll = flat_roll[pos]
    delta = old - roll
    clamped = delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho_token = clamped.exp()

    catastrophic = torch.zeros_like(delta, dtype=torch.bool)
    if cfg.veto_lower is not None:
        catastrophic |= delta < math.log(cfg.veto_lower)
    if cfg.veto_upper is not None:
        catastrophic |= delta > math.log(cfg.veto_upper)
    outside_token = torch.zeros_like(catastrophic)
    if mask_band is not None and cfg.level == "token":
        outside_token = (rho_token < mask_band[0]) | (rho_token > mask_band[1])

    # Per-sequence sums over the whole sequence (all SP shards): one index_add_ and one all-reduce.
    columns = torch.stack(
        [torch.ones_like(delta), torch.zeros_like(delta), delta, old, roll, rho_token, catastrophic.to(f64)]
        + [outside_token.to(f64)],
        dim=1,
    )
    per_seq = torch.zeros(num_sequences, _NUM_COLS, dtype=f64, device=device).index_add_(0, ids, columns)
    mask_counts = torch.zeros(num_sequences, dtype=f64, device=device)
    per_seq[:, _COL_MASK] = mask_counts.index_add_(0, mask_ids, torch.ones_like(mask_ids, dtype=f64))
    if sp > 1:
        all_reduce(per_seq, group=sp_group(sp_mesh))
    if seq_token_counts is not None:
        given = torch.as_tensor(seq_token_counts, device=device).to(f64).reshape(-1)
        if given.shape != (num_sequences,) or not torch.equal(given, per_seq[:, _COL_MASK]):
            raise ValueError(
                f"seq_token_counts {given.tolist()} disagree with the valid tokens per sequence of mask "
                f"{per_seq[:, _COL_MASK].tolist()}"
            )

    n = per_seq[:, _COL_N]
    nonempty = n > 0
    n_safe = n.clamp(min=1)
    seq_delta = per_seq[:, _COL_DELTA]
    seq_mean_delta = seq_delta / n_safe

    # The level's ratio ρ (safety-bounded, before truncation and rejection), per sequence and per token.
    if cfg.level == "token":
        seq_rho = per_seq[:, _COL_RHO] / n_safe  # s_i: mean token ratio of the sequence
        rho = rho_token
    else:
        seq_rho = (seq_delta if cfg.level == "sequence" else seq_mean_delta).clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
        rho = seq_rho[ids]

    # Rejection, on V (non-finite tokens are rejected outright).
    keep_v = torch.ones_like(delta, dtype=torch.bool)
    seq_masked = torch.zeros(num_sequences, dtype=torch.bool, device=device)
    masked_v = torch.zeros_like(keep_v)
    if mask_band is not None:
        if cfg.level == "token":
            masked_v = outside_token
            seq_masked = nonempty & (per_seq[:, _COL_OUT] > 0)
        else:
            seq_masked = nonempty & ((seq_rho < mask_band[0]) | (seq_rho > mask_band[1]))
            masked_v = seq_masked[ids]
        keep_v &= ~masked_v
    vetoed = nonempty & (per_seq[:, _COL_CAT] > 0)
    if cfg.has_veto:
        keep_v &= ~vetoed[ids]

    flat_keep = torch.zeros_like(flat_mask)
    flat_keep[pos] = keep_v
    keep = flat_keep.reshape(shape)

    weights = None
    if cfg.enabled:
        weight = rho
        if cfg.mode != "mask":
            weight = weight.clamp(min=lo_hi[0] if cfg.truncate_lower else None, max=lo_hi[1])
        flat_weights = torch.zeros(flat_mask.numel(), dtype=f64, device=device)
        flat_weights[pos] = torch.where(keep_v, weight, 0.0)
        weights = flat_weights.reshape(shape).to(torch.promote_types(old_logprobs.dtype, torch.float32))

    # ---- metrics: token sums over the local tokens (disjoint across shards) ----
    def scalar(value: float | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(value, dtype=f64, device=device).reshape(())

    clamped_weight = rho if lo_hi is None else rho.clamp(lo_hi[0], lo_hi[1])
    m: dict[str, torch.Tensor] = {
        MASK_TOKENS: scalar(float(flat_mask.sum())),
        VALID_TOKENS: scalar(float(pos.numel())),
        NONFINITE_TOKENS: scalar(float(flat_mask.sum()) - float(pos.numel())),
        _A + "rejected_tokens": scalar(float(flat_mask.sum()) - float(keep_v.sum())),
        _A + "delta_sum": delta.sum(),
        _A + "abs_delta_sum": delta.abs().sum(),
        _A + "k3_sum": (rho_token - clamped - 1).sum(),
        _A + "rho_token_sq_sum": rho_token.square().sum(),
        _A + "weight_sum": rho.sum(),
        _A + "clamped_weight_sum": clamped_weight.sum(),
        _A + "clamped_weight_sq_sum": clamped_weight.square().sum(),
        _A + "weight_max": _masked_extreme(rho, torch.ones_like(keep_v), largest=True),
        _A + "weight_min": _masked_extreme(rho, torch.ones_like(keep_v), largest=False),
    }
    if lo_hi is not None:
        m[_A + "high_tokens"] = (rho > lo_hi[1]).sum().to(f64)
        m[_A + "low_tokens"] = (rho < lo_hi[0]).sum().to(f64)
    if mask_band is not None:
        m[_A + "masked_tokens"] = masked_v.sum().to(f64)
    if cfg.has_veto:
        m[_A + "catastrophic_tokens"] = catastrophic.sum().to(f64)
    if kept_logmass is not None:
        kept_mass = kept_logmass.detach().reshape(-1)[pos].to(f64).exp()
        m[_A + "kept_mass_sum"] = kept_mass.sum()
        m[_A + "kept_mass_min"] = _masked_extreme(kept_mass, torch.ones_like(keep_v), largest=False)

    # ---- metrics: sequence sums over non-empty sequences, counted once (on SP rank 0) ----
    counted = nonempty if sp_rank(sp_mesh) == 0 else torch.zeros_like(nonempty)

    def seq_sum(values: torch.Tensor) -> torch.Tensor:
        return torch.where(counted, values, 0.0).sum()

    training_log_ppl = -per_seq[:, _COL_OLD] / n_safe
    rollout_log_ppl = -per_seq[:, _COL_ROLL] / n_safe
    log_ppl_diff = training_log_ppl - rollout_log_ppl  # mean log μ − mean log π_old = −mean δ
    m.update(
        {
            SEQUENCES: counted.sum().to(f64),
            _A + "training_ppl_sum": seq_sum(training_log_ppl.exp()),
            _A + "training_log_ppl_sum": seq_sum(training_log_ppl),
            _A + "rollout_ppl_sum": seq_sum(rollout_log_ppl.exp()),
            _A + "rollout_log_ppl_sum": seq_sum(rollout_log_ppl),
            _A + "log_ppl_diff_sum": seq_sum(log_ppl_diff),
            _A + "log_ppl_abs_diff_sum": seq_sum(log_ppl_diff.abs()),
            _A + "ppl_ratio_sum": seq_sum(log_ppl_diff.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()),
            _A + "seq_rho_sq_sum": seq_sum((2 * seq_delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp()),
            _A + "seq_weight_sum": seq_sum(seq_rho),
            _A + "seq_weight_sq_sum": seq_sum(seq_rho.square()),
            _A + "log_ppl_diff_max": _masked_extreme(log_ppl_diff, nonempty, largest=True),
            _A + "log_ppl_diff_min": _masked_extreme(log_ppl_diff, nonempty, largest=False),
            _A + "seq_weight_max": _masked_extreme(seq_rho, nonempty, largest=True),
            _A + "seq_weight_min": _masked_extreme(seq_rho, nonempty, largest=False),
            _A + "seq_max_deviation": _masked_extreme((seq_rho - 1).abs(), nonempty, largest=True),
        }
    )
    if lo_hi is not None:
        m[_A + "high_sequences"] = seq_sum((seq_rho > lo_hi[1]).to(f64))
        m[_A + "low_sequences"] = seq_sum((seq_rho < lo_hi[0]).to(f64))
    if mask_band is not None:
        m[_A + "masked_sequences"] = seq_sum(seq_masked.to(f64))
    if cfg.has_veto:
        m[_A + "vetoed_sequences"] = seq_sum(vetoed.to(f64))
    return weights, keep, m


# finalized name -> (numerator, denominator, offset): value = numerator / denominator + offset, 0.0 if count is 0.
_TOKEN_MEANS = {
    "mismatch/mismatch_kl": ("delta_sum", -1.0),
    "mismatch/mismatch_k3_kl": ("k3_sum", 1.0),
    "mismatch/mismatch_logprob_abs_diff": ("abs_delta_sum", 1.0),
    "rollout_is/mean": ("weight_sum", 1.0),
    "rollout_is/fraction_high": ("high_tokens", 1.0),
    "rollout_is/fraction_low": ("low_tokens", 1.0),
    "rollout_is/masked_fraction": ("masked_tokens", 1.0),
    "rollout_is/catastrophic_token_fraction": ("catastrophic_tokens", 1.0),
    "mismatch/kept_mass_mean": ("kept_mass_sum", 1.0),
}
_SEQ_MEANS = {
    "mismatch/mismatch_training_ppl": "training_ppl_sum",
    "mismatch/mismatch_training_log_ppl": "training_log_ppl_sum",
    "mismatch/mismatch_rollout_ppl": "rollout_ppl_sum",
    "mismatch/mismatch_rollout_log_ppl": "rollout_log_ppl_sum",
    "mismatch/mismatch_log_ppl_diff": "log_ppl_diff_sum",
    "mismatch/mismatch_log_ppl_abs_diff": "log_ppl_abs_diff_sum",
    "mismatch/mismatch_ppl_ratio": "ppl_ratio_sum",
    "rollout_is/seq_mean": "seq_weight_sum",
    "rollout_is/seq_fraction_high": "high_sequences",
    "rollout_is/seq_fraction_low": "low_sequences",
    "rollout_is/seq_masked_fraction": "masked_sequences",
    "rollout_is/veto_fraction": "vetoed_sequences",
}
_EXTREMA = {
    "mismatch/mismatch_log_ppl_diff_max": ("log_ppl_diff_max", SEQUENCES),
    "mismatch/mismatch_log_ppl_diff_min": ("log_ppl_diff_min", SEQUENCES),
    "rollout_is/max": ("weight_max", VALID_TOKENS),
    "rollout_is/min": ("weight_min", VALID_TOKENS),
    "rollout_is/seq_max": ("seq_weight_max", SEQUENCES),
    "rollout_is/seq_min": ("seq_weight_min", SEQUENCES),
    "rollout_is/seq_max_deviation": ("seq_max_deviation", SEQUENCES),
    "mismatch/kept_mass_min": ("kept_mass_min", VALID_TOKENS),
}


def finalize_rollout_is_metrics(
    accumulated: dict[str, Any],
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Reduce a rank's accumulated rollout-IS metrics across processes and turn them into global means.

    Collective when distributed: every rank of `group` must call it with the same configuration (hence the same
    keys). One all-reduce per reduction kind, for the rollout-IS keys only; other keys of `accumulated` are ignored
    (finalize them separately, e.g. with `finalize_train_policy_metrics`).

    Args:
        accumulated (`dict`): the metrics of `compute_rollout_is` over the micro-batches of one optimizer step on this
            rank, merged with `accumulate_metrics` (possibly together with other metrics).
        device (`torch.device` or `str`, *optional*): device of the all-reduce buffer (the backend's device).
        group (`ProcessGroup`, *optional*): every rank of the step (data × sequence parallel); defaults to the world.

    Returns:
        `dict[str, float]`: the `mismatch/*` and `rollout_is/*` metrics of the module docstring, finite; `{}` when
        `accumulated` holds no rollout-IS key.
    """
    values = {k: v for k, v in accumulated.items() if k in ACCUMULATED_KEYS}
    if not values:
        return {}
    return rollout_is_metrics_from_reduced(reduce_metrics(values, device, group))


@register_finalizer
def rollout_is_metrics_from_reduced(r: dict[str, float]) -> dict[str, float]:
    """The final `mismatch/*` and `rollout_is/*` metrics from already all-reduced accumulator values (`{}` if none).

    Registered with `register_finalizer`, so `finalize_train_policy_metrics` reports them with the same collectives.
    """
    if VALID_TOKENS not in r:
        return {}
    tokens = r.get(VALID_TOKENS, 0.0)
    sequences = r.get(SEQUENCES, 0.0)

    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else 0.0

    out: dict[str, float] = {}
    for name, (key, sign) in _TOKEN_MEANS.items():
        if _A + key in r:
            out[name] = sign * ratio(r[_A + key], tokens)
    for name, key in _SEQ_MEANS.items():
        if _A + key in r:
            out[name] = ratio(r[_A + key], sequences)
    for name, (key, count) in _EXTREMA.items():
        if _A + key in r:
            out[name] = r[_A + key] if r.get(count, 0.0) > 0 else 0.0

    sum_w, sum_w2 = r[_A + "clamped_weight_sum"], r[_A + "clamped_weight_sq_sum"]
    out["rollout_is/std"] = math.sqrt(max(ratio(sum_w2, tokens) - ratio(sum_w, tokens) ** 2, 0.0))
    out["rollout_is/eff_sample_size"] = ratio(sum_w * sum_w, tokens * sum_w2) if sum_w2 > 0 else 0.0
    out["mismatch/mismatch_chi2_token"] = ratio(r[_A + "rho_token_sq_sum"], tokens) - 1.0 if tokens > 0 else 0.0
    out["mismatch/mismatch_chi2_seq"] = ratio(r[_A + "seq_rho_sq_sum"], sequences) - 1.0 if sequences > 0 else 0.0
    s1, s2 = r[_A + "seq_weight_sum"], r[_A + "seq_weight_sq_sum"]
    seq_var = (s2 - s1 * s1 / sequences) / (sequences - 1) if sequences > 1 else 0.0
    out["rollout_is/seq_std"] = math.sqrt(max(seq_var, 0.0))
    out["rollout_is/rejected_token_fraction"] = ratio(r[_A + "rejected_tokens"], r[MASK_TOKENS])
    out["rollout_is/nonfinite_tokens"] = r[NONFINITE_TOKENS]
    return dict(sorted(out.items()))
