"""Metrics of the loss layer: one spec per key, accumulated as sums, counts and extrema, reduced, then divided.

Every key the loss layer emits is declared once in `METRICS`, as a `MetricSpec`: how it is reduced across
micro-batches and processes (SUM, MAX or MIN; nothing is inferred from substrings of its name), its neutral value
(what a rank without data contributes), and what it is logged as (a mean over a count key, an extremum, or the sum
itself) with its meaning. The few logged values that are not one accumulator over one count (standard deviations, the
effective sample size) are `DerivedMetric`s. From these two tables come the neutral metrics every rank emits
(`neutral_metrics`), the finalize step (`finalize_reduced`) and the documented metrics table
(`metrics_table`, kept equal to the table in `docs/rollout_is.md` by `tests/test_metrics.py`).

Per micro-batch (and per chunk) the context emits 0-dim tensors; :func:`accumulate_metrics` merges them over the
micro-batches of an optimizer step on one rank, and :func:`finalize_train_policy_metrics` reduces them across ranks
with one all-reduce per reduction kind and turns sums into means. A mean whose count is zero is ``0.0``, never NaN.

Notation of the rollout-IS meanings (`hf_rlloss.loss.rollout_is`): ``δ_t = log π_old − log μ`` of a valid token with
finite log-probs, ``δ̂ = clamp(δ, ±20)``, ``ρ`` the level's weight before truncation and rejection,
``w = clamp(ρ, lower, upper)``, ``s_i = mean_{t∈i} ρ_t`` (``= ρ_i`` at the sequence and geometric levels),
``d_i = mean_{t∈i} log μ − mean_{t∈i} log π_old``; sequences are those with at least one valid finite token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.collectives import all_reduce


class Reduction(str, Enum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"


_OPS = {Reduction.SUM: dist.ReduceOp.SUM, Reduction.MAX: dist.ReduceOp.MAX, Reduction.MIN: dist.ReduceOp.MIN}
# Neutral element of each reduction: what a rank without any valid token contributes.
_IDENTITY = {Reduction.SUM: 0.0, Reduction.MAX: float("-inf"), Reduction.MIN: float("inf")}


@dataclass(frozen=True)
class MetricSpec:
    """One accumulated metric key.

    Args:
        key (`str`): the key emitted per micro-batch and accumulated over the step.
        reduction (`Reduction`): how values of the key are merged (micro-batches) and all-reduced (processes).
        meaning (`str`): what the logged value is (documentation; the docs metrics table is made from it).
        logged_as (`str`, *optional*): the key it is logged as. Unset: an accumulator only (a count, or an input of
            a `DerivedMetric`).
        per (`str`, *optional*): a SUM key: the value is logged as ``scale · key / per + offset`` (``0.0`` when the
            count is 0). A MAX/MIN key: the count that says the extremum exists (``0.0`` otherwise).
        scale, offset (`float`, *optional*, defaults to `1.0`, `0.0`): of a mean (see `per`).
        counts (`str`, *optional*): for a count key, what it counts (names the mean in the documentation).
        emitted (`str`, *optional*): the feature under which a loss context always emits the key (at its neutral
            value when it has no data), so that every rank reduces the same keys; see `neutral_metrics`.
        trl (`str`, *optional*): the key TRL's `GRPOTrainer` logs this value under. It is computed as TRL does:
            per micro-batch over all ranks (a SUM over `per`, an extremum, or a sum), appended once per micro-batch
            to TRL's metric lists, which TRL's `log` averages over the logging window (see `trl_micro_batch_metrics`).
        trl_note (`str`, *optional*): when the value differs from TRL's, how (documentation).
    """

    key: str
    reduction: Reduction
    meaning: str
    logged_as: str | None = None
    per: str | None = None
    scale: float = 1.0
    offset: float = 0.0
    counts: str | None = None
    emitted: str | None = None
    trl: str | None = None
    trl_note: str = ""

    @property
    def neutral(self) -> float:
        """The value of a rank without data: the identity of the reduction."""
        return _IDENTITY[self.reduction]


@dataclass(frozen=True)
class DerivedMetric:
    """A logged value computed from several reduced accumulators (logged when they are all present).

    Args:
        key (`str`): the logged key.
        inputs (`tuple[str, ...]`): the accumulated keys it reads.
        fn (`Callable`): ``fn(*values) -> float`` of the reduced `inputs`, in order.
        computed_as (`str`): the formula's short form (documentation).
        meaning (`str`): what it is (documentation).
    """

    key: str
    inputs: tuple[str, ...]
    fn: Callable[..., float]
    computed_as: str
    meaning: str


SUM, MAX, MIN = Reduction.SUM, Reduction.MAX, Reduction.MIN
TRAIN_POLICY = "train_policy/"
VALID_TOKENS = TRAIN_POLICY + "valid_tokens"
ENTROPY_TOKENS = TRAIN_POLICY + "entropy_tokens"
ENTROPY_KEPT_TOKENS = TRAIN_POLICY + "entropy_kept_tokens"
# The accumulators of rollout IS (`hf_rlloss.loss.rollout_is.compute_rollout_is` emits them).
ROLLOUT_IS_ACC = "rollout_is_acc/"
IS_MASK_TOKENS = ROLLOUT_IS_ACC + "mask_tokens"
IS_VALID_TOKENS = ROLLOUT_IS_ACC + "valid_tokens"
IS_SEQUENCES = ROLLOUT_IS_ACC + "sequences"
IS_NONFINITE_TOKENS = ROLLOUT_IS_ACC + "nonfinite_tokens"
# The accumulators of M2PO's second-moment mask (`rollout_is.m2_threshold`, `hf_rlloss.loss.second_moment`).
M2_ACC = ROLLOUT_IS_ACC + "m2_"
M2_TOKENS = M2_ACC + "tokens"


def _tp(name: str, reduction: Reduction, logged: str | None, meaning: str, **fields: Any) -> MetricSpec:
    """A `train_policy/*` key, logged as `train_policy/<logged>`; by default a mean over the valid tokens that every
    loss context emits."""
    fields = {"per": VALID_TOKENS, "emitted": "always", **fields}
    logged_as = None if logged is None else TRAIN_POLICY + logged
    return MetricSpec(TRAIN_POLICY + name, reduction, meaning, logged_as, **fields)


TRL = "trl/"
TRL_UNITS = TRL + "units"
# TRL's loss-specific metrics by the `trl_metrics` family of the policy loss (`PolicyLossSpec.trl_metrics`), and the
# feature under which a context emits their accumulators.
TRL_FAMILIES = {"clip": "trl_clip", "cispo": "trl_cispo", "vespo": "trl_vespo"}
_SEQ_LEVEL = (
    "TRL's `importance_sampling_level='sequence'` form (`gspo`, `cispo_seq`, `vespo`) is averaged over sequences "
    "(every row of the micro-batch), as TRL does"
)


def _trl(name: str, reduction: Reduction, trl: str, meaning: str, emitted: str, **fields: Any) -> MetricSpec:
    """A `trl/<name>` accumulator logged only under TRL's key `trl`, per micro-batch (by default a mean over
    `trl/units`: valid tokens, or sequences at TRL's sequence level)."""
    return MetricSpec(
        TRL + name, reduction, meaning, per=fields.pop("per", TRL_UNITS), emitted=emitted, trl=trl, **fields
    )


