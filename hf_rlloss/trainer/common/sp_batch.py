"""The batches of sequence parallelism: pooling over the SP group, the shared shuffle, and packed micro-batches.

Under `sp_size > 1` each rank generates and scores its `1/sp_size` share of its SP group's generation batch; the
group then pools the scored batch (`pool_over_group`, so every rank holds the group's batch in the same order),
shuffles it alike on every rank (`shared_permutation`) and splits it into micro-batches. Each micro-batch is packed
into one row (a `PackedLayout` of `hf_rlloss.trainer.common.packing`: prompts shared or repeated, as
`RLLossGRPOConfig.packing` says) and every rank runs the backbone on a contiguous shard of it. `SPMicroBatch` carries
that rank's input shard and the micro-batch's loss data laid out by loss term (completion token): the terms the loss
context keeps (`sp_split` of the term data inside `build`) and the hidden states `term_hidden` picks for them are cut
by the same split, so they line up."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ...parallel.sequence import sp_all_gather, sp_gather, sp_group, sp_shard_inputs, sp_split, sp_world_size
from .packing import PackedLayout

__all__ = [
    "SPMicroBatch",
    "pad_rows_to_length",
    "pool_fill_value",
    "pool_over_group",
    "shared_permutation",
]


@dataclasses.dataclass(frozen=True)
class SPMicroBatch:
    """One micro-batch of an SP group, as this rank sees it: the packed row, this rank's shard of its inputs, and the
    loss data in the layout of the loss terms.

    The row is a `PackedLayout` (`packing.py`, `RLLossGRPOConfig.packing`): `"shared_prefix"` (TRL's
    `TreeRow`, each prompt forwarded once) or `"padding_free"`, `N` positions, the same on every rank of the group,
    which runs the backbone on its contiguous shard (`input_ids`, padded at the end to a multiple of the SP size) with
    the whole row's tree layout (`attention_kwargs`, read by the Ulysses attention).

    The loss is taken over its terms: the completion tokens `(rows[k], cols[k])` of the `(B, C)` batch in row-major
    order (`completion_mask.nonzero()`), term `k` predicted from packed position `term_positions[k]`. In a shared
    prefix a position can predict several terms (a prompt's last token predicts each of its completions' first
    tokens), so the loss data are laid out by term, `(1, M)`, sequence by sequence (`num_tokens` terms each), and
    split over the group like any packed row (`sp_split`: rank `r` takes terms `[r·M/W, (r+1)·M/W)`). A term's hidden
    state may sit on another rank's shard: `term_hidden` all-gathers the row's last hidden states (differentiable,
    one `(N, H)` gather per forward, against the `(N, H)` all-to-alls of every layer) and picks this rank's terms.

    Args:
        layout (`PackedLayout`): the micro-batch packed into one row of length `N` (the same on every rank).
        input_ids (`torch.Tensor`): `(1, N_local)` this rank's shard of `layout.input_ids`, `N` padded to a multiple
            of the SP size (`sp_shard_inputs`).
        position_ids (`torch.Tensor`): `(1, N_local)` the shard's global positions.
        sp_mesh (`DeviceMesh`): the SP group.
        loss_data (`dict`, *optional*): the data for `rl_loss_config.build` in the term layout (`with_loss_data`):
            full length; `build(data, sp_mesh=...)` keeps this rank's terms with the `sp_split` `shard` uses.
    """

    layout: PackedLayout
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    sp_mesh: DeviceMesh
    loss_data: dict[str, Any] | None = None

    @property
    def length(self) -> int:
        """`N`, the packed row's length before SP padding."""
        return self.layout.forwarded_tokens

    @property
    def attention_kwargs(self) -> dict[str, Any]:
        """The whole row's tree layout, for the Ulysses attention (`tree_*` keyword arguments of the forward)."""
        return self.layout.attention_kwargs

    @property
    def terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(rows, cols)` `(M,)` each: the completion tokens of the `(B, C)` batch, in row-major order."""
        return self.layout.completion_mask.nonzero(as_tuple=True)

    @property
    def term_positions(self) -> torch.Tensor:
        """`(M,)` the packed position whose hidden state predicts each term."""
        return self.layout.completion_index[self.terms]

    @classmethod
    def from_layout(cls, layout: PackedLayout, sp_mesh: DeviceMesh, pad_token_id: int) -> SPMicroBatch:
        """This rank's view of a micro-batch packed into `layout`."""
        input_ids, position_ids = sp_shard_inputs(layout.input_ids, layout.position_ids, sp_mesh, pad_token_id)
        return cls(layout, input_ids, position_ids, sp_mesh)

    def shard(self, values: torch.Tensor, padding_value: float) -> torch.Tensor:
        """`(1, M_local)`: this rank's terms of a `(B, C)` completion-aligned tensor, aligned with `term_hidden`."""
        return sp_split(values[self.terms].unsqueeze(0), self.sp_mesh, 1, padding_value)

    def term_hidden(self, hidden: torch.Tensor) -> torch.Tensor:  # (1, N_local, H) -> (1, M_local, H)
        """The hidden states predicting this rank's terms, from every rank's shard of the row's last hidden states
        (collective over the group, differentiable: the backward sends each gradient to the rank of its position)."""
        full = sp_all_gather(hidden[0], self.sp_mesh, dim=0)  # (N_padded, H)
        picked = full.index_select(0, self.term_positions).unsqueeze(0)  # (1, M, H)
        return sp_split(picked, self.sp_mesh, 1, 0.0)

    def gather(self, local: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """`(B, C, k)` from every rank's `(1, M_local, k)` per-term values (collective over the group); 0 where no
        completion token is."""
        rows, cols = self.terms
        full = sp_gather(local, self.sp_mesh, dim=1)[0, : rows.numel()]
        out = full.new_zeros(*shape, full.shape[-1])
        out[rows, cols] = full
        return out

    def with_loss_data(self, data: dict[str, Any], shape: tuple[int, int], ignore_idx: int) -> SPMicroBatch:
        """This micro-batch with `data` in the term layout: `(B, C)` tensors as `(1, M)` (the `sp_split` padding is
        their field's `pad_value`), `num_tokens` (terms per sequence) added, per-sequence values kept."""
        out = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == shape:
                value = value[self.terms].unsqueeze(0)
            elif isinstance(value, torch.Tensor) and value.dim() > 1:
                raise ValueError(
                    f"sequence parallelism: loss data {key!r} has shape {tuple(value.shape)}; expected the "
                    f"completions' shape {shape} or one value per sequence"
                )
            out[key] = value
        out["num_tokens"] = self.layout.completion_mask.sum(dim=1)
        return dataclasses.replace(self, loss_data=out)


def pool_fill_value(key: str, pad_token_id: int) -> float:
    """The value a TRL batch key is padded with when the group's batches are brought to one length: the pad token
    for ids, 1 for the multipliers (`tool_mask`, TRL's `importance_sampling_ratio`), -1 (no route) for MoE routes
    (`routing_replay.ROUTE_KEYS`), 0 for masks and log-probs."""
    if key.endswith("_ids"):
        return pad_token_id
    if key.endswith("routed_experts"):
        return -1
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
