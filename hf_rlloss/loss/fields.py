"""The per-token fields of a micro-batch: one table that every site reads.

`config.build` (which data keys it accepts), the loss kwargs (shape checks, the non-finite check), SP packing and
splitting (the padding value), the loss (which fields it gathers at the valid tokens) and the trainer's map from
TRL's batch keys all derive their lists from `TOKEN_FIELDS`. Adding a field is one row here plus the code that
uses it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenField:
    """One `(B, T)` per-token tensor of the loss kwargs.

    Args:
        name (`str`): the field of `BaseRLLossKwargs`, and the key of `build(data)` when `from_data`.
        pad (`float`): its value at padded positions (SP packing and splitting). Neutral for what reads it: 1.0 for
            IS weights (a multiplier), 0.0 elsewhere (the positions are masked out anyway).
        from_data (`bool`): the caller gives it in `build(data)`; otherwise `build` derives it.
        check_finite (`bool`): a non-finite value at a valid token is bad input and raises (rollout log-probs and
            kept masses are judged by rollout IS instead).
        in_loss (`bool`): the loss gathers it at the valid tokens.
        trl_key (`str`, *optional*): the key of TRL's `GRPOTrainer` batch it is copied from, as it is.
    """

    name: str
    pad: float = 0.0
    from_data: bool = True
    check_finite: bool = False
    in_loss: bool = True
    trl_key: str | None = None


TOKEN_FIELDS: dict[str, TokenField] = {
    f.name: f
    for f in (
        TokenField("advantages", check_finite=True),  # TRL's are per sequence: the trainer broadcasts them
        TokenField("old_logprobs", check_finite=True, trl_key="old_per_token_logps"),
        TokenField("ref_logprobs", check_finite=True, trl_key="ref_per_token_logps"),
        TokenField("rollout_logprobs", trl_key="sampling_per_token_logps"),
        # TRL's `importance_sampling_ratio` is (B, T) or (B, 1): the trainer lays it out (see `build_loss_data`)
        TokenField("rollout_is_weights", pad=1.0, check_finite=True),
        TokenField("old_kept_logmass", in_loss=False, trl_key="old_kept_logmass"),
        TokenField("rollout_kept_logmass", in_loss=False, trl_key="rollout_kept_logmass"),
        # derived by `build`: the sequence index of each token and the aggregation weights
        TokenField("seq_ids", from_data=False),
        TokenField("policy_loss_weight", from_data=False),
        TokenField("kl_loss_weight", from_data=False),
    )
}

PER_TOKEN = tuple(TOKEN_FIELDS)
DATA_FIELDS = tuple(f.name for f in TOKEN_FIELDS.values() if f.from_data)
CHECKED_FOR_NONFINITE = tuple(f.name for f in TOKEN_FIELDS.values() if f.check_finite)
LOSS_FIELDS = ("shifted_labels", *(f.name for f in TOKEN_FIELDS.values() if f.in_loss))
# TRL batch key -> field, for the fields TRL computes under the same meaning
FROM_TRL = {f.trl_key: f.name for f in TOKEN_FIELDS.values() if f.trl_key}


def pad_value(name: str, ignore_idx: int) -> float:
    """The padding of a `(B, T)` data key: `ignore_idx` for the labels, else the field's `pad`."""
    return ignore_idx if name == "shifted_labels" else TOKEN_FIELDS[name].pad