TRL_SPECS = [
    MetricSpec(
        TRL_UNITS,
        SUM,
        "what TRL averages its loss-specific metrics over: valid tokens, or sequences at TRL's sequence level",
        counts="valid tokens (sequences at TRL's sequence level)",
        emitted="trl",
    ),
    _trl(
        "policy_loss",
        SUM,
        "policy_loss",
        "the loss before the entropy bonus and the router loss (`loss/policy + loss/kl`), per micro-batch as TRL: "
        "the micro-batch's own loss under sequence aggregations, its share of the step's under `token-mean`",
        "trl",
        per=None,
        trl_note="TRL's `bnpo` (a token mean per micro-batch) is our global `token-mean`: its value is then the "
        "micro-batch's share of the step's token mean, not its own token mean. With a step spanning two generation "
        "batches (`steps_per_generation` ≠ `gradient_accumulation_steps`) the loss itself is normalized differently "
        "(see design.md). TRL logs it only with an entropy bonus; we log it always.",
    ),
    _trl(
        "kl_sum",
        SUM,
        "kl",
        "mean per-token k3 KL to the reference (× TRL's IS ratio under `kl_bias_correction`), over valid tokens",
        "trl_kl",
        per=VALID_TOKENS,
        trl_note="logged only when `kl_loss_type` is `k3`/`low_var_kl` (TRL's estimator); ours clamps k3 at 10 "
        "(verl's), TRL does not: they differ only for tokens with `log π_ref − log π_θ` above about 2.5.",
    ),
    _trl("clip_low_sum", SUM, "clip_ratio/low_mean", "share of units with `A < 0` and `r < 1 − ε_low`", "trl_clip"),
    _trl("clip_high_sum", SUM, "clip_ratio/high_mean", "share of units with `A > 0` and `r > 1 + ε_high`", "trl_clip"),
    _trl("clip_region_sum", SUM, "clip_ratio/region_mean", "share of units clipped low or high", "trl_clip"),
    _trl(
        "clip_low_seq_min",
        MIN,
        "clip_ratio/low_min",
        "smallest per-sequence share of tokens clipped low (sequences with a valid token)",
        "trl_clip",
    ),
    _trl(
        "clip_high_seq_max",
        MAX,
        "clip_ratio/high_max",
        "largest per-sequence share of tokens clipped high (sequences with a valid token)",
        "trl_clip",
    ),
    _trl(
        "cispo_clip_sum",
        SUM,
        "cispo_clip_ratio",
        "share of units with `A > 0` whose IS weight was capped",
        "trl_cispo",
    ),
    _trl("phi_seq_sum", SUM, "vespo/phi_seq_mean", "VESPO's sequence weight `φ(w_i)`, over sequences", "trl_vespo"),
]


