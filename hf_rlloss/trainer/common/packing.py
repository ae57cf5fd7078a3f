"""Packed training forwards: a TRL micro-batch as one row without padding, and each prompt forwarded once.

TRL's batches are padded: `prompt_ids`/`prompt_mask` `(B, P)` left-padded, `completion_ids`/`completion_mask`
`(B, C)` right-padded, and GRPO repeats each prompt for its G completions. A padded forward processes `B × (P + C)`
positions; the tokens that matter are far fewer. `RLLossGRPOConfig.packing` chooses the layout of every training
forward (the loss forward, the no-gradient old and reference passes, evaluation):

* `"shared_prefix"`: the micro-batch folded into a prefix trie by TRL's `TreeRow` (any common prefix, e.g. a
  prompt and its G completions, is forwarded once), laid out as one row; attention per segment of the trie
  (`hf_rlloss.parallel.tree_attention`), so each token sees exactly what it would see in its own row;
* `"padding_free"`: each sequence's prompt and completion without padding, one after the other (each its own
  segment, positions from 0);
* `"off"`: the padded batch, as TRL forwards it.

A `PackedLayout` holds the row (`input_ids`, `position_ids`, the tree attention's keyword arguments) and the map back:
`completion_index[b, c]` is the packed position whose hidden state predicts completion token `(b, c)` (the position
of its predecessor). `completion_hidden` turns the row's `(1, N, H)` hidden states into the `(B, C, H)`
completion-aligned ones the loss layer and the chunked LM head take, by a gather: a shared position (a prompt's last
token) feeds several completions, and the gather's backward sums their gradients into it.

Exactness: the tokens are those the padded forward attends to (real prompt tokens, then the completion tokens whose
mask is 1), at the positions it gives them (counted from each row's first real token), each attending to its own
row's earlier tokens only; hence the same hidden states for every completion token, up to float round-off.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from transformers.utils import logging

from ...loss.metrics import Reduction, register_finalizer, register_metric
from ...parallel.layouts import attention_dropout, model_layouts, resolve_packing, zero_attention_dropout
from ...parallel.packed_attention import use_packed_attention
from ...parallel.tree_attention import flash_varlen_kernel

__all__ = [
    "PACKING_CHOICES",
    "PACKING_MODES",
    "PackedLayout",
    "PackedRows",
    "build_layout",
    "layout_fallback_reason",
    "pack_padding_free",
    "pack_rows",
    "pack_shared_prefix",
    "packing_for_device",
    "packing_metrics",
    "prepare_packing",
    "tree_positions",
]

logger = logging.get_logger(__name__)

PACKING_MODES = ("shared_prefix", "padding_free", "off")
#: What `RLLossGRPOConfig.packing` accepts: a layout, or `"auto"` (the default; `packing_for_device` chooses).
PACKING_CHOICES = ("auto", *PACKING_MODES)


def packing_for_device(device: torch.device | str, half_precision: bool, flash_varlen: bool | None = None):
    """The layout `packing="auto"` trains with on `device`, and why: `(mode, reason)`.

    * not CUDA: `"shared_prefix"`, each prompt forwarded once (docs/packing.md measures it on CPUs);
    * CUDA with flash-attn's varlen kernel and bf16/fp16 weights or autocast: `"shared_prefix"`, the packed row in
      one kernel call per layer;
    * CUDA otherwise: `"off"`, TRL's padded forward, one batched attention call per layer. Without the varlen kernel
      a packed row is attended segment by segment (`tree_attention`): one SDPA call per segment and layer, which on a
      GPU means many small kernel launches (benchmarks/performance/cuda_proxies.py counts them).

    `flash_varlen` defaults to whether `flash_attn` imports.
    """
    if torch.device(device).type != "cuda":
        return "shared_prefix", "not on CUDA: every common prefix forwarded once, attended segment by segment"
    if flash_varlen is None:
        flash_varlen = flash_varlen_kernel() is not None
    if flash_varlen and half_precision:
        return "shared_prefix", "on CUDA with flash-attn's varlen kernel: the packed row in one call per layer"
    why = "flash-attn's varlen kernel is not installed" if not flash_varlen else "it runs in bf16/fp16 only"
    return "off", f"on CUDA {why}: the padded forward (TRL's), one batched attention call per layer"


# The packing metrics: accumulated as sums over the step's micro-batches and ranks (declared without a logged name,
# so they stay out of the loss layer's metrics table), and logged by `_log_packing_metrics` below.
_PADDED = "packing_acc/padded_tokens"
_FORWARDED = "packing_acc/forwarded_tokens"
register_metric(_PADDED, Reduction.SUM, "positions the padded layout forwards: B × (P + C) per micro-batch")
register_metric(_FORWARDED, Reduction.SUM, "positions the packed layout forwards")


@register_finalizer
def _log_packing_metrics(reduced: dict[str, float]) -> dict[str, float]:
    """`packing/padded_tokens`, `packing/forwarded_tokens` (sums over the step's micro-batches and ranks) and
    `packing/ratio` (padded / forwarded: how many times fewer positions the forwards process)."""
    if _PADDED not in reduced or _FORWARDED not in reduced:
        return {}
    padded, forwarded = reduced[_PADDED], reduced[_FORWARDED]
    return {
        "packing/padded_tokens": padded,
        "packing/forwarded_tokens": forwarded,
        "packing/ratio": padded / forwarded if forwarded > 0 else 1.0,
    }


def packing_metrics(padded: int, forwarded: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The 0-dim accumulators of one micro-batch's forward, to merge into the loss metrics."""
    return {
        _PADDED: torch.tensor(float(padded), device=device),
        _FORWARDED: torch.tensor(float(forwarded), device=device),
    }


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """A micro-batch packed into one row, and the map from the row back to the completion-aligned layout.

    Args:
        mode (`str`): `"shared_prefix"` or `"padding_free"`.
        input_ids (`torch.Tensor`): `(1, N)` the forwarded tokens.
        position_ids (`torch.Tensor`): `(1, N)` each token's position in its own sequence (from 0).
        attention_kwargs (`dict`): the tree attention's keyword arguments (`tree_kv_index`, `tree_cu_seqlens_q`,
            `tree_cu_seqlens_k`, `tree_max_seqlen_q`, `tree_max_seqlen_k`; see `hf_rlloss.parallel.tree_attention`).
        completion_index (`torch.Tensor`): `(B, C)` int64: the packed position whose hidden state predicts completion
            token `(b, c)`; 0 where `completion_mask` is 0.
        completion_mask (`torch.Tensor`): `(B, C)` bool: the completion tokens that are forwarded and predicted.
        padded_tokens (`int`): `B × (P + C)`, what the padded layout forwards.
        grid_position (`torch.Tensor`, *optional*): `(B, P + C)` int64: the packed position forwarding each token of
            the padded batch (prompt then completion), `-1` where none does (padding, a row left out); a shared
            position is the position of every token it stands for. Per-token data (MoE routes) follows it.
    """

    mode: str
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_kwargs: dict[str, Any]
    completion_index: torch.Tensor
    completion_mask: torch.Tensor
    padded_tokens: int
    grid_position: torch.Tensor | None = None

    @property
    def forwarded_tokens(self) -> int:
        """`N`, the positions the packed forward processes."""
        return self.input_ids.shape[1]

    def completion_hidden(self, hidden: torch.Tensor) -> torch.Tensor:  # (1, N, H) -> (B, C, H)
        """The completion-aligned hidden states: `out[b, c]` predicts completion token `(b, c)`; rows where the
        completion mask is 0 hold the hidden state of position 0 (finite, and masked by the loss). Differentiable:
        the backward of the gather sums the gradients of the completions that share a position."""
        if hidden.shape[:2] != (1, self.forwarded_tokens):
            raise ValueError(
                f"packed hidden states have shape {tuple(hidden.shape)}; expected (1, {self.forwarded_tokens}, H)"
            )
        rows, cols = self.completion_index.shape
        return hidden[0].index_select(0, self.completion_index.reshape(-1)).view(rows, cols, hidden.shape[-1])

    def metrics(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        return packing_metrics(self.padded_tokens, self.forwarded_tokens, device)


class PackedRows(NamedTuple):
    """Rows of a padded prompt/completion batch packed into one row without padding (`"padding_free"`, and SP's).

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


def _segments(cu_seqlens: torch.Tensor, kv_index: torch.Tensor, cu_seqlens_k: torch.Tensor) -> dict[str, Any]:
    """The tree attention's keyword arguments from segment bounds `(S + 1,)`, K/V positions `(K,)`, path bounds."""
    return {
        "tree_kv_index": kv_index,
        "tree_cu_seqlens_q": cu_seqlens,
        "tree_cu_seqlens_k": cu_seqlens_k,
        "tree_max_seqlen_q": int(cu_seqlens.diff().max()),
        "tree_max_seqlen_k": int(cu_seqlens_k.diff().max()),
    }


def _rows_with_completions(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """`(B, P)` prompt mask without the rows whose completion has no token: nothing of theirs is predicted, so
    their prompts need not be forwarded."""
    return prompt_mask * completion_mask.bool().any(dim=1, keepdim=True).to(prompt_mask.dtype)


def pack_padding_free(
    prompt_ids: torch.Tensor,  # (B, P) left-padded
    prompt_mask: torch.Tensor,  # (B, P)
    completion_ids: torch.Tensor,  # (B, C) right-padded
    completion_mask: torch.Tensor,  # (B, C)
    every_prompt: bool = False,
) -> PackedLayout:
    """Each row's prompt and completion without padding, one segment per row (sequence parallelism's `pack_rows`),
    attended as chains: the tree attention with every segment's path being the segment itself. The prompt of a row
    without completion tokens is left out, unless `every_prompt` (the MoE router loss counts its tokens, as TRL's
    padded forward does)."""
    if not every_prompt:
        prompt_mask = _rows_with_completions(prompt_mask, completion_mask)
    packed = pack_rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
    lengths = packed.num_tokens[packed.num_tokens > 0]
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    kv_index = torch.arange(packed.length, device=prompt_ids.device)
    index = torch.zeros(completion_ids.shape, dtype=torch.long, device=prompt_ids.device)
    index[packed.rows, packed.cols] = packed.label_index
    mask = torch.zeros(completion_ids.shape, dtype=torch.bool, device=prompt_ids.device)
    mask[packed.rows, packed.cols] = True
    keep = torch.cat([prompt_mask, completion_mask], dim=1).bool()  # (B, P + C): the tokens, in row-major order
    grid = torch.where(keep, keep.reshape(-1).long().cumsum(0).reshape(keep.shape) - 1, -1)
    return PackedLayout(
        "padding_free", packed.input_ids, packed.position_ids, _segments(cu_seqlens, kv_index, cu_seqlens), index,
        mask, prompt_ids.numel() + completion_ids.numel(), grid,
    )  # fmt: skip


def tree_positions(row: Any) -> list[int]:
    """The packed position of each node of a TRL `TreeRow` (`node -> position`): its trie laid out in DFS pre-order,
    unary chains contiguous, as `TreeRow.pack` lays it out."""
    packed = [0] * len(row.tokens)
    position = 0
    stack = list(reversed(row.roots.values()))
    while stack:
        node = stack.pop()
        while True:
            packed[node] = position
            position += 1
            if len(row.children[node]) != 1:
                break
            node = next(iter(row.children[node].values()))
        stack.extend(reversed(row.children[node].values()))
    return packed


def pack_shared_prefix(
    prompt_ids: torch.Tensor,  # (B, P) left-padded
    prompt_mask: torch.Tensor,  # (B, P)
    completion_ids: torch.Tensor,  # (B, C) right-padded
    completion_mask: torch.Tensor,  # (B, C)
) -> PackedLayout:
    """The micro-batch folded into TRL's prefix trie (`TreeRow`): every common prefix forwarded once.

    `TreeRow` keys a node on its token and the next one, so sequences share a token only when they also agree on the
    token after it: a prompt is shared up to its last token, which is repeated once per distinct first completion
    token (one extra position per branch), and completions that start alike share their common start too. Its
    `token_index` lists, sample by sample, the position predicting each trained token, which is here every completion
    token of a row (in the order of `completion_mask.nonzero()`).
    """
    from trl.experimental.async_grpo.packing import TreeRow

    device = prompt_ids.device
    keep_prompt = _rows_with_completions(prompt_mask, completion_mask).bool()
    row = TreeRow()
    keep = torch.cat([keep_prompt, completion_mask.bool()], dim=1).cpu()  # (B, P + C)
    added = []  # the rows added to the trie, in order
    for b in range(prompt_ids.shape[0]):
        prompt = prompt_ids[b][keep_prompt[b]].cpu()
        completion = completion_ids[b][completion_mask[b].bool()].cpu()
        if completion.numel() == 0:
            continue
        added.append(b)
        row.add({
            "input_ids": torch.cat([prompt, completion]),
            "completion_mask": torch.cat([torch.zeros_like(prompt), torch.ones_like(completion)]),
            "old_log_probs": torch.zeros(prompt.numel() + completion.numel()),
            "advantage": 0.0,
            "group_id": b,
        })  # fmt: skip
    packed = row.pack()
    rows, cols = completion_mask.bool().nonzero(as_tuple=True)
    if packed["token_index"].numel() != rows.numel():  # a row without prompt: its first token has no predecessor
        raise ValueError("shared_prefix packing needs at least one prompt token in every row with a completion")
    index = torch.zeros(completion_ids.shape, dtype=torch.long, device=device)
    index[rows, cols] = packed["token_index"].to(device)
    attention = _segments(packed["tree_cu_seqlens_q"], packed["tree_kv_index"], packed["tree_cu_seqlens_k"])
    attention = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in attention.items()}
    positions = torch.tensor(tree_positions(row), dtype=torch.long)
    grid = torch.full(keep.shape, -1, dtype=torch.long)
    for b, nodes in zip(added, row.sample_nodes, strict=True):
        grid[b, keep[b]] = positions[torch.tensor(nodes, dtype=torch.long)]
    return PackedLayout(
        "shared_prefix", packed["input_ids"].to(device).unsqueeze(0), packed["position_ids"].to(device).unsqueeze(0),
        attention, index, completion_mask.bool(), prompt_ids.numel() + completion_ids.numel(), grid.to(device),
    )  # fmt: skip


def layout_fallback_reason(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> str | None:
    """Why a micro-batch cannot be packed exactly (then it is forwarded padded), or `None`.

    A completion token is predicted from the token before it; a row with completion tokens but no prompt token has
    nothing before its first one, and a micro-batch without any completion token has nothing to forward.
    """
    has_completion = completion_mask.bool().any(dim=1)
    if not bool(has_completion.any()):
        return "the micro-batch has no completion token"
    if bool((has_completion & ~prompt_mask.bool().any(dim=1)).any()):
        return "a row has a completion but no prompt token"
    return None


def prepare_packing(requested: str, lm: torch.nn.Module, disable_dropout: bool) -> tuple[str, str | None]:
    """The packing a causal LM `lm` trains with when `requested` (not `"off"`), and the reason of a fallback; `lm`
    switched to the `"tree_or_<its attention>"` attention when the answer is packed.

    A layout its layers cannot take exactly falls back (`hf_rlloss.parallel.layouts.resolve_packing`: a model with
    state-space, linear-attention, convolution or recurrent layers trains `"off"`). Attention dropout under any of
    its names (`attention_dropout`, `attn_pdrop`, a float or `nn.Dropout` on the attention module) is zeroed when
    `disable_dropout=True` (logged), else the model trains `"off"`, where its own attention applies it. A model that
    keeps its own attention when switched (`switch_attention`) trains `"off"`.
    """
    mode, reason = resolve_packing(requested, model_layouts(lm))
    if mode == "off":
        return mode, reason
    dropouts = attention_dropout(lm)
    if dropouts:
        where = ", ".join(f"{k}={v}" for k, v in dropouts.items())
        if not disable_dropout:
            return "off", f"attention dropout ({where}): the tree attention has none (disable_dropout=True zeroes it)"
        zero_attention_dropout(lm)
        logger.warning(f"packing={mode!r}: attention dropout zeroed ({where}), as disable_dropout=True asks")
    try:
        use_packed_attention(lm)
    except ValueError as error:
        return "off", str(error)
    return mode, reason


LAYOUT_BUILDERS = {"shared_prefix": pack_shared_prefix, "padding_free": pack_padding_free}


def build_layout(
    mode: str,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    every_prompt: bool = False,
) -> PackedLayout | None:
    """The packed layout of a micro-batch under `mode`, or `None` for the padded forward: `mode="off"`, or a batch
    `layout_fallback_reason` rejects (logged once per reason). `every_prompt` (`"padding_free"` only) keeps the
    prompts of rows without completion tokens (the MoE router loss: TRL counts them)."""
    if mode not in PACKING_MODES:
        raise ValueError(f"packing={mode!r}; expected one of {', '.join(map(repr, PACKING_MODES))}")
    if mode == "off":
        return None
    reason = layout_fallback_reason(prompt_mask, completion_mask)
    if reason is not None:
        logger.warning_once(f"packing={mode!r}: {reason}, so this micro-batch is forwarded padded (packing='off')")
        return None
    if every_prompt:
        if mode != "padding_free":
            raise ValueError(f"every_prompt=True needs packing='padding_free', got {mode!r}")
        return pack_padding_free(prompt_ids, prompt_mask, completion_ids, completion_mask, every_prompt=True)
    return LAYOUT_BUILDERS[mode](prompt_ids, prompt_mask, completion_ids, completion_mask)
