"""Attention over a packed row of sequences that share prefixes, exact and without a special kernel.

A packed row lays a prefix tree out segment by segment (TRL's `TreeRow.pack` builds it: a shared prompt once, each
completion after it, no padding). Segment `s` holds the row's positions `[cu_q[s], cu_q[s+1])`; its tokens attend to
the keys of its root-to-segment path, the packed positions `kv_index[cu_k[s]:cu_k[s+1]]`, which end with the segment
itself. Causality is therefore bottom-right aligned: query `i` of an `Sq`-token segment whose path has `Sk` keys sees
keys `j <= i + Sk - Sq`. Each token thus sees exactly what it would see in its own unpacked row, and nothing of another
sequence that does not share its prefix.

TRL ships this attention only as a FlashAttention-3 kernel fetched from the Hub (`tree_fa3`, CUDA only). Here it is
plain SDPA, segment by segment, so it runs on CPU and on any GPU; `flash_attn`'s varlen kernel is used when it is
installed and the tensors are on CUDA. Memory: a segment's queries are processed in blocks of at most `QUERY_BLOCK`
rows, so the largest mask is `QUERY_BLOCK × path length`: no `(packed length)²` term. A root segment (its path is
itself: a shared prompt, or every sequence of a padding-free row) needs no mask: SDPA's `is_causal`, whose flash
kernels (CPU and CUDA) tile it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "QUERY_BLOCK",
    "TREE_SDPA_ATTENTION",
    "flash_varlen_kernel",
    "register_tree_attention",
    "tree_attention_forward",
    "tree_attention",
]

TREE_SDPA_ATTENTION = "tree_sdpa"
# Query rows per SDPA call inside one segment: bounds the boolean mask at QUERY_BLOCK × path length.
QUERY_BLOCK = 1024


def flash_varlen_kernel():
    """`flash_attn_varlen_func` when the `flash_attn` package is importable, else `None`."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _varlen_kernel_for(query: torch.Tensor, softcap: float | None, sinks: torch.Tensor | None):
    """flash-attn's varlen kernel where it can take this attention (CUDA, bf16/fp16, no softcapping, no sinks), else
    `None` (the SDPA path). It takes the whole packed row in one call per layer, with the segment bounds and their
    maxima as the layout computed them once per micro-batch: no host sync inside the model."""
    half = query.dtype in (torch.float16, torch.bfloat16)
    if not (query.is_cuda and half and softcap is None and sinks is None):
        return None
    return flash_varlen_kernel()


