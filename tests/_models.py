"""Tiny random-init causal LMs built in memory (no hub access here)."""

from __future__ import annotations

import torch
from _trainer_utils import tiny_config, with_generation_ids  # noqa: F401
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.shared.tiny_models import tiny_moe  # noqa: F401  (shared with the benchmarks)


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
