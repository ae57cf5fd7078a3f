"""What the trainer does differently per training engine (DDP, DeepSpeed ZeRO, FSDP2).

* running a function inside the wrapped model's forward, so that DDP/FSDP/DeepSpeed hooks fire, and resharding
  FSDP2 units after a no-gradient pass (`call_through_wrapper`);
* the dtype the LM head's GEMMs run in under mixed precision (`head_operands`);
* gradient checkpointing off for no-gradient passes (`activation_checkpointing_disabled`).

The reference model, which each engine wraps its own way, is `reference.py`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = [
    "activation_checkpointing_disabled",
    "call_through_wrapper",
    "head_operands",
]


@contextlib.contextmanager
def activation_checkpointing_disabled(model: nn.Module, kwargs: dict | None) -> Iterator[None]:
    """TRL's `disable_gradient_checkpointing` with transformers 5's names (the `gradient_checkpointing*` ones warn)."""
    was_enabled = model.is_activation_checkpointing
    if was_enabled:
        model.activation_checkpointing_disable()
    try:
        yield
    finally:
        if was_enabled:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


def call_through_wrapper(accelerator: Any, redirection: Callable, model: nn.Module, fn: Callable, *args: Any) -> Any:
    """``fn(unwrapped, *args)``, run inside ``model``'s forward when it is a DDP/FSDP/DeepSpeed wrapper.

    `redirection` is TRL's `_ForwardRedirection` (it runs `fn` as the wrapper's forward). An FSDP2 model is its own
    unwrapped module (`fully_shard` changes its class in place), yet it too must be called through its forward: the
    root's pre-forward hook initializes FSDP2 and unshards the parameters the root owns, the units inside (layers;
    the embeddings, final norm and LM head, which Accelerate shards as one unit, tied or not) are unsharded by their
    own hooks during the backbone's forward, and the backward ends with the root's callback that reduce-scatters
    every unit's gradients. Without gradients (old and reference log-probs, evaluation), the units FSDP2 keeps
    unsharded after a forward for the coming backward (the root, Accelerate's embeddings/norm/head unit) are
    resharded right away: no backward would do it, and the full `(V, H)` head would stay materialized until the next
    training step's backward.
    """
    unwrapped = accelerator.unwrap_model(model)
    if unwrapped is model and not isinstance(model, FSDPModule):
        return fn(unwrapped, *args)
    out = redirection(model, unwrapped, fn, unwrapped, *args)
    if isinstance(model, FSDPModule) and not torch.is_grad_enabled():
        for module in model.modules():  # FSDPModule.reshard is per unit, not recursive
            if isinstance(module, FSDPModule):
                module.reshard()
    return out


def head_operands(
    hidden: torch.Tensor, weight: torch.Tensor, cast_to_fp32: bool, mixed_precision: str | None
) -> tuple[torch.Tensor, torch.Tensor, torch.dtype | None]:
    """The LM head's operands and the dtype its GEMMs run in.

    float32 with `cast_to_fp32` (TRL's `cast_lm_head_to_fp32`); the mixed-precision dtype under `"bf16"`/`"fp16"`
    (the chunked kernel casts its operands, and the gradients come back in the dtypes of the hidden states and the
    weight, e.g. float32 master weights); otherwise their common dtype (float32 training is unchanged).
    """
    if cast_to_fp32:
        return hidden.float(), weight.float(), torch.float32
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mixed_precision))
    if half is not None:
        return hidden, weight, half
    if hidden.dtype != weight.dtype:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
        return hidden.to(dtype), weight.to(dtype), None
    return hidden, weight, None
