"""What the trainer does differently per training engine (DDP, DeepSpeed ZeRO, FSDP2).

* the reference model: where it comes from (`reference_source`, a ZeRO-3 sharded copy of an in-memory policy with
  `zero3_sharded_copy`), how it is loaded from a path (`load_reference`) and wrapped (`prepare_reference`, as TRL
  wraps its own); both trainers build their reference with these;
* running a function inside the wrapped model's forward, so that DDP/FSDP/DeepSpeed hooks fire, and resharding
  FSDP2 units after a no-gradient pass (`call_through_wrapper`);
* the dtype the LM head's GEMMs run in under mixed precision (`head_operands`);
* gradient checkpointing off for no-gradient passes (`activation_checkpointing_disabled`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import is_peft_model
from torch import nn
from torch.distributed.fsdp import FSDPModule
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.trainer.utils import create_model_from_path, disable_dropout_in_model

from .transformers_compat import disable_checkpointing, enable_checkpointing, is_checkpointing

__all__ = [
    "activation_checkpointing_disabled",
    "call_through_wrapper",
    "head_operands",
    "is_zero3_partitioned",
    "load_reference",
    "prepare_reference",
    "reference_source",
    "zero3_sharded_copy",
]


@contextlib.contextmanager
def activation_checkpointing_disabled(model: nn.Module, kwargs: dict | None) -> Iterator[None]:
    """TRL's `disable_gradient_checkpointing` with transformers 5's names (the `gradient_checkpointing*` ones warn)."""
    was_enabled = is_checkpointing(model)
    if was_enabled:
        disable_checkpointing(model)
    try:
        yield
    finally:
        if was_enabled:
            enable_checkpointing(model, kwargs)


def is_zero3_partitioned(model: nn.Module) -> bool:
    """Whether `model`'s parameters are DeepSpeed ZeRO-3 shards (built under `deepspeed.zero.Init`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def zero3_sharded_copy(model: nn.Module) -> nn.Module:
    """A copy of a ZeRO-3-partitioned in-memory `model` that stays partitioned on every rank.

    `copy.deepcopy` would copy each rank's empty shard without DeepSpeed's bookkeeping (the copy then fails at its
    first forward). Instead the architecture is rebuilt from `model.config` by transformers' `_from_config`, which
    builds it under `deepspeed.zero.Init` when ZeRO-3 is enabled (as `from_pretrained` does, and so as TRL's
    reference is built), and the weights are copied one parameter at a time inside `GatheredParameters`: at most one
    full parameter exists at a time, and each rank keeps only its shard.
    """
    import deepspeed
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        raise ValueError(
            "rl_loss.use_kl_loss: the in-memory policy is partitioned by deepspeed.zero.Init, but transformers' "
            "DeepSpeed ZeRO-3 config is not active (create the RLLossGRPOConfig before the model, with an accelerate "
            "config that has zero_stage: 3), so its reference copy cannot be built sharded: pass ref_model=<path>"
        )
    dtype = next(model.parameters()).dtype
    copied = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
    sources = dict(model.named_parameters())
    if sources.keys() != dict(copied.named_parameters()).keys():
        raise ValueError(f"cannot copy the ZeRO-3 partitioned {type(model).__name__}: it differs from its config's")
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, param in copied.named_parameters():
        # modifier_rank=0: on exit, rank 0's full copy is partitioned again over the ranks; the source is unchanged.
        gather_source = deepspeed.zero.GatheredParameters([sources[name]])
        with gather_source, deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if rank == 0:
                param.data.copy_(sources[name].data)
    for name, buffer in model.named_buffers():  # buffers are not partitioned
        copied.get_buffer(name).data.copy_(buffer.data)
    copied.set_attn_implementation(model.config._attn_implementation)
    return copied


def reference_source(model: Any, ref_model: Any, peft_config: Any, use_kl_loss: bool) -> Any:
    """Where the reference log-probs will come from, decided before TRL touches the policy: `None` (no KL),
    `"adapter"` (the policy with its adapter disabled, or TRL's frozen `"ref"` adapter), a path, or a model.

    An in-memory policy (no path) is copied: with `copy.deepcopy`, or, when it is partitioned by DeepSpeed ZeRO-3's
    `zero.Init` (e.g. loaded by `from_pretrained` under an accelerate config with `zero3_init_flag: true`), by
    `zero3_sharded_copy`, so that the reference stays sharded per rank. `prepare_reference` then wraps it as TRL
    does its own reference (`prepare_deepspeed`: a ZeRO-3 inference engine under ZeRO-3, stage 0 otherwise).
    """
    if not use_kl_loss:
        if ref_model is not None:
            raise ValueError("ref_model was given but rl_loss.use_kl_loss is false: nothing would use it")
        return None
    if ref_model is not None:
        return ref_model
    if peft_config is not None:
        return "adapter"
    if isinstance(model, str):  # the reference is loaded from the same path
        return model
    if is_peft_model(model):
        # As TRL does for beta != 0: a frozen copy of the pre-trained adapter is the reference.
        default_config = model.peft_config["default"]
        model.add_adapter("ref", default_config)
        for name, param in model.named_parameters():
            if ".default." in name:
                model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
        return "adapter"
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        raise ValueError(
            "rl_loss.use_kl_loss needs a reference model, and a quantized in-memory policy cannot be copied: pass "
            "ref_model=... (a model or a path), or a peft_config (the reference is then the base model)"
        )
    if is_zero3_partitioned(model):
        return zero3_sharded_copy(model)
    return copy.deepcopy(model)  # the policy as given, before any training


def prepare_reference(reference: nn.Module, trainer: Any) -> nn.Module:
    """The reference frozen, in eval mode, and wrapped for the trainer's engine as TRL wraps its own reference."""
    reference.requires_grad_(False)
    reference.eval()
    if getattr(trainer.args, "disable_dropout", True):  # TRL's async config has no such option: off in eval
        disable_dropout_in_model(reference)
    if trainer.is_deepspeed_enabled:
        return prepare_deepspeed(reference, trainer.accelerator)
    if trainer.is_fsdp_enabled:
        return prepare_fsdp(reference, trainer.accelerator)
    return trainer.accelerator.prepare_model(reference, evaluation_mode=True)


def load_reference(path: str, args: Any, defaults: dict[str, Any], overrides: dict[str, Any]) -> nn.Module:
    """The reference loaded from `path` with `args.model_init_kwargs` (and `args.trust_remote_code`), completed by
    `defaults` where they are silent, and `overrides` whatever they say."""
    init_kwargs = dict(args.model_init_kwargs or {})
    init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    for key, value in defaults.items():
        init_kwargs.setdefault(key, value)
    return create_model_from_path(path, **{**init_kwargs, **overrides})


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
