"""Ulysses sequence-parallel attention (DeepSpeed-Ulysses, https://arxiv.org/abs/2309.14509), registered with
transformers' `AttentionInterface`: every rank of an SP group holds a contiguous shard of each (packed) sequence;
attention all-to-alls from sequence shards to head shards, runs causal SDPA on whole sequences, and all-to-alls back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .sequence import sp_gather, sp_group, sp_world_size

ULYSSES_ATTENTION = "ulysses_sdpa"
# Attention implementations the Ulysses attention can stand in for (it runs SDPA on whole sequences).
SP_WRAPPABLE_ATTENTION = ("sdpa", "eager", ULYSSES_ATTENTION)
_ACTIVE_SP_MESH: DeviceMesh | None = None


class ulysses_sequence_parallel:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Context manager that turns the Ulysses attention on for the forwards inside it.

    Outside it (generation, evaluation) a model loaded with `attn_implementation="ulysses_sdpa"` runs plain SDPA on
    its local inputs. Inside it, every rank of `sp_mesh` holds a contiguous shard of each sequence, and attention
    runs on whole sequences: all-to-all from sequence shards to head shards, SDPA, all-to-all back (DeepSpeed-Ulysses,
    https://arxiv.org/abs/2309.14509).
    """

    def __init__(self, sp_mesh: DeviceMesh | None):
        self.sp_mesh = sp_mesh

    def __enter__(self):
        global _ACTIVE_SP_MESH
        self._previous, _ACTIVE_SP_MESH = _ACTIVE_SP_MESH, self.sp_mesh
        return self

    def __exit__(self, *exc):
        global _ACTIVE_SP_MESH
        _ACTIVE_SP_MESH = self._previous


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Send chunk `i` of dim 0 to rank `i` and stack what arrives along dim 0, with autograd (functional
    collectives; the deprecated `torch.distributed.nn` ones break on gloo subgroups)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, group))


def _sequence_to_heads(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """`[B, H, S, D]` (local sequence, all heads) → `[B, H/W, W·S, D]` (whole sequence, local heads)."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4)  # [W, B, H/W, S, D]: chunk i → rank i
    received = _all_to_all(chunks, group)  # [W, B, H/W, S, D]: received[j] = sequence shard j
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _heads_to_sequence(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """`[B, H/W, W·S, D]` → `[B, H, S, D]`, the inverse of :func:`_sequence_to_heads`."""
    b, h_local, s_global, d = x.shape
    s = s_global // size
    chunks = x.reshape(b, h_local, size, s, d).permute(2, 0, 1, 3, 4)  # [W, B, H/W, S, D]: shard j → rank j
    received = _all_to_all(chunks, group)  # received[i] = head group i of my sequence shard
    return received.permute(1, 0, 2, 3, 4).reshape(b, size * h_local, s, d)


def _document_bounds(global_positions: torch.Tensor) -> list[int] | None:
    """Start offsets of the packed sequences of a single row (positions restart), or `None` for one sequence."""
    starts = (global_positions[0, 1:] != global_positions[0, :-1] + 1).nonzero().squeeze(-1) + 1
    if starts.numel() == 0:
        return None
    return [0, *starts.tolist(), global_positions.shape[1]]


def _packed_causal_mask(global_positions: torch.Tensor) -> torch.Tensor | None:
    """`(B, 1, S, S)` bool mask for packed sequences (positions restart), or `None` when plain causal suffices."""
    starts = global_positions[:, 1:] != global_positions[:, :-1] + 1
    if not bool(starts.any()):
        return None
    doc = torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=1).cumsum(-1)  # (B, S) document index
    length = global_positions.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=doc.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


def _causal_sdpa(q, k, v, global_positions, dropout: float, scaling: float | None) -> torch.Tensor:
    """Causal attention within each packed sequence. A single packed row (the trainer's layout) runs SDPA per
    sequence with `is_causal=True` — memory linear in the row length instead of an `(L, L)` mask; a batch of
    several rows falls back to an explicit block-causal mask."""

    def sdpa(q, k, v, mask=None):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip

    if global_positions.shape[0] == 1:
        bounds = _document_bounds(global_positions)
        if bounds is None:
            return sdpa(q, k, v)
        pieces = [sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return torch.cat(pieces, dim=2)
    return sdpa(q, k, v, _packed_causal_mask(global_positions))


def ulysses_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention function for transformers' `AttentionInterface` (name `"ulysses_sdpa"`).

    Shapes (local, per rank): `query [B, H, S, D]`, `key/value [B, Hkv, S, D]`; returns `[B, S, H, D]`.
    Under SP the padding `attention_mask` (local, meaningless for the whole sequence) is not used: sequences must be
    unpadded or packed, with global `position_ids` that restart at each packed sequence.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mesh = _ACTIVE_SP_MESH
    size = sp_world_size(mesh)
    if size == 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    group = sp_group(mesh)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size:
        raise ValueError(f"Ulysses needs the attention heads ({heads}) to be divisible by sp_size ({size})")
    if kv_heads % size:  # GQA with fewer KV heads than ranks: replicate each KV head, keeping the q → kv grouping
        repeat = size // math.gcd(kv_heads, size)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError("Ulysses attention needs position_ids (global positions of the local shard)")
    q, k, v = (_sequence_to_heads(t, size, group) for t in (query, key, value))
    positions = sp_gather(position_ids.expand(query.shape[0], -1), mesh, dim=1)
    out = _causal_sdpa(q, k, v, positions, dropout if module.training else 0.0, scaling)
    return _heads_to_sequence(out, size, group).transpose(1, 2).contiguous(), None


def register_ulysses_attention() -> str:
    """Register the Ulysses attention (and SDPA's mask builder, so non-SP use is exactly SDPA) with transformers.

    Returns the name to pass as `attn_implementation`.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, sdpa_mask)
    return ULYSSES_ATTENTION


def use_ulysses_attention(lm: nn.Module, group_size: int, what: str) -> None:
    """Check that the causal LM `lm` can run under Ulysses SP over `group_size` ranks and switch it to the
    `"ulysses_sdpa"` attention (plain SDPA outside `ulysses_sequence_parallel`). `what` names it in the errors."""
    sp = group_size
    name = type(lm).__name__
    config = lm.config.get_text_config()
    implementation = getattr(lm.config, "_attn_implementation", None) or "sdpa"
    if implementation not in SP_WRAPPABLE_ATTENTION:
        raise ValueError(
            f"sp_size={sp}: {what} ({name}) uses attn_implementation={implementation!r}, which the Ulysses "
            f"attention cannot wrap; load it with one of {', '.join(map(repr, SP_WRAPPABLE_ATTENTION))}"
        )
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and heads % sp != 0:
        raise ValueError(
            f"sp_size={sp}: {what} ({name}) has {heads} attention heads, not divisible by sp_size (Ulysses gives "
            "each rank of an SP group heads / sp_size of them); choose an sp_size that divides it"
        )
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention"} or getattr(config, "sliding_window", None) is not None:
        kinds = ", ".join(sorted(layer_types - {"full_attention"})) or "sliding_window"
        raise ValueError(
            f"sp_size={sp}: {what} ({name}) has attention layers other than full causal attention ({kinds}), "
            "which the Ulysses attention does not implement"
        )
    lm.set_attn_implementation(register_ulysses_attention())
