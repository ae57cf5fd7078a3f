"""The batches of sequence parallelism: pooling over the SP group, the shared shuffle, and packed micro-batches.

Under `sp_size > 1` each rank generates and scores its `1/sp_size` share of its SP group's generation batch; the
group then pools the scored batch (`pool_over_group`, so every rank holds the group's batch in the same order),
shuffles it alike on every rank (`shared_permutation`) and splits it into micro-batches. Each micro-batch is packed
into one row (`pack_rows`, `PackedRows`) and every rank runs the backbone on a contiguous shard of it.
`SPMicroBatch` carries that rank's input shard and the micro-batch's loss data in the same packed layout: the
labels the loss context keeps (`sp_split` of the packed loss data inside `build`) and the input shard
(`sp_shard_inputs` of the packed ids) are cut from one `PackedRows` by the same split, so they line up.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..loss.fields import pad_value
from ..parallel.sequence import sp_gather, sp_group, sp_shard_inputs, sp_split, sp_world_size

__all__ = [
    "PackedRows",
    "SPMicroBatch",
    "pack_rows",
    "pad_rows_to_length",
    "pool_fill_value",
    "pool_over_group",
    "shared_permutation",
]


class PackedRows(NamedTuple):
    """Rows of a padded prompt/completion batch packed into one row, for sequence parallelism.

    `input_ids`/`position_ids` are `(1, L)`: each sequence's prompt without its left padding followed by its completion
    without its right padding, positions restarting at 0 per sequence; `num_tokens` `(B,)` their lengths. Completion
    token `(rows[k], cols[k])` of the padded batch is predicted at packed position `label_index[k]` (the position
    before it), i.e. a `(B, C)` completion-aligned tensor `x` becomes `packed[0, label_index] = x[rows, cols]`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    num_tokens: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    label_index: torch.Tensor

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def pack(self, values: torch.Tensor, padding_value: float) -> torch.Tensor:
        """A `(B, C)` completion-aligned tensor in the packed `(1, L)` layout, `padding_value` elsewhere."""
        out = values.new_full((1, self.length), padding_value)
        out[0, self.label_index] = values[self.rows, self.cols]
        return out

    def unpack(self, packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The inverse of `pack` for a `(1, L)` tensor: `(B, C)`, 0 where no completion token is."""
        out = packed.new_zeros(shape)
        out[self.rows, self.cols] = packed[0, self.label_index]
        return out


def pack_rows(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor
) -> PackedRows:
    """Pack a left-padded prompt batch and a right-padded completion batch (masks: 1 = real token) into one row."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    keep = torch.cat([prompt_mask, completion_mask], dim=1).bool()
    num_tokens = keep.sum(dim=1)
    starts = num_tokens.cumsum(0) - num_tokens
    position_ids = (keep.long().cumsum(dim=1) - 1)[keep].unsqueeze(0)
    packed_index = (keep.reshape(-1).long().cumsum(0) - 1).reshape(keep.shape)[:, prompt_ids.shape[1] :]
    rows, cols = completion_mask.bool().nonzero(as_tuple=True)
    label_index = packed_index[rows, cols] - 1
    has_context = label_index >= starts[rows]  # a sequence's first token is not predicted from anything
    rows, cols, label_index = rows[has_context], cols[has_context], label_index[has_context]
    return PackedRows(ids[keep].unsqueeze(0), position_ids, num_tokens, rows, cols, label_index)


@dataclasses.dataclass(frozen=True)
class SPMicroBatch:
    """One micro-batch of an SP group, as this rank sees it: the packed row, this rank's shard of its inputs, and the
    loss data in the packed layout.

    Args:
        packed (`PackedRows`): the micro-batch packed into one row of length `L` (the same on every rank).
        input_ids (`torch.Tensor`): `(1, L_local)` this rank's shard of `packed.input_ids`, `L` padded to a multiple
            of the SP size (`sp_shard_inputs`).
        position_ids (`torch.Tensor`): `(1, L_local)` the shard's global positions (restarting per sequence).
        sp_mesh (`DeviceMesh`): the SP group.
        loss_data (`dict`, *optional*): the data for `rl_loss_config.build` in the packed layout (`with_loss_data`):
            full length; `build(data, sp_mesh=...)` keeps this rank's shard with the `sp_split` that cut `input_ids`.
    """

    packed: PackedRows
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    sp_mesh: DeviceMesh
    loss_data: dict[str, Any] | None = None

    @property
    def length(self) -> int:
        """`L`, the packed row's length before SP padding."""
        return self.packed.length

    @classmethod
    def from_batch(cls, batch: dict[str, Any], sp_mesh: DeviceMesh, pad_token_id: int) -> SPMicroBatch:
        """The micro-batch of a TRL batch (`prompt_ids`/`prompt_mask` left-padded, `completion_*` right-padded)."""
        return cls.from_tensors(
            batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"], sp_mesh,
            pad_token_id,
        )  # fmt: skip

    @classmethod
    def from_tensors(cls, prompt_ids, prompt_mask, completion_ids, completion_mask, sp_mesh, pad_token_id):
        """The micro-batch of `(B, P)` prompts and `(B, C)` completions (see `pack_rows`)."""
        packed = pack_rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
        input_ids, position_ids = sp_shard_inputs(packed.input_ids, packed.position_ids, sp_mesh, pad_token_id)
        return cls(packed, input_ids, position_ids, sp_mesh)

    def shard(self, values: torch.Tensor, padding_value: float) -> torch.Tensor:
        """`(1, L_local)`: this rank's shard of a `(B, C)` completion-aligned tensor, aligned with `input_ids`
        (position `i` holds the value of the token predicted from the hidden state at `i`)."""
        return sp_split(self.packed.pack(values, padding_value), self.sp_mesh, 1, padding_value)

    def gather(self, local: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """`(B, C, k)` from every rank's `(1, L_local, k)` shard of per-position values (collective over the group);
        0 where no completion token is."""
        full = sp_gather(local, self.sp_mesh, dim=1)[:, : self.packed.length]
        return torch.stack([self.packed.unpack(full[..., i], shape) for i in range(full.shape[-1])], dim=-1)

    def with_loss_data(self, data: dict[str, Any], shape: tuple[int, int], ignore_idx: int) -> SPMicroBatch:
        """This micro-batch with `data` in the packed layout: `(B, C)` tensors packed (padded with their field's
        `pad_value`), `num_tokens` added, per-sequence values kept."""
        out = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == shape:
                value = self.packed.pack(value, pad_value(key, ignore_idx))
            elif isinstance(value, torch.Tensor) and value.dim() > 1:
                raise ValueError(
                    f"sequence parallelism: loss data {key!r} has shape {tuple(value.shape)}; expected the "
                    f"completions' shape {shape} or one value per sequence"
                )
            out[key] = value
        out["num_tokens"] = self.packed.num_tokens
        return dataclasses.replace(self, loss_data=out)


def pool_fill_value(key: str, pad_token_id: int) -> float:
    """The value a TRL batch key is padded with when the group's batches are brought to one length: the pad token
    for ids, 1 for the multipliers (`tool_mask`, TRL's `importance_sampling_ratio`), 0 for masks and log-probs."""
    if key.endswith("_ids"):
        return pad_token_id
    return 1 if key in ("tool_mask", "importance_sampling_ratio") else 0


def pad_rows_to_length(key: str, value: torch.Tensor, length: int, pad_token_id: int) -> torch.Tensor:
    """`(B, length, ...)`: the `(B, C, ...)` value of TRL batch key `key` padded with `pool_fill_value`, on the left
    for prompts (TRL left-pads them), on the right otherwise; unchanged when already `length` long."""
    if value.shape[1] >= length:
        return value
    filler = value.new_full(
        (value.shape[0], length - value.shape[1], *value.shape[2:]), pool_fill_value(key, pad_token_id)
    )
    return torch.cat([filler, value] if key.startswith("prompt_") else [value, filler], dim=1)


def pool_over_group(batch: dict[str, Any], sp_mesh: DeviceMesh, pad_token_id: int) -> dict[str, Any]:
    """The batches of this rank's SP group, concatenated in rank order (the same on every rank; collective).

    Per-row tensors are padded to the group's longest (prompts on the left, everything else on the right, with
    `pool_fill_value`; gloo needs equal shapes) and all-gathered; 0-dim tensors and `None` are kept.
    """
    group = sp_group(sp_mesh)
    rows = batch["prompt_ids"].shape[0]
    keys = sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
    for key, value in batch.items():
        if key in keys:
            if value.shape[0] != rows:
                raise ValueError(f"sequence parallelism: batch[{key!r}] has {value.shape[0]} rows, not {rows}")
        elif value is not None and not (isinstance(value, torch.Tensor) and value.dim() == 0):
            raise ValueError(
                f"sequence parallelism cannot pool batch[{key!r}] ({type(value).__name__}) over the SP group"
            )
    device = batch["prompt_ids"].device
    lengths = torch.tensor([batch[k].shape[1] if batch[k].dim() > 1 else 0 for k in keys], device=device)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
    out = dict(batch)
    for key, length in zip(keys, lengths.tolist()):
        value = batch[key]
        if value.dim() > 1:
            value = pad_rows_to_length(key, value, length, pad_token_id)
        value = value.contiguous()
        shards = [torch.empty_like(value) for _ in range(sp_world_size(sp_mesh))]
        dist.all_gather(shards, value, group=group)
        out[key] = torch.cat(shards, dim=0)
    return out


def shared_permutation(rows: int, sp_mesh: DeviceMesh, device: torch.device) -> torch.Tensor:
    """`(rows,)` a random permutation drawn on the SP group's first rank and broadcast (collective): every rank of
    the group shuffles its pooled batch alike."""
    permutation = torch.randperm(rows).to(device)
    group = sp_group(sp_mesh)
    dist.broadcast(permutation, src=dist.get_global_rank(group, 0), group=group)
    return permutation