def _loss(name: str, meaning: str, emitted: str | None) -> MetricSpec:
    # Each micro-batch's loss is already divided by the step's global denominator: the sum over micro-batches and
    # ranks is the step's loss.
    return MetricSpec("loss/" + name, SUM, meaning, "loss/" + name, emitted=emitted)


def _is(name: str, reduction: Reduction, logged: str | None, meaning: str, per: str | None, **fields) -> MetricSpec:
    """A rollout-IS accumulator `rollout_is_acc/<name>`, logged as `logged` (over `per`: V, S or all valid tokens)."""
    return MetricSpec(ROLLOUT_IS_ACC + name, reduction, meaning, logged, per=per, **fields)


_V, _S, _M = IS_VALID_TOKENS, IS_SEQUENCES, IS_MASK_TOKENS
_SPECS = [
    # ---- train_policy/*: how far the policy moved from π_old, on the valid tokens (r = π_θ / π_old) ----
    _tp(
        "valid_tokens",
        SUM,
        "valid_tokens",
        "valid (loss-carrying) tokens of the step",
        per=None,
        counts="valid tokens",
    ),
    _tp("ratio_abs_dev_sum", SUM, "ratio_abs_dev_mean", "`abs(r − 1)`"),
    _tp("kl1_sum", SUM, "kl1", "`log π_old − log π_θ`: k1 estimate of KL(π_old ‖ π_θ)"),
    _tp("kl3_sum", SUM, "kl3", "`r − 1 − log r` (log r clamped to ±20): k3 estimate of KL(π_old ‖ π_θ)"),
    _tp("clip_low_count", SUM, "clip_frac_low", "share of tokens with `A < 0` and `r < 1 − ε_low`"),
    _tp("clip_high_count", SUM, "clip_frac_high", "share of tokens with `A > 0` and `r > 1 + ε_high`"),
    _tp("dual_clip_count", SUM, "dual_clip_frac", "share of tokens where the dual-clip bound was chosen"),
    _tp(
        "opsm_masked_count",
        SUM,
        "opsm_masked_frac",
        "share of tokens dropped by the off-policy sequence mask (OPSM)",
        emitted="opsm",
    ),
    _tp("ref_kl_sum", SUM, "ref_kl", "the KL estimate to the reference (`kl_loss_type`)", emitted="kl"),
    _tp(
        "entropy_sum",
        SUM,
        "entropy",
        "full-vocabulary entropy of the policy (hidden-state path)",
        per=ENTROPY_TOKENS,
        emitted="entropy",
        trl="entropy",
    ),
    _tp("entropy_tokens", SUM, None, "tokens with an entropy", per=None, counts="valid tokens", emitted="entropy"),
    _tp(
        "entropy_kept_sum",
        SUM,
        "entropy_kept",
        "entropy of the tokens `top_entropy_quantile` keeps (what TRL's adaptive entropy control measures)",
        per=ENTROPY_KEPT_TOKENS,
        emitted="entropy_kept",
    ),
    _tp("entropy_kept_tokens", SUM, None, "kept tokens", per=None, counts="kept tokens", emitted="entropy_kept"),
    _tp(
        "nonfinite_masked_tokens",
        SUM,
        "nonfinite_masked_tokens",
        "tokens dropped for a NaN/±inf input (`nonfinite_inputs='mask'`)",
        per=None,
        emitted=None,
    ),
    _tp("ratio_max", MAX, "ratio_max", "largest `r`"),
    _tp("ratio_min", MIN, "ratio_min", "smallest `r`"),
    # ---- loss/*: the step's global loss and its parts ----
    _loss("policy", "the policy loss", "always"),
    _loss("kl", "the KL loss (`kl_loss_coef` × the aggregated KL estimate)", "kl"),
    _loss("router_aux", "the MoE router load-balancing loss (the trainer's)", None),
    _loss("entropy_bonus", "the entropy bonus `−entropy_coef · H̄`", "entropy_bonus"),
    _loss("total", "the step's total loss", None),
    # ---- rollout IS (V: valid tokens with finite log-probs; S: sequences with a token in V) ----
    MetricSpec(IS_MASK_TOKENS, SUM, "valid tokens, finite or not", counts="valid tokens"),
    MetricSpec(IS_VALID_TOKENS, SUM, "valid tokens with finite log-probs", counts="valid finite tokens"),
    MetricSpec(IS_SEQUENCES, SUM, "sequences (counted on SP rank 0)", counts="sequences"),
    MetricSpec(
        IS_NONFINITE_TOKENS,
        SUM,
        "valid tokens with a NaN/±inf old or rollout log-prob (rejected)",
        "rollout_is/nonfinite_tokens",
    ),
    MetricSpec(
        M2_TOKENS, SUM, "valid tokens the second-moment mask ranked (`m2_threshold` set)", counts="ranked tokens"
    ),
    _is("m2_sum", SUM, "rollout_is/m2", "`δ_t²` before the second-moment mask: the step's M₂", M2_TOKENS),
    _is(
        "m2_kept_sum",
        SUM,
        "rollout_is/m2_kept",
        "`δ_t²` of the tokens the second-moment mask kept: ≤ `m2_threshold`",
        M2_ACC + "kept_tokens",
    ),
    MetricSpec(M2_ACC + "kept_tokens", SUM, "tokens the second-moment mask kept", counts="kept tokens"),
    _is(
        "m2_masked_tokens",
        SUM,
        "rollout_is/m2_masked_fraction",
        "share of ranked tokens rejected by the second-moment mask (M2PO)",
        M2_TOKENS,
    ),
    _is(
        "rejected_tokens",
        SUM,
        "rollout_is/rejected_token_fraction",
        "share of valid tokens rejected for any reason",
        _M,
    ),
    _is("delta_sum", SUM, "mismatch/mismatch_kl", "of `δ_t`: the k1 estimate of KL(μ ‖ π_old)", _V, scale=-1.0),
    _is("abs_delta_sum", SUM, "mismatch/mismatch_logprob_abs_diff", "`abs(δ_t)`", _V),
    _is("k3_sum", SUM, "mismatch/mismatch_k3_kl", "`exp(δ̂) − δ̂ − 1`: k3 estimate of KL(μ ‖ π_old)", _V),
    _is("rho_token_sq_sum", SUM, "mismatch/mismatch_chi2_token", "of `exp(δ̂_t)²`: χ²(π_old ‖ μ)", _V, offset=-1.0),
    _is("weight_sum", SUM, "rollout_is/mean", "`ρ` (above token level: `ρ_i` at each token)", _V),
    _is("clamped_weight_sum", SUM, None, "`w`", None),
    _is("clamped_weight_sq_sum", SUM, None, "`w²`", None),
    _is("high_tokens", SUM, "rollout_is/fraction_high", "share of tokens with `ρ > upper` (bounds set)", _V),
    _is("low_tokens", SUM, "rollout_is/fraction_low", "share of tokens with `ρ < lower` (bounds set)", _V),
    _is("masked_tokens", SUM, "rollout_is/masked_fraction", "share rejected by the mask band (`mask`, `both`)", _V),
    _is(
        "catastrophic_tokens",
        SUM,
        "rollout_is/catastrophic_token_fraction",
        "share of tokens outside the veto bounds (veto set)",
        _V,
    ),
    _is(
        "kept_mass_sum",
        SUM,
        "mismatch/kept_mass_mean",
        "probability mass the sampling truncation kept (1 without it); logged when known (HF `generate`, or replayed)",
        _V,
    ),
    _is("training_ppl_sum", SUM, "mismatch/mismatch_training_ppl", "`exp(−mean_{t∈i} log π_old)`", _S),
    _is("training_log_ppl_sum", SUM, "mismatch/mismatch_training_log_ppl", "`−mean_{t∈i} log π_old`", _S),
    _is("rollout_ppl_sum", SUM, "mismatch/mismatch_rollout_ppl", "`exp(−mean_{t∈i} log μ)`", _S),
    _is("rollout_log_ppl_sum", SUM, "mismatch/mismatch_rollout_log_ppl", "`−mean_{t∈i} log μ`", _S),
    _is("log_ppl_diff_sum", SUM, "mismatch/mismatch_log_ppl_diff", "`d_i`", _S),
    _is("log_ppl_abs_diff_sum", SUM, "mismatch/mismatch_log_ppl_abs_diff", "`abs(d_i)`", _S),
    _is("ppl_ratio_sum", SUM, "mismatch/mismatch_ppl_ratio", "`exp(clamp(d_i, ±20))`: training ppl / rollout ppl", _S),
    _is(
        "seq_rho_sq_sum",
        SUM,
        "mismatch/mismatch_chi2_seq",
        "of `exp(clamp(Σ_{t∈i} δ_t, ±20))²`: χ² of whole sequences",
        _S,
        offset=-1.0,
    ),
    _is("seq_weight_sum", SUM, "rollout_is/seq_mean", "`s_i`", _S),
    _is("seq_weight_sq_sum", SUM, None, "`s_i²`", None),
    _is("high_sequences", SUM, "rollout_is/seq_fraction_high", "share of sequences with `s_i > upper`", _S),
    _is("low_sequences", SUM, "rollout_is/seq_fraction_low", "share of sequences with `s_i < lower`", _S),
    _is(
        "masked_sequences",
        SUM,
        "rollout_is/seq_masked_fraction",
        "share of sequences with a token rejected by the mask band",
        _S,
    ),
    _is("vetoed_sequences", SUM, "rollout_is/veto_fraction", "share of sequences vetoed (veto set)", _S),
    _is("weight_max", MAX, "rollout_is/max", "largest `ρ_t` (above token level: `ρ_i`)", _V),
    _is("weight_min", MIN, "rollout_is/min", "smallest `ρ_t` (above token level: `ρ_i`)", _V),
    _is("log_ppl_diff_max", MAX, "mismatch/mismatch_log_ppl_diff_max", "largest `d_i`", _S),
    _is("log_ppl_diff_min", MIN, "mismatch/mismatch_log_ppl_diff_min", "smallest `d_i`", _S),
    _is("seq_weight_max", MAX, "rollout_is/seq_max", "largest `s_i`", _S),
    _is("seq_weight_min", MIN, "rollout_is/seq_min", "smallest `s_i`", _S),
    _is("seq_max_deviation", MAX, "rollout_is/seq_max_deviation", "largest `abs(s_i − 1)`", _S),
    _is("kept_mass_min", MIN, "mismatch/kept_mass_min", "smallest kept probability mass", _V),
    # ---- trl/*: accumulators of TRL's own metric names, per micro-batch (see `trl_micro_batch_metrics`) ----
    *TRL_SPECS,
]
METRICS: dict[str, MetricSpec] = {spec.key: spec for spec in _SPECS}
"""Every accumulated key of the loss layer (and any added with `register_metric`), in declaration order."""


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _population_std(total: float, squares: float, count: float) -> float:
    return math.sqrt(max(_ratio(squares, count) - _ratio(total, count) ** 2, 0.0))


