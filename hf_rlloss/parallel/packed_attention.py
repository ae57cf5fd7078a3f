"""One attention implementation for packed training forwards and ordinary ones: `"tree_or_<native>"`.

A model trained with packed rows (`hf_rlloss.trainer.common.packing`) also generates and evaluates with ordinary padded
batches, so it needs two attentions: the tree attention (`tree_attention_forward`) when a forward carries the
`tree_*` keyword arguments of a packed row, and its own attention (`sdpa`, `eager`, `flash_attention_2`, ...)
otherwise. Switching `config._attn_implementation` around each packed forward would not be enough: the backward of
gradient checkpointing recomputes the layers after the forward has returned, and a wrapper (DDP, FSDP, DeepSpeed,
PEFT) may run the forward elsewhere. So the choice is made per call, from the call's own arguments:
`register_packed_attention(native)` registers, with transformers' `AttentionInterface`, a function that runs the
tree attention when `tree_kv_index` is among its keyword arguments and the native attention otherwise, under the
name `"tree_or_<native>"` (the native name stays a substring, so transformers' checks by name, e.g. `"sdpa" in
name`, still see it). Its mask builder is the native one, except inside `packed_forward()`, where it builds nothing:
a packed row's layout comes from the `tree_*` arguments, and transformers would otherwise build a block-diagonal
`(N, N)` mask from the restarting positions.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from torch import nn

from .tree_attention import tree_attention_forward

__all__ = ["PACKED_ATTENTION_PREFIX", "packed_forward", "register_packed_attention", "use_packed_attention"]

PACKED_ATTENTION_PREFIX = "tree_or_"
_PACKED_FORWARD = False  # inside `packed_forward()`: mask builders of "tree_or_*" build nothing


@contextlib.contextmanager
def packed_forward() -> Iterator[None]:
    """Mark the forwards inside it as packed: the mask builders of `"tree_or_*"` attentions return `None`.

    Only mask building reads it (once per forward, before the layers); the attention itself decides from its
    keyword arguments, so a recomputation outside this context (gradient checkpointing) is still the tree attention.
    """
    global _PACKED_FORWARD
    previous, _PACKED_FORWARD = _PACKED_FORWARD, True
    try:
        yield
    finally:
        _PACKED_FORWARD = previous


def _native_attention(native: str, module: nn.Module):
    """The attention function `native` names for `module`: the registered one, or the modeling file's own
    `eager_attention_forward` (transformers registers no global eager function)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if native != "eager" and native in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[native]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(
            f"{type(module).__name__}: its modeling file has no eager_attention_forward for the "
            f"'{PACKED_ATTENTION_PREFIX}{native}' attention to fall back to"
        )
    return eager


def register_packed_attention(native: str) -> str:
    """Register `"tree_or_<native>"` (see the module docstring) with transformers and return its name.

    Args:
        native (`str`): the model's own attention implementation (`"sdpa"`, `"eager"`, `"flash_attention_2"`, ...).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if native.startswith(PACKED_ATTENTION_PREFIX):
        return native
    name = PACKED_ATTENTION_PREFIX + native

    def attention(module, query, key, value, attention_mask, **kwargs):
        if "tree_kv_index" in kwargs:
            return tree_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return _native_attention(native, module)(module, query, key, value, attention_mask, **kwargs)

    native_mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(native)

    def mask(*args, **kwargs):
        if _PACKED_FORWARD or native_mask is None:  # not registered: transformers builds no mask for it either
            return None
        return native_mask(*args, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name


def use_packed_attention(lm: nn.Module) -> str:
    """Switch the causal LM `lm` (a transformers `PreTrainedModel`) to `"tree_or_<its attention>"`; returns the name.
    Idempotent. Its ordinary forwards (generation, evaluation) are unchanged."""
    native = getattr(lm.config, "_attn_implementation", None) or "sdpa"
    name = register_packed_attention(native)
    if native != name:
        lm.set_attn_implementation(name)
    return name
