"""The parts of a causal LM the loss layer reads, and the checks that it can.

The loss projects the backbone's last hidden states through the LM head itself (in chunks, never materializing the
`(tokens, vocab)` logits), so it needs the backbone (`causal_lm(...).base_model`), the head's weight as the model's
forward would use it (`active_head` through a PEFT wrapper), the factor the model scales its logits by
(`logit_scale`, folded into the temperature), its final-logit softcapping (`with_model_softcapping`) and, for an
MoE policy, its router load-balancing loss (`load_balancing_loss_func`). `check_model_supported` refuses what the
layer would compute differently from the model's own forward.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from accelerate.utils import is_peft_available, is_peft_model
from torch import nn
from transformers import LogitsProcessorList

from ...loss.chunked_logprobs import chunked_kept_logmass, chunked_logprobs
from ...loss.config import BaseRLLossConfig

if is_peft_available():  # peft is optional: without it no head can be wrapped
    from peft.utils.other import ModulesToSaveWrapper
else:
    ModulesToSaveWrapper = None

__all__ = [
    "active_head",
    "causal_lm",
    "check_model_supported",
    "head_logprobs",
    "load_balancing_loss_func",
    "logit_scale",
    "with_model_softcapping",
]


def causal_lm(unwrapped: nn.Module) -> nn.Module:
    """The causal LM itself: the base model of a PEFT model, else `unwrapped`."""
    return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped


def with_model_softcapping(loss_cfg: BaseRLLossConfig, lm: nn.Module) -> BaseRLLossConfig:
    """The loss config with `logit_softcapping` set from the model's `final_logit_softcapping` (Gemma 2) when unset,
    so that the chunked head computes the logits the model's own forward does. A value that differs from the
    model's is left for `check_model_supported` to refuse."""
    softcap = getattr(lm.config.get_text_config(), "final_logit_softcapping", None)
    if softcap is None or loss_cfg.logit_softcapping is not None:
        return loss_cfg
    return loss_cfg.model_copy(update={"logit_softcapping": float(softcap)})


def logit_scale(text_config: Any) -> float:
    """The factor the model multiplies its logits by before the softmax (1.0 for most models), as TRL reads it."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    if scale is None and getattr(text_config, "logits_mup_width_multiplier", None) is not None:  # Inkling
        scale = 1 / text_config.logits_mup_width_multiplier
    return 1.0 if scale is None else float(scale)


def load_balancing_loss_func(lm: nn.Module):
    """The MoE load-balancing loss its causal-LM class computes in `forward` (transformers' per-model
    `load_balancing_loss_func`, e.g. Switch-Transformer style for Qwen3-MoE, Mixtral, GPT-OSS)."""
    fn = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
    if fn is None or not hasattr(lm, "num_experts") or not hasattr(lm, "num_experts_per_tok"):
        raise ValueError(
            f"{type(lm).__name__} declares output_router_logits but its module has no load_balancing_loss_func (or "
            "the model no num_experts / num_experts_per_tok): set router_aux_loss_coef=0.0 to train without the "
            "router auxiliary loss"
        )
    return fn


def active_head(head: nn.Module) -> nn.Module:
    """The module a PEFT `ModulesToSaveWrapper` around the LM head forwards to now (mirroring its `forward`): the
    active adapter's trainable copy, or the original head while adapters are disabled; any other head as is."""
    if ModulesToSaveWrapper is None or not isinstance(head, ModulesToSaveWrapper):
        return head
    active = head.active_adapters
    if head.disable_adapters or not active or any(name not in head.modules_to_save for name in active):
        return head.original_module
    return head.modules_to_save[active[0]]


# Families whose forward is not a causal LM's over a padded batch, by model_type -> why.
_REFUSED_FAMILIES = {
    "cpmant": (
        "CpmAntModel marks every input token as context (context=1), so each token attends to the tokens after it "
        "(the token it predicts included), and it counts a row's padding as its leading tokens (length = number of "
        "non-zero ids), so right-padded completions are mis-masked"
    ),
}


def check_model_supported(model: nn.Module, logit_softcapping: float | None) -> None:
    """Refuse a model whose logits the loss layer's chunked head would not reproduce, or whose forward is not a
    causal LM's (`_REFUSED_FAMILIES`, by name).

    Args:
        model (`nn.Module`): the policy or the reference (a PEFT model is read through its base model).
        logit_softcapping (`float`, *optional*): the loss config's `logit_softcapping`; must equal the model's
            `final_logit_softcapping`.
    """
    lm = causal_lm(model)
    name = type(lm).__name__
    text_config = lm.config.get_text_config()
    refusal = _REFUSED_FAMILIES.get(getattr(text_config, "model_type", None))
    if refusal is not None:
        raise ValueError(f"{name} ({text_config.model_type}) cannot be trained as a causal LM policy: {refusal}")
    softcap = getattr(text_config, "final_logit_softcapping", None)
    if softcap != logit_softcapping:
        raise ValueError(
            f"{name} has final_logit_softcapping={softcap}, but the loss softcaps its logits with "
            f"rl_loss.logit_softcapping={logit_softcapping}: they must match (the policy and "
            "the reference are scored with the same head)"
        )
    scale = logit_scale(text_config)
    if softcap is not None and scale != 1.0:
        raise ValueError(
            f"{name} both scales ({scale}) and softcaps its logits: the loss layer folds the "
            "scale into the temperature, which is exact only without softcapping"
        )
    if scale <= 0:
        raise ValueError(f"{name} scales its logits by {scale}: not supported")
    if getattr(lm, "base_model", lm) is lm:
        raise ValueError(f"{name} has no separate backbone (base_model): its last hidden states are not reachable")
    head = active_head(lm.get_output_embeddings())
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{name}'s output embedding is {type(head).__name__}, not a plain nn.Linear LM head")
    if head.bias is not None:
        raise ValueError(f"{name}'s LM head has a bias, which the loss layer does not add")
    extra = [param for param, _ in head.named_parameters() if param != "weight"]
    if extra:  # Dory's learned per-token `logit_scale`: the chunked head would neither apply nor train it
        raise ValueError(
            f"{name}'s LM head ({type(head).__name__}) has parameters besides its weight ({', '.join(extra)}), which "
            "the loss layer's chunked head neither applies nor trains"
        )


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_cfg: BaseRLLossConfig,
    temperature: float,
    matmul_dtype: torch.dtype | None,
    truncation: LogitsProcessorList | None = None,
) -> torch.Tensor:
    """`(N,)` log-probs of `labels` from `(N, H)` hidden states through the `(V, H)` LM head, chunked as the loss
    computes them (`loss_cfg.chunk_size`, `logit_softcapping`, `compile_epilogue`); with `truncation`, `(N, 2)`: the
    log-probs and the log-mass that the replayed truncation keeps (`chunked_kept_logmass`)."""
    if truncation is not None:
        if matmul_dtype is not None:
            hidden, weight = hidden.to(matmul_dtype), weight.to(matmul_dtype)
        logps, kept = chunked_kept_logmass(
            hidden,
            weight,
            labels,
            truncation,
            temperature=temperature,
            chunk_size=loss_cfg.chunk_size,
            softcap=loss_cfg.logit_softcapping,
        )
        return torch.stack([logps, kept], dim=-1)
    logps, _ = chunked_logprobs(
        hidden,
        weight,
        labels,
        temperature=temperature,
        chunk_size=loss_cfg.chunk_size,
        matmul_dtype=matmul_dtype,
        compile_epilogue=loss_cfg.compile_epilogue,
        softcap=loss_cfg.logit_softcapping,
    )
    return logps