def _bessel_std(total: float, squares: float, count: float) -> float:
    variance = (squares - total * total / count) / (count - 1) if count > 1 else 0.0
    return math.sqrt(max(variance, 0.0))


def _effective_sample_size(total: float, squares: float, count: float) -> float:
    return _ratio(total * total, count * squares) if squares > 0 else 0.0


_W = (ROLLOUT_IS_ACC + "clamped_weight_sum", ROLLOUT_IS_ACC + "clamped_weight_sq_sum", IS_VALID_TOKENS)
_S = (ROLLOUT_IS_ACC + "seq_weight_sum", ROLLOUT_IS_ACC + "seq_weight_sq_sum", IS_SEQUENCES)
DERIVED: dict[str, DerivedMetric] = {
    d.key: d
    for d in (
        DerivedMetric("rollout_is/std", _W, _population_std, "population std over valid finite tokens", "of `w`"),
        DerivedMetric(
            "rollout_is/eff_sample_size",
            _W,
            _effective_sample_size,
            "`(mean_t w)² / mean_t w²`",
            "normalized effective sample size, in (0, 1]; low means a few tokens dominate",
        ),
        DerivedMetric("rollout_is/seq_std", _S, _bessel_std, "unbiased std over sequences (0 below 2)", "of `s_i`"),
    )
}
"""Logged values that are not one accumulator over one count."""

