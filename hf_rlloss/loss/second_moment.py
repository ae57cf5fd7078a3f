"""M2PO's second-moment trust region: mask the most off-policy tokens until the step's second moment is bounded.

"Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?" (Zheng et al., 2025,
arXiv 2510.01161) bounds the second moment of the log importance ratio of the whole batch,

    M₂ = mean_{t∈K} δ_t²,        δ_t = log π_old(o_t) − log μ(o_t),

by masking the tokens with the largest ``δ_t²`` until ``M₂ ≤ τ`` over the kept tokens ``K``. The kept set is
defined by a bound on the value, so that it depends only on the step's multiset of ``δ²`` and not on the order of the
tokens, the micro-batches or the ranks: ``K = {t : δ_t² ≤ h}`` with ``h`` the largest of the step's ``δ²`` values
for which the mean over ``K`` is ``≤ τ``. Tokens tied at a value are kept or masked together; if even the smallest
value exceeds ``τ``, every token is masked (the step trains on nothing: `rollout_is/m2_masked_fraction` = 1).

The ratio is the one rollout IS uses (`hf_rlloss.loss.rollout_is`): π_old, the policy at the start of the optimizer
step, against the behaviour policy μ, so that the mask is a constant of the step, known before the denominators are
counted, and exact over the step's micro-batches and ranks (one all-gather of the ``δ²`` values). With one optimizer
step per batch, π_old is the policy the loss differentiates, as in the paper.

`m2_keep_bound` is the bound of the kept set over the step's values; `second_moment_mask` applies it to a step's
micro-batches (called by `GRPOLossContext.build_batches` before the denominators are counted).
"""

from __future__ import annotations

from typing import Any

import torch

from ..parallel.collectives import all_gather_1d
from .metrics import M2_ACC, M2_TOKENS, accumulate_metrics

__all__ = ["m2_keep_bound", "second_moment_mask"]


def m2_keep_bound(delta_sq: torch.Tensor, threshold: float) -> float:
    """The bound ``h`` of the kept set ``{δ² ≤ h}`` whose mean is ``≤ threshold``, over all the step's tokens.

    Args:
        delta_sq (`torch.Tensor`): `(N,)` the ``δ_t²`` of every valid token of the step (any order).
        threshold (`float`): τ > 0.

    Returns:
        `float`: ``inf`` when the mean over every token is already ``≤ τ`` (nothing masked, ``N = 0`` included),
        ``-inf`` when even the smallest value exceeds τ (everything masked), else the largest value ``v`` of
        `delta_sq` with ``mean{δ² ≤ v} ≤ τ``.
    """
    values = torch.sort(delta_sq.detach().double().flatten()).values  # (N,) ascending
    n = values.numel()
    if n == 0 or float(values.mean()) <= threshold:
        return float("inf")
    prefix_mean = values.cumsum(0) / torch.arange(1, n + 1, dtype=torch.float64, device=values.device)  # (N,)
    block_end = torch.ones(n, dtype=torch.bool, device=values.device)  # the last index of each run of equal values
    block_end[:-1] = values[1:] != values[:-1]
    admissible = torch.nonzero(block_end & (prefix_mean <= threshold)).flatten()
    if admissible.numel() == 0:
        return float("-inf")
    return float(values[admissible[-1]])  # prefix means of an ascending sequence do not decrease


def second_moment_mask(contexts: list[Any], threshold: float, process_group: Any = None) -> None:
    """M2PO's mask over one optimizer step: reject the step's tokens with the largest `δ² = (log π_old − log μ)²`
    until the mean over the kept ones, on every micro-batch and rank, is ≤ `threshold` (`m2_keep_bound` of the
    step's values, one all-gather), counting them in the `rollout_is/m2_*` accumulators.

    Args:
        contexts (`list[BaseRLLossContext]`): this rank's micro-batches of the step, each with `old_logprobs` and
            `rollout_logprobs`; their rejected tokens are dropped (`drop_tokens`) before the step's denominators.
        threshold (`float`): τ > 0 (`rollout_is.m2_threshold`).
        process_group (`ProcessGroup`, *optional*): every rank of the step; defaults to the whole world.
    """
    deltas = []
    for i, ctx in enumerate(contexts):
        kwargs = ctx.loss_kwargs
        if kwargs.old_logprobs is None or kwargs.rollout_logprobs is None:
            raise ValueError(
                f"rollout_is.m2_threshold needs old_logprobs and rollout_logprobs; {ctx.label(i)} lacks "
                f"{'old_logprobs' if kwargs.old_logprobs is None else 'rollout_logprobs'}"
            )
        old = kwargs.old_logprobs if kwargs.old_kept_logmass is None else kwargs.old_logprobs - kwargs.old_kept_logmass
        deltas.append((old.double() - kwargs.rollout_logprobs.double()).square())  # (B, T)
    local = torch.cat([delta_sq[ctx.mask] for delta_sq, ctx in zip(deltas, contexts)])
    bound = m2_keep_bound(all_gather_1d(local, process_group), threshold)
    for ctx, delta_sq in zip(contexts, deltas):
        mask = ctx.mask
        values = delta_sq[mask]  # (N,)
        kept = values <= bound
        ctx.drop_tokens(mask & (delta_sq > bound))
        ctx.pending_metrics = accumulate_metrics(
            ctx.pending_metrics,
            {
                M2_TOKENS: torch.tensor(float(values.numel()), dtype=torch.float64),
                M2_ACC + "sum": values.sum(),
                M2_ACC + "kept_sum": values[kept].sum(),
                M2_ACC + "kept_tokens": kept.sum().double(),
                M2_ACC + "masked_tokens": (~kept).sum().double(),
            },
        )
