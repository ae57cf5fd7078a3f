"""The attention of the asynchronous trainer's packed rows, on CUDA or off it.

TRL packs every micro-batch into one prefix-trie row and forwards it through its FlashAttention-3 tree attention
(`"tree_fa3"`, CUDA only). `tree_attention_name` picks that kernel or hf_rlloss' exact SDPA tree attention
(`hf_rlloss.parallel.tree_attention`, any device), `use_tree_attention` puts a model on it (refusing, before the first
step, a model whose layers a packed row is not exact for), and `portable_async_trl` lets TRL's `AsyncGRPOTrainer` be
constructed off CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trl.experimental.async_grpo.async_grpo_trainer as trl_async
from torch import nn
from transformers.utils import logging
from trl.experimental.async_grpo.packing import TREE_ATTENTION

from ...parallel.layouts import model_layouts, switch_attention, zero_dropout
from ...parallel.tree_attention import register_tree_attention
from ..common.overrides import overridden

logger = logging.get_logger(__name__)

__all__ = ["TREE_ATTENTION", "portable_async_trl", "tree_attention_name", "use_tree_attention"]


def use_tree_attention(lm: nn.Module, name: str, what: str) -> None:
    """Put the causal LM `lm` on the tree attention `name`, which every forward of the async trainer runs (TRL packs
    each micro-batch into one prefix-trie row; there is no padded forward to fall back to). Refuses, before the first
    step, a model whose layers a packed row is not exact for (`hf_rlloss.parallel.layouts`: state-space, linear
    attention, convolutions, ...) or whose attention cannot be switched; zeroes every dropout it has, logged (TRL's
    async trainer has no `disable_dropout`, the tree attention has no dropout, and a functional dropout left on would
    make the trained policy differ from the one whose log-probs the loss uses)."""
    layouts = model_layouts(lm)
    if not layouts.allows("shared_prefix"):
        raise ValueError(
            f"RLLossAsyncGRPOTrainer forwards every micro-batch as one packed row, which is not exact for {what} "
            f"({layouts.model_type}): {layouts.reason}. Train it with RLLossGRPOTrainer (packing='off')."
        )
    zeroed = zero_dropout(lm)  # the functional dropouts and layerdrop too (OPT, BioGPT, Seed-OSS, ...)
    if zeroed:
        logger.warning(f"{what}: dropout zeroed for the packed rows ({zeroed})")
    switch_attention(lm, name, f"RLLossAsyncGRPOTrainer: {what}")


def tree_attention_name(backend: str, device_type: str) -> str:
    """The attention implementation the packed rows use: TRL's `"tree_fa3"` (its CUDA kernel) or hf_rlloss'
    portable `"tree_sdpa"` (registered here). `"auto"` picks FA3 on CUDA when the `kernels` package is installed."""
    if backend == "auto":
        try:
            import kernels  # noqa: F401

            has_kernels = True
        except ImportError:
            has_kernels = False
        backend = "fa3" if device_type == "cuda" and has_kernels else "sdpa"
        if device_type == "cuda" and not has_kernels:
            logger.warning(
                "tree_attention='auto' on CUDA: the kernels package is not installed, so the packed rows use the "
                "portable SDPA tree attention instead of TRL's FlashAttention-3 kernel (pip install kernels)"
            )
    if backend == "fa3":
        if device_type != "cuda":
            raise ValueError(
                f"tree_attention='fa3' needs CUDA (TRL's FlashAttention-3 kernel); the device is {device_type}: use "
                "'sdpa'"
            )
        return TREE_ATTENTION
    return register_tree_attention()


@contextlib.contextmanager
def portable_async_trl(device_type: str = "cpu") -> Iterator[None]:
    """TRL's `AsyncGRPOTrainer` constructed off CUDA: its two CUDA-only calls replaced while inside the block.

    TRL's constructor registers its FlashAttention-3 tree attention (`register_tree_attention`) and asks CUDA for the
    device's name (`get_peak_flops_per_device`, for MFU). Off CUDA the first registers hf_rlloss' exact SDPA tree
    attention under TRL's name `"tree_fa3"` instead, and the second gives `None` (no MFU metric), so a stock
    `AsyncGRPOTrainer` built in the block trains on CPU. On CUDA nothing is replaced.
    """
    if device_type == "cuda":
        yield
        return
    with overridden(
        trl_async,
        register_tree_attention=lambda: register_tree_attention(TREE_ATTENTION),
        get_peak_flops_per_device=lambda accelerator, dtype: None,
    ):
        yield