_FINALIZERS: list[Callable[[dict[str, float]], dict[str, float]]] = []


def register_finalizer(fn: Callable[[dict[str, float]], dict[str, float]]) -> Callable:
    """Register a finalizer of the step's metrics (decorator): `finalize_train_policy_metrics` calls `fn(reduced)`
    with the all-reduced values of the step's declared keys (`register_metric`, also those without `logged_as`)
    and logs what it returns. Lets user code add derived metrics, e.g. a ratio of two sums, without extra
    collectives.

    Args:
        fn (`Callable[[dict[str, float]], dict[str, float]]`): the reduced values by key to the metrics to log;
            it returns `{}` when the keys it reads are not in `reduced` (a step that emitted none of them).

    Returns:
        `fn`, unchanged.
    """
    _FINALIZERS.append(fn)
    return fn


def register_metric(
    name: str, reduction: Reduction | str, meaning: str = "", logged_as: str | None = None, per: str | None = None
) -> None:
    """Declare how a custom metric key is reduced across micro-batches and processes.

    Args:
        name (`str`): the key.
        reduction (`Reduction` or `str`): `"sum"`, `"max"` or `"min"`.
        meaning (`str`, *optional*): what it is.
        logged_as (`str`, *optional*): the key `finalize_train_policy_metrics` logs it as; unset, the reduced value
            is only passed to the finalizers (see `register_finalizer`).
        per (`str`, *optional*): a declared count key: a SUM is logged as a mean over it (see `MetricSpec`).
    """
    METRICS[name] = MetricSpec(name, Reduction(reduction), meaning, logged_as, per=per)


