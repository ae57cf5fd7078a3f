"""The accumulators of TRL's own metric names (`kl`, `entropy`, `clip_ratio/*`, `policy_loss`, ...), per micro-batch.

TRL's `GRPOTrainer` logs, per micro-batch, means over the valid tokens of all ranks (or over sequences at its
`importance_sampling_level="sequence"`), and per-sequence extrema. A loss context emits the `trl/*` accumulators
declared in `hf_rlloss.loss.metrics.TRL_SPECS` from quantities its loss already has (the policy loss's indicators,
advantages, sequence ids and token counts, the KL estimate): no extra forward, no logits. Which of TRL's
loss-specific metrics apply is the policy loss's `trl_metrics` family (`PolicyLossSpec`).

Notation: ``f_i`` is the share of sequence ``i``'s valid tokens where an indicator is set (``n_i`` its valid tokens
over all SP shards); at TRL's token level a mean is over tokens, at its sequence level ``Σ_i f_i`` over the rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..parallel.collectives import all_reduce
from ..parallel.sequence import sp_group, sp_rank, sp_world_size
from .metrics import TRL, TRL_FAMILIES, TRL_UNITS

K3_TYPES = ("k3", "low_var_kl")  # TRL's KL estimator (k3, not clamped in TRL; see the `kl` spec's note)
# Per-sequence counts of clipped tokens, summed over the chunks; turned into `trl/clip_*_seq_*` by `finish`.
_SEQ_LOW, _SEQ_HIGH = "_trl_seq_low", "_trl_seq_high"


def trl_features(cfg) -> list[str]:
    """The `emitted` features of the `trl/*` keys a context of `cfg` emits (see `neutral_metrics`)."""
    features = ["trl"]
    if cfg.use_kl_loss and cfg.kl_loss_type in K3_TYPES:
        features.append("trl_kl")
    family = cfg.policy_loss_cfg.spec.trl_metrics
    if family is not None:
        features.append(TRL_FAMILIES[family])
    return features


def _per_unit(indicator: torch.Tensor, seq_ids: torch.Tensor, seq_counts: torch.Tensor, sequence_level: bool):
    """``Σ_t x_t`` (token level) or ``Σ_t x_t / n_{i(t)} = Σ_i f_i`` (sequence level) of a chunk's `(n,)` values."""
    values = indicator.detach().double()
    if sequence_level:
        values = values / seq_counts.double().clamp(min=1)[seq_ids]
    return values.sum()


def chunk_metrics(
    cfg,
    indicators: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    seq_ids: torch.Tensor,
    seq_counts: torch.Tensor,
    num_sequences: int,
    loss_before_bonus: torch.Tensor,
    policy_loss_scale: float,
    trl_kl: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The `trl/*` sums of one chunk of valid tokens (all `(n,)`, detached inside).

    Args:
        cfg: the loss configuration.
        indicators (`dict`): the policy loss's per-token indicators (`clip_low`, `clip_high`, VESPO's `phi`).
        advantages, seq_ids (`torch.Tensor`): of the chunk's tokens.
        seq_counts (`torch.Tensor`): `(num_sequences,)` valid tokens of each whole sequence (all SP shards).
        num_sequences (`int`): sequences of the micro-batch.
        loss_before_bonus (`torch.Tensor`): the chunk's policy loss plus KL loss (before the entropy bonus).
        policy_loss_scale (`float`): what turns the micro-batch's share of the step's loss into TRL's `policy_loss`.
        trl_kl (`torch.Tensor`, *optional*): TRL's per-token KL (k3, × its IS ratio under bias correction).
    """
    spec = cfg.policy_loss_cfg.spec
    seq_level = spec.trl_sequence_level
    out: dict[str, Any] = {TRL + "policy_loss": loss_before_bonus.detach().double() * policy_loss_scale}
    if trl_kl is not None:
        out[TRL + "kl_sum"] = trl_kl.detach().double().sum()
    positive, negative = advantages > 0, advantages < 0
    if spec.trl_metrics == "clip":
        low = indicators["clip_low"] & negative
        high = indicators["clip_high"] & positive
        out[TRL + "clip_low_sum"] = _per_unit(low, seq_ids, seq_counts, seq_level)
        out[TRL + "clip_high_sum"] = _per_unit(high, seq_ids, seq_counts, seq_level)
        out[TRL + "clip_region_sum"] = _per_unit(low | high, seq_ids, seq_counts, seq_level)
        zeros = torch.zeros(num_sequences, dtype=torch.float64, device=advantages.device)
        out[_SEQ_LOW] = zeros.index_add(0, seq_ids, low.double())
        out[_SEQ_HIGH] = zeros.index_add(0, seq_ids, high.double())
    elif spec.trl_metrics == "cispo":
        capped = indicators["clip_high"] & positive
        out[TRL + "cispo_clip_sum"] = _per_unit(capped, seq_ids, seq_counts, seq_level)
    elif spec.trl_metrics == "vespo":
        out[TRL + "phi_seq_sum"] = _per_unit(indicators["phi"], seq_ids, seq_counts, True)
    return out


def finish(
    metrics: dict[str, Any], cfg, num_tokens: int, num_sequences: int, seq_counts: torch.Tensor, sp_mesh=None
) -> dict[str, Any]:
    """The micro-batch's `trl/*` metrics from its chunks' (in place): `trl/units` and the per-sequence extrema.

    `num_tokens` are this rank's valid tokens. Under SP the per-sequence counts are summed over the SP group (one
    small all-reduce) and the sequences counted on its first rank.
    """
    seq_level = cfg.policy_loss_cfg.spec.trl_sequence_level
    device = seq_counts.device
    rows = float(num_sequences) if sp_rank(sp_mesh) == 0 else 0.0
    metrics[TRL_UNITS] = torch.tensor(rows if seq_level else float(num_tokens), dtype=torch.float64, device=device)
    empty_rows = (seq_counts == 0).sum().double() if sp_rank(sp_mesh) == 0 else 0.0  # a tensor: no host read
    if cfg.policy_loss_cfg.spec.trl_metrics == "vespo":
        # TRL's row without a valid token (e.g. masked by `mask_truncated_completions`) has w = 1, so φ = 1
        metrics[TRL + "phi_seq_sum"] = metrics[TRL + "phi_seq_sum"] + empty_rows
    if cfg.policy_loss_cfg.spec.trl_metrics != "clip":
        return metrics
    # A shard without valid tokens has no chunk: zeros, so that every SP rank joins the all-reduce
    zeros = torch.zeros(num_sequences, dtype=torch.float64, device=device)
    counts = torch.stack([metrics.pop(_SEQ_LOW, zeros), metrics.pop(_SEQ_HIGH, zeros)])  # (2, S)
    if sp_world_size(sp_mesh) > 1:
        all_reduce(counts, group=sp_group(sp_mesh))
    # TRL's token level skips sequences without a valid token (NaN, then nanmin); its sequence level keeps every row
    # (ratio 1 there: not clipped, a share of 0)
    present = seq_counts > 0 if not seq_level else torch.ones_like(seq_counts, dtype=torch.bool)
    shares = counts / seq_counts.double().clamp(min=1)  # (2, S)
    # the extrema over the present sequences, ±inf (the reductions' neutral values, not logged) when there is none:
    # masked in place, not indexed, so that no shape depends on the data
    metrics[TRL + "clip_low_seq_min"] = torch.where(present, shares[0], math.inf).min()
    metrics[TRL + "clip_high_seq_max"] = torch.where(present, shares[1], -math.inf).max()
    return metrics