def _segment_sdpa(
    q: torch.Tensor,  # (H, Sq, D)
    k: torch.Tensor,  # (Hkv, Sk, D)
    v: torch.Tensor,  # (Hkv, Sk, D)
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # (H,)
    dropout: float = 0.0,
) -> torch.Tensor:  # (H, Sq, D)
    """Bottom-right causal attention of one segment's queries to its path's keys; with `sinks` (GPT-OSS's attention
    sinks, `s_aux`), one extra logit per head joins each softmax and is dropped after it, as the model's own does."""
    heads, sq, _ = q.shape
    sk = k.shape[1]
    explicit = softcap is not None or sinks is not None
    if k.shape[0] != heads and explicit:  # GQA/MQA: each KV head serves heads / Hkv query heads (SDPA: enable_gqa)
        k, v = (t.repeat_interleave(heads // t.shape[0], dim=0) for t in (k, v))
    gqa = k.shape[0] != heads
    if not explicit:
        # SDPA gets 4-D tensors: with 3-D ones PyTorch's CPU flash kernel is skipped for the math path (2-3x slower).
        q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if sq == sk and sliding_window is None:
            # A root segment (its path is itself): plain causal attention, no mask at all (the flash kernels tile it).
            return F.scaled_dot_product_attention(
                q4, k4, v4, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
            )[0]
    elif dropout:
        raise ValueError(f"tree attention does not implement attention dropout with softcapping or sinks ({dropout})")
    out = []
    for start in range(0, sq, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, sq)
        rows = torch.arange(start, stop, device=q.device).unsqueeze(1) + (sk - sq)  # absolute depth of each query
        cols = torch.arange(sk, device=q.device).unsqueeze(0)
        allowed = cols <= rows
        if sliding_window is not None:
            allowed &= cols > rows - sliding_window
        if not explicit:
            block = F.scaled_dot_product_attention(
                q4[:, :, start:stop], k4, v4, attn_mask=allowed, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
            out.append(block[0])
            continue
        # Softcapped scores (Gemma 2), attention sinks (GPT-OSS): SDPA has no hook for either, so this block is
        # computed explicitly.
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        scores = (q[:, start:stop] @ k.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            out.append(torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v)
            continue
        sink = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1]
        out.append(probs.to(v.dtype) @ v)
    return torch.cat(out, dim=1)


def tree_attention(
    query: torch.Tensor,  # (H, N, D): the packed row's queries
    key: torch.Tensor,  # (Hkv, N, D)
    value: torch.Tensor,  # (Hkv, N, D)
    kv_index: torch.Tensor,  # (K,): packed positions of every segment's path, laid end to end
    cu_seqlens_q: torch.Tensor,  # (S + 1,): segment boundaries in the row
    cu_seqlens_k: torch.Tensor,  # (S + 1,): path boundaries in kv_index
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
    dropout: float = 0.0,
) -> torch.Tensor:  # (H, N, D)
    """Exact tree attention of a packed row, segment by segment with SDPA (see the module docstring); `dropout` is
    SDPA's `dropout_p` (0 for exactness; the Ulysses attention passes the module's own while training)."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(bounds_q) != len(bounds_k):
        raise ValueError(
            f"tree attention: cu_seqlens_q has {len(bounds_q)} entries and cu_seqlens_k {len(bounds_k)}; "
            "both must be number of segments + 1"
        )
    if bounds_q[-1] != query.shape[1]:
        raise ValueError(f"tree attention: the segments cover {bounds_q[-1]} positions, the row has {query.shape[1]}")
    sizes_q = [b - a for a, b in zip(bounds_q[:-1], bounds_q[1:])]
    sizes_k = [b - a for a, b in zip(bounds_k[:-1], bounds_k[1:])]
    for s, (sq, sk) in enumerate(zip(sizes_q, sizes_k)):
        if sq > sk:
            raise ValueError(f"tree attention: segment {s} has {sq} tokens but a path of only {sk} keys")
    # split, not slice: the backward of `split` is one concatenation, while each slice's backward would write into a
    # zero tensor of the whole row (a row's worth of memory traffic per segment, the bulk of the time on CPU)
    queries = query.split(sizes_q, dim=1)
    keys = key.index_select(1, kv_index).split(sizes_k, dim=1)
    values = value.index_select(1, kv_index).split(sizes_k, dim=1)
    out = [
        _segment_sdpa(q, k, v, scaling, sliding_window, softcap, sinks, dropout)
        for q, k, v in zip(queries, keys, values)
    ]
    return torch.cat(out, dim=1)


def tree_attention_forward(
    module,
    query: torch.Tensor,  # (1, H, N, D)
    key: torch.Tensor,  # (1, Hkv, N, D)
    value: torch.Tensor,  # (1, Hkv, N, D)
    attention_mask,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int | None = None,
    tree_max_seqlen_k: int | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # (1, N, H, D)
    """transformers `AttentionInterface` function with the keyword arguments of TRL's `tree_attention`, so a model
    loaded with it consumes the `tree_*` fields of `TreeRow.pack` (TRL's async trainer passes them to the forward).

    Raises:
        ValueError: for a batch of more than one packed row, or attention dropout during training (the packed
            forwards run with dropout disabled, as TRL's trainers do).
    """
    if query.shape[0] != 1:
        raise ValueError(f"tree attention takes one packed row, got a batch of {query.shape[0]}")
    if dropout and module.training:
        raise ValueError(f"tree attention does not implement attention dropout (got {dropout})")
    flash = _varlen_kernel_for(query, softcap, s_aux)
    if flash is not None:
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, H, D)
        out = flash(
            q, k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index),
            tree_cu_seqlens_q.int(), tree_cu_seqlens_k.int(),
            tree_max_seqlen_q or int(tree_cu_seqlens_q.diff().max()),
            tree_max_seqlen_k or int(tree_cu_seqlens_k.diff().max()),
            softmax_scale=scaling, causal=True,
            window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
        )  # fmt: skip
        return out.unsqueeze(0), None
    out = tree_attention(
        query[0], key[0], value[0], tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, scaling, sliding_window,
        softcap, s_aux,
    )  # fmt: skip
    # contiguous, as transformers' own attention functions return it: some layers `.view` the output (AFMoE, JetMoE)
    return out.transpose(0, 1).contiguous().unsqueeze(0), None


def register_tree_attention(name: str = TREE_SDPA_ATTENTION) -> str:
    """Register `tree_attention_forward` with transformers under `name`, with a mask builder that builds nothing
    (the layout comes from the `tree_*` keyword arguments). Registering it as TRL's `"tree_fa3"` lets TRL's async
    trainer run its packed rows on any machine. Returns `name`, to pass as `attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, tree_attention_forward)
    AttentionMaskInterface.register(name, lambda *args, **kwargs: None)
    return name
