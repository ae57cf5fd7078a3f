"""Tiny random-init causal LMs built in memory (no hub access here)."""

from __future__ import annotations

import torch
from _trainer_utils import tiny_config, with_generation_ids
from transformers import Qwen2Config, Qwen2ForCausalLM


def tiny_qwen2(seed: int = 0, vocab: int = 64, heads: int = 4, kv_heads: int = 2, attn: str = "sdpa", **overrides):
    settings = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    config = Qwen2Config(**{**settings, **overrides})
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation(attn)
    return model.float()


def tiny_moe(tok, family: str, near_tied: bool = True, seed: int = 0):
    """A tiny random MoE (2 layers, 8 experts, top-2) of `family`; `near_tied`: routers whose experts' scores differ
    by about 1e-3 of their size, and experts whose outputs weigh (10× `down_proj`)."""
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from hf_rlloss.trainer.common.routing_replay import find_routers

    common = tiny_config(tok, num_experts_per_tok=2, head_dim=8, router_aux_loss_coef=0.0)
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                intermediate_size=64, moe_intermediate_size=16, num_experts=8, norm_topk_prob=True, **common
            )
        )
    elif family == "olmoe":
        model = OlmoeForCausalLM(OlmoeConfig(intermediate_size=16, num_experts=8, **common))
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=16, num_local_experts=8, **common))
    else:
        model = GptOssForCausalLM(
            GptOssConfig(intermediate_size=16, num_local_experts=8, sliding_window=8, **common)
        ).float()
    if near_tied:
        with torch.no_grad():
            for router, _ in find_routers(model):
                router.weight.copy_(5 * router.weight[:1] + 1e-3 * router.weight)
                if getattr(router, "bias", None) is not None:
                    router.bias.zero_()
            for name, param in model.named_parameters():
                if "experts" in name and "down_proj" in name:
                    param.mul_(10)
    return with_generation_ids(model, tok).eval()
