"""Tiny random models built in memory, offline, for the tests and the benchmarks alike: a byte-level tokenizer, a
tiny Qwen2, a tiny MoE of four families, the trainer settings they run with and a length reward.

    from benchmarks.shared.tiny_models import BASE_ARGS, make_model, make_tokenizer, reward_length

    tok = make_tokenizer()
    model = make_model(tok, seed=0)  # 2 layers, hidden 32, 4 query heads over 2 key/value heads
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from hf_rlloss.trainer.common.transformers_compat import checkpointing_argument  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: the 256 ByteLevel characters (no merges) plus the special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", padding_side="left"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def special_token_ids(tokenizer) -> dict[str, int]:
    return dict(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )


def tiny_config(tokenizer, hidden_size: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, **overrides):
    """The config keywords every tiny test model shares (Qwen2, Qwen3-MoE, GPT-OSS, Gemma 2): the tokenizer's
    vocabulary and special tokens, 2 layers, 4 query heads over 2 key/value heads, 128 positions."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        **special_token_ids(tokenizer),
        **overrides,
    )


def with_generation_ids(model, tokenizer):
    """`model` with the tokenizer's special tokens in its generation config (TRL passes its own to `generate`)."""
    for key, value in special_token_ids(tokenizer).items():
        setattr(model.generation_config, key, value)
    return model


def make_model(
    tokenizer,
    seed: int = 0,
    hidden_size: int = 32,
    tie: bool = True,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    attn: str | None = None,
) -> Qwen2ForCausalLM:
    """A tiny random Qwen2 (`attn`: an attention implementation to set, e.g. ``"sdpa"``; else transformers')."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        intermediate_size=2 * hidden_size,
        tie_word_embeddings=tie,
        **tiny_config(tokenizer, hidden_size, layers, heads, kv_heads),
    )
    model = Qwen2ForCausalLM(config)
    if attn is not None:
        model.set_attn_implementation(attn)
    return with_generation_ids(model, tokenizer)


def reward_length(completions, **kwargs):
    return [float(len(c)) / 8.0 for c in completions]


BASE_ARGS = dict(
    use_cpu=True,
    bf16=False,
    report_to="none",
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    **checkpointing_argument(False),  # its name in a stock TRL config of the installed transformers
    logging_steps=1,
    save_strategy="no",
    learning_rate=1e-3,
    disable_tqdm=True,
    seed=0,
    dataloader_num_workers=0,
)


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
