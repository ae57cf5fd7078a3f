"""Offline tiny vision-language models for the VLM tests: Gemma 3 and Qwen2-VL built in memory from configs, with
their processors (an image processor with small images and a byte-level tokenizer holding the image tokens),
conversational prompts with generated PIL images, rewards, and fixed completions that never hold an image token.

Qwen2-VL's processor is built without its video processor, which needs torchvision (not installed here).
"""

from __future__ import annotations

import copy
import zlib

import torch
from _trainer_utils import FixedCompletions
from datasets import Dataset
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LAYERS = ["sliding_attention", "full_attention"]  # Gemma 3: the completions see the image through the global layer
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}IMAGE{% else %}{{ c['text'] }}{% endif %}{% endfor %}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer(image_tokens: list[str], named: dict[str, str]) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (no merges) whose special tokens include the model's image tokens."""
    specials = ["<pad>", "<eos>", "<bos>", *image_tokens]
    vocab = {token: i for i, token in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(specials)  # never split into bytes
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        padding_side="left",
        extra_special_tokens=named,
    )


def _ids(tok, config_cls, text_config: dict, **config):
    """The model config, its text config included, with the tokenizer's special ids."""
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return config_cls(text_config={**text_config, **ids}, **config, **ids)


def _gemma3():
    images = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    tok = _tokenizer(images, dict(zip(("boi_token", "image_token", "eoi_token"), images, strict=True)))
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
        tokenizer=tok,
        chat_template=TEMPLATE.replace("IMAGE", "<start_of_image>"),
        image_seq_length=4,
    )
    config = _ids(
        tok,
        Gemma3Config,
        text_config=dict(vocab_size=len(tok), head_dim=8, sliding_window=16, layer_types=LAYERS, **TEXT),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        image_token_id=tok.image_token_id,
        boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.eoi_token_id,
    )
    return processor, config, Gemma3ForConditionalGeneration, len(images)


class _Qwen2VLImageProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor (which needs torchvision)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def _qwen2_vl():
    images = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    tok = _tokenizer(images, {"image_token": "<|image_pad|>"})
    processor = _Qwen2VLImageProcessor(
        image_processor=Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56),  # a 4 × 4 patch grid
        tokenizer=tok,
        chat_template=TEMPLATE.replace("IMAGE", "".join(images)),
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    config = _ids(
        tok,
        Qwen2VLConfig,
        text_config=dict(vocab_size=len(tok), max_position_embeddings=256, rope_parameters=rope, **TEXT),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    return processor, config, Qwen2VLForConditionalGeneration, len(images)


VLMS = {"gemma3": _gemma3, "qwen2_vl": _qwen2_vl}


def make_vlm(name: str):
    """`(processor, make_model, image_specials)` of the tiny VLM `name` (a key of `VLMS`); `make_model()` gives the
    same random model at every call."""
    processor, config, model_cls, image_specials = VLMS[name]()

    def make_model():
        torch.manual_seed(0)
        model = model_cls(copy.deepcopy(config))  # TRL writes the pad id into the config it is given
        with torch.no_grad():  # Gemma 3 starts its projector at 0, which would leave the vision tower without gradient
            for param in model.parameters():
                if param.dim() > 1 and not param.any():
                    param.normal_(std=0.2)
        for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
            setattr(model.generation_config, key, getattr(processor.tokenizer, key))
        return model

    return processor, make_model, image_specials


def make_dataset(n: int = 16) -> Dataset:
    """Conversational prompts of equal length, each with its own random 56 × 56 image."""
    images = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        pixels = torch.randint(0, 256, (56, 56, 3), generator=g, dtype=torch.uint8)
        images.append(Image.fromarray(pixels.numpy()))
    prompts = [[{"role": "user", "content": f"Q{i:02d}: what color?"}] for i in range(n)]
    return Dataset.from_dict({"prompt": prompts, "image": images})


def _text(completion) -> str:
    return completion[0]["content"]


def reward_length(completions, **kwargs):
    return [len(_text(c)) / 8.0 for c in completions]


def reward_checksum(completions, **kwargs):
    return [float(zlib.crc32(_text(c).encode()) % 3) for c in completions]


def make_trainer(trainer_cls, args, processor, make_model, image_specials: int, **kwargs):
    """`trainer_cls` (TRL's `GRPOTrainer` or `RLLossGRPOTrainer`) on a fresh model and the image dataset, with fixed
    completions."""
    trainer = trainer_cls(
        make_model(),
        [reward_length, reward_checksum],
        args=args,
        train_dataset=make_dataset(),
        processing_class=processor,
        **kwargs,
    )
    patch_generation(trainer, processor, image_specials)
    return trainer


def patch_generation(trainer, processor, image_specials: int) -> None:
    """Fixed completions (a function of the prompt only, see `FixedCompletions`) that never hold an image token."""
    completions = FixedCompletions(processor.tokenizer, trainer.max_completion_length)
    completions.low = 3 + image_specials  # after <pad>, <eos>, <bos> and the image tokens
    trainer._generate_single_turn = completions


def vision_tower(model) -> torch.nn.Module:
    return model.base_model.vision_tower if hasattr(model.base_model, "vision_tower") else model.base_model.visual