def neutral_metrics(features: Iterable[str], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Every key a loss context emits under `features` (`MetricSpec.emitted`), at its neutral value (0-dim)."""
    features = set(features)
    return {
        spec.key: torch.full((), spec.neutral, device=device)
        for spec in METRICS.values()
        if spec.emitted is not None and spec.emitted in features
    }


def accumulate_metrics(total: dict[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``new`` into ``total`` in place (SUM adds, MAX/MIN keep the extremum); undeclared keys add up."""
    for key, value in new.items():
        if key not in total:
            total[key] = value
            continue
        spec = METRICS.get(key)
        kind = spec.reduction if spec is not None else Reduction.SUM
        if kind is Reduction.SUM:
            total[key] = total[key] + value
        elif kind is Reduction.MAX:
            total[key] = torch.maximum(torch.as_tensor(total[key]), torch.as_tensor(value))
        else:
            total[key] = torch.minimum(torch.as_tensor(total[key]), torch.as_tensor(value))
    return total


def reduce_metrics(
    values: Mapping[str, Any], device: torch.device | str | None = None, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """All-reduce every declared key of ``values`` with its reduction: one collective per reduction kind.

    Keys are packed in declaration order, so every rank must hold the same set of declared keys (a rank without
    data emits them at their neutral value). Undeclared keys are ignored. Returns plain floats.
    """
    present = [spec for key, spec in METRICS.items() if key in values]
    reduced: dict[str, float] = {}
    for kind in Reduction:
        keys = [spec.key for spec in present if spec.reduction is kind]
        if keys:
            packed = torch.tensor(
                [float(values.get(key, _IDENTITY[kind])) for key in keys], dtype=torch.float64, device=device
            )
            all_reduce(packed, _OPS[kind], group)  # float64: token counts stay exact well past 2**24
            reduced.update(zip(keys, packed.tolist()))
    return reduced


def finalize_reduced(reduced: Mapping[str, float]) -> dict[str, float]:
    """The logged values of the declared keys present in `reduced` (already all-reduced), and the derived ones.

    A mean is ``scale · sum / count + offset`` and ``0.0`` when its count is 0; an extremum is ``0.0`` when its count
    is 0; a sum is logged as it is.
    """
    out: dict[str, float] = {}
    for key, value in reduced.items():
        spec = METRICS.get(key)
        if spec is None or spec.logged_as is None:
            continue
        count = reduced.get(spec.per, 0.0) if spec.per is not None else None
        if count is None:
            out[spec.logged_as] = value
        elif spec.reduction is Reduction.SUM:
            out[spec.logged_as] = spec.scale * value / count + spec.offset if count > 0 else 0.0
        else:
            out[spec.logged_as] = value if count > 0 else 0.0
    for derived in DERIVED.values():
        if all(key in reduced for key in derived.inputs):
            out[derived.key] = derived.fn(*(reduced[key] for key in derived.inputs))
    return out


def finalize_train_policy_metrics(
    extra_info: dict[str, Any], device: torch.device | str | None = None, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Reduce a rank's accumulated metrics across processes and turn sums into means.

    Collective when distributed: every rank must call it, with the same set of declared keys present. It runs one
    all-reduce per reduction kind (SUM, MAX, MIN), whatever the number of metrics.

    Args:
        extra_info (`dict`): the metrics of one optimizer step on this rank, as merged by `accumulate_metrics`.
        device (`torch.device` or `str`, *optional*): device of the all-reduce buffer (the backend's device).
        group (`ProcessGroup`, *optional*): the processes to reduce over; defaults to the whole world.

    Returns:
        `dict`: undeclared keys unchanged, and the logged value of every declared key (see `metrics_table`):
        `train_policy/*` means (0.0 if the count is 0) and extrema (0.0 when there is no valid token), `loss/*`
        global sums, the `mismatch/*` and `rollout_is/*` metrics of rollout IS, and what registered finalizers derive.
    """
    return finalize_step_metrics([extra_info], device, group)[0]


def reduce_micro_batches(
    micro_batches: list[Mapping[str, Any]],
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[dict[str, float]]:
    """`reduce_metrics` of each micro-batch of a step, in one all-reduce per reduction kind for all of them.

    Every rank must hold as many micro-batches, and the same declared keys (their union over the micro-batches, a
    key missing from one counting as its neutral value there).
    """
    present = [spec for key, spec in METRICS.items() if any(key in mb for mb in micro_batches)]
    target = torch.device(device) if device is not None else torch.device("cpu")
    packs = []
    for kind in Reduction:
        keys = [spec.key for spec in present if spec.reduction is kind]
        if not keys:
            continue
        # built on the device from the accumulators as they are (0-d tensors or numbers): no host read per metric
        rows = [torch.stack([_scalar(mb.get(key, _IDENTITY[kind]), target) for key in keys]) for mb in micro_batches]
        packed = torch.stack(rows)  # (micro-batches, keys)
        all_reduce(packed, _OPS[kind], group)
        packs.append((keys, packed))
    reduced: list[dict[str, float]] = [{} for _ in micro_batches]
    if not packs:
        return reduced
    values = torch.cat([packed.flatten() for _, packed in packs]).tolist()  # the step's one read back to the host
    start = 0
    for keys, _ in packs:
        for out in reduced:
            out.update(zip(keys, values[start : start + len(keys)]))
            start += len(keys)
    return reduced


def _scalar(value: Any, device: torch.device) -> torch.Tensor:  # () float64 on `device`
    """A metric accumulator as a float64 scalar on `device`: a tensor is moved (a no-op where it already is), a Python
    number filled in on the device (no host-to-device copy)."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)


def trl_micro_batch_metrics(reduced: Mapping[str, float]) -> dict[str, float]:
    """TRL's metric keys of one micro-batch from its reduced accumulators (the specs with `trl` set).

    As TRL's `global_masked_mean`, a mean over no unit is ``0.0``; an extremum over no sequence is left out (TRL's
    `nanmin`/`nanmax` give NaN there, which its `log` drops).
    """
    out: dict[str, float] = {}
    for key, value in reduced.items():
        spec = METRICS.get(key)
        if spec is None or spec.trl is None:
            continue
        count = reduced.get(spec.per, 0.0) if spec.per is not None else None
        if count is None:
            out[spec.trl] = value
        elif spec.reduction is Reduction.SUM:
            out[spec.trl] = value / count if count > 0 else 0.0
        elif count > 0 and math.isfinite(value):  # a neutral ±inf: no rank had a sequence with a valid token
            out[spec.trl] = value
    return out


def finalize_step_metrics(
    micro_batches: list[Mapping[str, Any]],
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """The logged metrics of an optimizer step, and TRL's keys of each of its micro-batches.

    Collective when distributed (one all-reduce per reduction kind, see `reduce_micro_batches`).

    Args:
        micro_batches (`list[dict]`): this rank's metrics of each micro-batch of the step (as the contexts emit them).
        device (`torch.device` or `str`, *optional*): device of the all-reduce buffers (the backend's device).
        group (`ProcessGroup`, *optional*): the processes to reduce over; defaults to the whole world.

    Returns:
        `(dict, list[dict])`: what `finalize_train_policy_metrics` gives for the whole step (undeclared keys summed
        over the micro-batches, unreduced), and `trl_micro_batch_metrics` of each micro-batch. Without
        `train_policy/valid_tokens`, the micro-batches merged, unreduced, and no TRL keys.
    """
    step: dict[str, Any] = {}
    for mb in micro_batches:
        accumulate_metrics(step, mb)
    if VALID_TOKENS not in step:
        return step, []
    out = {k: v for k, v in step.items() if k not in METRICS}
    per_micro_batch = reduce_micro_batches(micro_batches, device, group)
    reduced: dict[str, Any] = {}
    for mb in per_micro_batch:  # the step's reduced values: the micro-batches' merged (sums, extrema)
        accumulate_metrics(reduced, mb)
    reduced = {key: float(value) for key, value in reduced.items()}
    out.update(finalize_reduced(reduced))
    for finalizer in _FINALIZERS:
        out.update(finalizer(reduced))
    return out, [trl_micro_batch_metrics(mb) for mb in per_micro_batch]


def metrics_table() -> str:
    """The Markdown table of every logged key: how it is computed over the step and what it is (docs/rollout_is.md)."""
    rows = ["| key | computed over the step | meaning |", "|---|---|---|"]
    for spec in METRICS.values():
        if spec.logged_as is None:
            continue
        if spec.per is None:
            how = "sum"
        else:
            what = {Reduction.SUM: "mean", Reduction.MAX: "max", Reduction.MIN: "min"}[spec.reduction]
            scale = {1.0: "", -1.0: "−"}.get(spec.scale, f"{spec.scale:g} × ")
            offset = f" {'+' if spec.offset > 0 else '−'} {abs(spec.offset):g}" if spec.offset else ""
            how = f"{scale}{what} over {METRICS[spec.per].counts}{offset}"
        rows.append(f"| `{spec.logged_as}` | {how} | {spec.meaning} |")
    rows += [f"| `{d.key}` | {d.computed_as} | {d.meaning} |" for d in DERIVED.values()]
    return "\n".join(rows) + "\n"


def trl_metrics_table() -> str:
    """The Markdown table of the TRL metric keys the loss layer logs: what they are and how they differ from TRL's
    (the one in `docs/metrics.md`, kept equal by `tests/test_trl_metric_names.py`)."""
    rows = ["| TRL key | from | meaning | vs TRL |", "|---|---|---|---|"]
    for spec in METRICS.values():
        if spec.trl is not None:
            how = f"`{spec.key}`" + (f" / `{spec.per}`" if spec.per and spec.reduction is Reduction.SUM else "")
            rows.append(f"| `{spec.trl}` | {how} | {spec.meaning} | {spec.trl_note or 'same'} |")
    return "\n".join(rows) + "\n"
