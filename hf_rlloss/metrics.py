"""Train-policy metrics: accumulated as sums, counts and extrema, reduced across processes, divided at the end.

Each metric key has a declared reduction (SUM, MAX or MIN); nothing is inferred from substrings of its name.
Per micro-batch (and per chunk) the context emits 0-dim tensors; :func:`accumulate_metrics` merges them over the
micro-batches of an optimizer step on one rank, and :func:`finalize_train_policy_metrics` reduces them across ranks
with one all-reduce per reduction kind and turns sums into means. A mean whose count is zero is ``0.0``, never NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from .distributed import all_reduce


class Reduction(str, Enum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"


_OPS = {Reduction.SUM: dist.ReduceOp.SUM, Reduction.MAX: dist.ReduceOp.MAX, Reduction.MIN: dist.ReduceOp.MIN}
# Neutral element of each reduction: what a rank without any valid token contributes.
_IDENTITY = {Reduction.SUM: 0.0, Reduction.MAX: float("-inf"), Reduction.MIN: float("inf")}

P = "train_policy/"
VALID_TOKENS = P + "valid_tokens"
ENTROPY_TOKENS = P + "entropy_tokens"

METRIC_REDUCTIONS: dict[str, Reduction] = {
    VALID_TOKENS: Reduction.SUM,
    P + "ratio_abs_dev_sum": Reduction.SUM,
    P + "kl1_sum": Reduction.SUM,
    P + "kl3_sum": Reduction.SUM,
    P + "clip_low_count": Reduction.SUM,
    P + "clip_high_count": Reduction.SUM,
    P + "dual_clip_count": Reduction.SUM,
    P + "opsm_masked_count": Reduction.SUM,
    P + "ref_kl_sum": Reduction.SUM,
    P + "entropy_sum": Reduction.SUM,
    ENTROPY_TOKENS: Reduction.SUM,
    P + "entropy_kept_sum": Reduction.SUM,
    P + "entropy_kept_tokens": Reduction.SUM,
    P + "nonfinite_masked_tokens": Reduction.SUM,
    P + "ratio_max": Reduction.MAX,
    P + "ratio_min": Reduction.MIN,
    # Each micro-batch's loss is already divided by the step's global denominator: the sum over micro-batches and
    # ranks is the step's loss.
    "loss/policy": Reduction.SUM,
    "loss/kl": Reduction.SUM,
    "loss/router_aux": Reduction.SUM,
    "loss/entropy_bonus": Reduction.SUM,
    "loss/total": Reduction.SUM,
}

# finalized name -> (numerator key, denominator key)
_MEANS = {
    P + "ratio_abs_dev_mean": (P + "ratio_abs_dev_sum", VALID_TOKENS),
    P + "kl1": (P + "kl1_sum", VALID_TOKENS),
    P + "kl3": (P + "kl3_sum", VALID_TOKENS),
    P + "clip_frac_low": (P + "clip_low_count", VALID_TOKENS),
    P + "clip_frac_high": (P + "clip_high_count", VALID_TOKENS),
    P + "dual_clip_frac": (P + "dual_clip_count", VALID_TOKENS),
    P + "opsm_masked_frac": (P + "opsm_masked_count", VALID_TOKENS),
    P + "ref_kl": (P + "ref_kl_sum", VALID_TOKENS),
    P + "entropy": (P + "entropy_sum", ENTROPY_TOKENS),
    # the tokens `top_entropy_quantile` keeps (what TRL's adaptive entropy control measures)
    P + "entropy_kept": (P + "entropy_kept_sum", P + "entropy_kept_tokens"),
}


_FINALIZERS: list[Callable[[dict[str, float]], dict[str, float]]] = []


def register_finalizer(fn: Callable[[dict[str, float]], dict[str, float]]) -> Callable:
    """Register ``fn(reduced) -> final metrics``, applied by `finalize_train_policy_metrics` to the all-reduced
    values of every declared key (decorator). Lets a module add derived metrics without extra collectives."""
    _FINALIZERS.append(fn)
    return fn


def register_metric(name: str, reduction: Reduction | str) -> None:
    """Declare how a custom metric key is reduced across micro-batches and processes."""
    METRIC_REDUCTIONS[name] = Reduction(reduction)


def accumulate_metrics(total: dict[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``new`` into ``total`` in place (SUM adds, MAX/MIN keep the extremum); undeclared keys add up."""
    for key, value in new.items():
        if key not in total:
            total[key] = value
            continue
        kind = METRIC_REDUCTIONS.get(key, Reduction.SUM)
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
    present = [k for k in METRIC_REDUCTIONS if k in values]
    reduced: dict[str, float] = {}
    for kind in Reduction:
        keys = [k for k in present if METRIC_REDUCTIONS[k] is kind]
        if keys:
            reduced.update(_reduce_group(values, keys, kind, device, group))
    return reduced


def _reduce_group(values: dict[str, Any], keys: Iterable[str], kind: Reduction, device, group) -> dict[str, float]:
    keys = list(keys)
    packed = torch.tensor(
        [float(values.get(key, _IDENTITY[kind])) for key in keys], dtype=torch.float64, device=device
    )
    all_reduce(packed, _OPS[kind], group)  # float64: token counts stay exact well past 2**24
    return dict(zip(keys, packed.tolist()))


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
        `dict`: undeclared keys unchanged; `train_policy/*` sums and counts replaced by means (0.0 if the count is 0),
        `train_policy/ratio_max`/`ratio_min` global extrema (0.0 when there is no valid token), `loss/*` global sums,
        and what registered finalizers derive (the `mismatch/*` and `rollout_is/*` metrics of rollout IS).
    """
    if VALID_TOKENS not in extra_info:
        return extra_info
    out = {k: v for k, v in extra_info.items() if k not in METRIC_REDUCTIONS}
    reduced = reduce_metrics(extra_info, device, group)
    valid = reduced[VALID_TOKENS]
    for name, (num, den) in _MEANS.items():
        if num in reduced:
            count = reduced.get(den, 0.0)
            out[name] = reduced[num] / count if count > 0 else 0.0
    for name in (P + "ratio_max", P + "ratio_min"):
        if name in reduced:
            out[name] = reduced[name] if valid > 0 else 0.0
    for key, value in reduced.items():
        if key.startswith("loss/") or key in (VALID_TOKENS, P + "nonfinite_masked_tokens"):
            out[key] = value
    for finalizer in _FINALIZERS:
        out.update(finalizer(reduced))
    return out
