"""Loss kwargs: the per-token tensors of one micro-batch (`BaseRLLossKwargs`), validated, and how a micro-batch's
data becomes them (`prepare_kwargs`): the second stage of the loss layer, config → kwargs → context.

`prepare_kwargs` checks the full-length data of a micro-batch, gives each position its sequence (`sequence_ids`: the
rows of a padded batch, or the segments of a packed row from `num_tokens`), expands per-sequence advantages to
tokens, and splits every field over the sequence-parallel group (each padded with its field's value,
`hf_rlloss.loss.fields`). Every later assignment is checked against the labels' shape.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from torch.distributed.device_mesh import DeviceMesh

from ..parallel.sequence import sp_split, sp_world_size
from .fields import DATA_FIELDS, PER_TOKEN, TOKEN_FIELDS


class BaseRLLossKwargs(BaseModel):
    """The tensors of one micro-batch, all `(B, T)` local (after any SP split), checked on every assignment.

    Args:
        shifted_labels (`torch.Tensor`): int64 labels; position `t` holds the token predicted from position `t`.
        advantages (`torch.Tensor`): float32 per-token advantages.
        seq_ids (`torch.Tensor`): int64 index of each position's sequence in `[0, num_sequences)`, -1 for SP padding.
        num_sequences (`int`): sequences in the micro-batch (rows of a padded batch, or segments of a packed row).
        old_logprobs, ref_logprobs, rollout_logprobs (`torch.Tensor`, *optional*): per-token log-probs under the
            policy before the update, the reference, and the rollout engine.
        rollout_is_weights (`torch.Tensor`, *optional*): per-token rollout IS weights (constants).
        old_kept_logmass, rollout_kept_logmass (`torch.Tensor`, *optional*): per-token log of the probability mass
            that the sampling truncation (top-k/top-p/min-p) keeps under π_old (replayed by the trainer) and under the
            rollout engine; see `compute_rollout_is`.
        policy_loss_weight, kl_loss_weight (`torch.Tensor`, *optional*): set by `build_batches`.
        global_grad_tokens (`torch.Tensor`, *optional*): valid tokens of the whole step; set by `build_batches`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", validate_assignment=True)

    shifted_labels: torch.Tensor
    advantages: torch.Tensor
    seq_ids: torch.Tensor
    num_sequences: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None
    old_kept_logmass: torch.Tensor | None = None
    rollout_kept_logmass: torch.Tensor | None = None
    policy_loss_weight: torch.Tensor | None = None
    kl_loss_weight: torch.Tensor | None = None
    global_grad_tokens: torch.Tensor | None = None

    # Field validators run before a value is stored, so a rejected assignment leaves the kwargs as they were.
    @field_validator("shifted_labels")
    @classmethod
    def _check_labels(cls, value: torch.Tensor) -> torch.Tensor:
        if value.dim() != 2:
            raise ValueError(f"shifted_labels must be 2-D (B, T); got shape {tuple(value.shape)}")
        return value

    @field_validator(*PER_TOKEN)
    @classmethod
    def _check_shape(cls, value: torch.Tensor | None, info: ValidationInfo) -> torch.Tensor | None:
        labels = info.data.get("shifted_labels")
        if value is not None and labels is not None and tuple(value.shape) != tuple(labels.shape):
            raise ValueError(
                f"{info.field_name} has shape {tuple(value.shape)} but shifted_labels has shape "
                f"{tuple(labels.shape)}; every per-token tensor must have exactly the labels' shape"
            )
        return value

    def to(self, device: torch.device | str) -> BaseRLLossKwargs:
        for name, value in self:
            if isinstance(value, torch.Tensor):
                self.__dict__[name] = value.to(device)
        return self


def sequence_ids(labels: torch.Tensor, num_tokens: Any) -> tuple[torch.Tensor, int]:
    batch, length = labels.shape
    if num_tokens is None:
        return torch.arange(batch, device=labels.device).unsqueeze(1).expand(batch, length), batch
    num_tokens = torch.as_tensor(num_tokens, dtype=torch.long, device=labels.device).reshape(-1)
    if batch != 1:
        raise ValueError(f"num_tokens is for a packed row: shifted_labels must be (1, L); got {tuple(labels.shape)}")
    if int(num_tokens.sum()) != length or bool((num_tokens < 0).any()):
        raise ValueError(
            f"num_tokens {num_tokens.tolist()} must be non-negative and sum to the packed length {length}"
        )
    seq_ids = torch.repeat_interleave(torch.arange(len(num_tokens), device=labels.device), num_tokens)
    return seq_ids.unsqueeze(0), len(num_tokens)


def prepare_kwargs(data: dict[str, Any], ignore_idx: int, sp_mesh: DeviceMesh | None) -> BaseRLLossKwargs:
    """Validate the full-length data of one micro-batch, expand per-sequence advantages and split it for SP."""
    labels = data["shifted_labels"]
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"shifted_labels must be a 2-D (B, T) tensor; got {shape}")
    labels = labels.long()
    seq_ids, num_sequences = sequence_ids(labels, data.get("num_tokens"))
    fields: dict[str, torch.Tensor] = {}
    for name in DATA_FIELDS:
        value = data.get(name)
        if value is None:
            continue
        value = torch.as_tensor(value, device=labels.device).float()
        if name == "advantages" and value.dim() == 1:
            if value.shape[0] != num_sequences:
                raise ValueError(
                    f"advantages has shape {tuple(value.shape)}: per-sequence advantages need one value per "
                    f"sequence ({num_sequences}); per-token ones the labels' shape {tuple(labels.shape)}"
                )
            value = value[seq_ids]
        if tuple(value.shape) != tuple(labels.shape):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} but shifted_labels has shape {tuple(labels.shape)}; "
                "every per-token tensor must have exactly the labels' shape"
            )
        fields[name] = value
    if sp_world_size(sp_mesh) > 1:
        labels = sp_split(labels, sp_mesh, 1, ignore_idx)
        seq_ids = sp_split(seq_ids, sp_mesh, 1, -1)
        fields = {name: sp_split(value, sp_mesh, 1, TOKEN_FIELDS[name].pad) for name, value in fields.items()}
    return BaseRLLossKwargs(shifted_labels=labels, seq_ids=seq_ids, num_sequences=num_sequences, **fields)
