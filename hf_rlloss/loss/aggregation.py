"""Loss aggregation as per-token weights, normalized globally over an optimizer step.

Every mode is a weighted sum ``L = Σ_t w_t·ℓ_t`` over all valid tokens of all micro-batches of the step on all
data-parallel (and sequence-parallel) ranks, with (``m`` the valid mask, ``n_i`` the valid tokens of sequence ``i``,
``N`` = Σ m and ``S`` the number of non-empty sequences, or of all sequences, empty ones included, with
``count_empty_sequences`` (as TRL's ``grpo``/``dr_grpo`` count rows); both global):

| mode | weight ``w_t`` | used by |
|---|---|---|
| ``token-mean`` | ``m / N`` | DAPO, XTuner (default) |
| ``seq-mean-token-mean`` | ``m / (n_i · S)`` | original GRPO, GSPO, GMPO |
| ``seq-mean-token-sum`` | ``m / S`` | |
| ``seq-mean-token-sum-norm`` | ``m / (S · C)`` | Dr. GRPO, C = ``loss_scale_factor`` |

Dr. GRPO: https://arxiv.org/abs/2503.20783.

Because the denominators are global, how the step is split into micro-batches and ranks does not change the loss.
"""

from __future__ import annotations

import torch


def aggregation_weights(
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    seq_token_counts: torch.Tensor,
    mode: str,
    global_tokens: float,
    global_sequences: float,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Per-token aggregation weights of one micro-batch.

    Args:
        mask (`torch.Tensor`): `(B, T)` bool, the valid tokens.
        seq_ids (`torch.Tensor`): `(B, T)` int64, the index of each token's sequence in `seq_token_counts` (-1 for
            positions that belong to no sequence).
        seq_token_counts (`torch.Tensor`): `(S_local,)`, the valid tokens of each whole sequence (over all SP shards).
        mode (`str`): the aggregation mode.
        global_tokens (`float`): valid tokens of the whole step, all ranks.
        global_sequences (`float`): sequences of the whole step, all ranks: the non-empty ones, or all of them with
            `count_empty_sequences` (the caller counts, see `GRPOLossContext.build_batches`).
        loss_scale_factor (`float`, *optional*): the constant ``C`` of ``seq-mean-token-sum-norm``.

    Returns:
        `torch.Tensor`: `(B, T)` float32 weights, zero outside `mask`.
    """
    maskf = mask.to(torch.float32)
    if mode == "token-mean":
        return maskf / max(global_tokens, 1.0)
    sequences = max(global_sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return maskf / sequences
    if mode == "seq-mean-token-sum-norm":
        return maskf / (sequences * float(loss_scale_factor))
    if mode == "seq-mean-token-mean":
        counts = seq_token_counts.to(torch.float32).clamp(min=1.0)
        per_token_count = counts[seq_ids.clamp(min=0)]
        return maskf / (per_token_count * sequences)
    raise ValueError(f"loss_agg_mode={mode!r} is not supported")
