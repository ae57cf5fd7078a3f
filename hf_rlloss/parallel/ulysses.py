"""Ulysses sequence-parallel attention (DeepSpeed-Ulysses, https://arxiv.org/abs/2309.14509), registered with
transformers' `AttentionInterface`: every rank of an SP group holds a contiguous shard of each (packed) sequence;
attention all-to-alls from sequence shards to head shards, attends the whole sequences (`tree_attention`: causal SDPA
per packed sequence, or per segment of a prefix-sharing tree row; no `(L, L)` mask), and all-to-alls back.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.utils import logging

from .layouts import model_layouts, switch_attention, zero_attention_dropout
from .sequence import sp_gather, sp_group, sp_world_size
from .tree_attention import tree_attention

logger = logging.get_logger(__name__)

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


def _root_layout(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree layout of a padding-free packed row `(L,)` of global positions: each packed sequence (positions
    restart) is a root segment whose path is itself. Returns `(kv_index, cu_seqlens_q, cu_seqlens_k)`."""
    starts = (positions[1:] != positions[:-1] + 1).nonzero().squeeze(-1) + 1
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_tensor([positions.shape[0]])])
    return torch.arange(positions.shape[0], device=positions.device), bounds, bounds


def _cover_padding(
    kv_index: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layout of `N` positions extended to the SP-padded length `length >= N`: the padding at the end (fewer than
    sp_size positions, see `sp_shard_inputs`) becomes one more root segment, so it attends only to itself."""
    n = int(cu_seqlens_q[-1])
    if n == length:
        return kv_index, cu_seqlens_q, cu_seqlens_k
    if n > length:
        raise ValueError(f"Ulysses attention: the tree layout covers {n} positions, the sequence has {length}")
    pad = torch.arange(n, length, device=kv_index.device, dtype=kv_index.dtype)
    return (
        torch.cat([kv_index, pad]),
        torch.cat([cu_seqlens_q, cu_seqlens_q.new_tensor([length])]),
        torch.cat([cu_seqlens_k, cu_seqlens_k.new_tensor([int(cu_seqlens_k[-1]) + length - n])]),
    )


def ulysses_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention function for transformers' `AttentionInterface` (name `"ulysses_sdpa"`).

    Shapes (local, per rank): `query [B, H, S, D]`, `key/value [B, Hkv, S, D]`; returns `[B, S, H, D]`.
    Under SP the padding `attention_mask` (local, meaningless for the whole sequence) is not used. After the
    all-to-all every rank holds whole sequences (for its heads), attended with `tree_attention`, one SDPA call per
    segment, no `(L, L)` mask:

    - with the `tree_*` keyword arguments (TRL's `TreeRow.pack` layout of the WHOLE packed row, identical on every
      rank of the SP group, as `tree_attention_forward` takes them; `B == 1`): shared prefixes forwarded once;
    - without them: each row is padding-free packed, sequences found where the global `position_ids` restart.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mesh = _ACTIVE_SP_MESH
    size = sp_world_size(mesh)
    if size == 1:
        if kwargs.get("tree_kv_index") is not None:  # a packed tree row without SP: the tree attention itself
            from .tree_attention import tree_attention_forward

            return tree_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
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
    q, k, v = (_sequence_to_heads(t, size, group) for t in (query, key, value))  # [B, H/W, L, D]: whole sequences
    length = q.shape[2]
    if kwargs.get("tree_kv_index") is not None:
        if q.shape[0] != 1:
            raise ValueError(f"Ulysses tree attention takes one packed row, got a batch of {q.shape[0]}")
        layouts = [(kwargs["tree_kv_index"], kwargs["tree_cu_seqlens_q"], kwargs["tree_cu_seqlens_k"])]
    else:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError("Ulysses attention needs position_ids (global positions of the local shard)")
        positions = sp_gather(position_ids.expand(query.shape[0], -1), mesh, dim=1)
        layouts = [_root_layout(row) for row in positions]
    dropout = dropout if module.training else 0.0
    sliding_window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    options = {"scaling": scaling, "sliding_window": sliding_window, "softcap": softcap, "dropout": dropout}
    rows = [
        tree_attention(q[b], k[b], v[b], *_cover_padding(*layout, length), **options)
        for b, layout in enumerate(layouts)
    ]
    out = torch.stack(rows)  # [B, H/W, L, D]
    return _heads_to_sequence(out, size, group).transpose(1, 2).contiguous(), None


def _ulysses_mask(*args, **kwargs):
    """transformers' mask builder for `"ulysses_sdpa"`: SDPA's outside SP; none under SP, where the attention finds
    the sequences itself (the mask transformers would build from a local shard is `(L/sp)²` and unused)."""
    from transformers.masking_utils import sdpa_mask

    if sp_world_size(_ACTIVE_SP_MESH) > 1:
        return None
    return sdpa_mask(*args, **kwargs)


def register_ulysses_attention() -> str:
    """Register the Ulysses attention with transformers, and a mask builder that is SDPA's outside SP (so non-SP use
    is exactly SDPA) and builds nothing under SP.

    Returns the name to pass as `attn_implementation`.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, _ulysses_mask)
    return ULYSSES_ATTENTION


def use_ulysses_attention(lm: nn.Module, group_size: int, what: str, disable_dropout: bool = False) -> None:
    """Check that the causal LM `lm` can run under Ulysses SP over `group_size` ranks and switch it to the
    `"ulysses_sdpa"` attention (plain SDPA outside `ulysses_sequence_parallel`). `what` names it in the errors.

    `disable_dropout=True` (TRL's option, which zeroes `nn.Dropout` modules only) also zeroes the attention dropout
    kept as a float or config field (`attn_pdrop`, GPTBigCode's `attn_dropout`, ...), which the Ulysses attention
    would otherwise apply."""
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
    layouts = model_layouts(lm)  # the one table of what each kind of layer can be rearranged into
    if not layouts.allows("sequence_parallel"):
        raise ValueError(
            f"sp_size={sp}: {what} ({name}) cannot be split over the ranks of an SP group exactly: {layouts.reason}"
        )
    if disable_dropout and (zeroed := zero_attention_dropout(lm)):
        where = ", ".join(f"{k}={v}" for k, v in zeroed.items())
        logger.warning(f"sp_size={sp}: {what}'s attention dropout zeroed ({where}), as disable_dropout=True asks")
    switch_attention(lm, register_ulysses_attention(), f"sp_size={sp}: {what} ({name})")
