"""The reference model of the loss layer's KL: where it comes from, how it is loaded and wrapped per engine.

`reference_source` decides, before TRL touches the policy, what the reference is (the policy's adapter disabled, a
path, a model, or a copy of the in-memory policy, sharded under ZeRO-3 by `zero3_sharded_copy`); `load_reference`
loads one from a path with the trainer's `model_init_kwargs`; `prepare_reference` freezes it and wraps it for the
training engine as TRL wraps its own. Both trainers build their reference from these.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist
from accelerate.utils import is_peft_model
from torch import nn
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.trainer.utils import create_model_from_path, disable_dropout_in_model

__all__ = ["is_zero3_partitioned", "load_reference", "prepare_reference", "reference_source", "zero3_sharded_copy"]


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
