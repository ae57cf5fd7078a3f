"""Offline building blocks for trainer tests: a byte tokenizer, a tiny random Qwen2, prompts, rewards, and fixed
completions (deterministic, a function of the prompt only, so runs with different process counts see the same data).
"""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

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


def make_model(tokenizer, seed: int = 0, hidden_size: int = 32, tie: bool = True, layers: int = 2) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def make_dataset(n: int = 16) -> Dataset:
    """Prompts of equal length (no left padding: positions do not depend on how a batch is padded)."""
    return Dataset.from_dict({"prompt": [f"Q{i:02d}: add {i % 7}+{i % 5} =" for i in range(n)]})


def reward_length(completions, **kwargs):
    return [float(len(c)) / 8.0 for c in completions]


def reward_digit(completions, **kwargs):
    return [1.0 if any(ch.isdigit() for ch in c) else 0.0 for c in completions]


class FixedCompletions:
    """Replacement for `GRPOTrainer._generate_single_turn`: completions depend only on the prompt, its occurrence in
    the group and how many times it was seen, never on the rank or the policy."""

    def __init__(self, tokenizer, max_len: int):
        self.eos = tokenizer.eos_token_id
        self.low = len(SPECIALS)
        self.high = len(tokenizer)
        self.max_len = max_len
        self.seen: dict[int, int] = {}

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions = []
        occurrence: dict[int, int] = {}
        for ids in prompt_ids:
            key = zlib.crc32(bytes(str(list(ids)), "utf8"))
            j = occurrence.get(key, 0)
            occurrence[key] = j + 1
            if j == 0:
                self.seen[key] = self.seen.get(key, -1) + 1
            g = torch.Generator().manual_seed(key * 1000 + self.seen[key] * 37 + j)
            length = int(torch.randint(1, self.max_len + 1, (1,), generator=g))
            tokens = torch.randint(self.low, self.high, (length,), generator=g).tolist()
            if length < self.max_len or j % 2 == 0:  # some end with EOS, some are truncated
                tokens = tokens[: self.max_len - 1] + [self.eos]
            completions.append(tokens)
        return completions, None


def patch_generation(trainer, tokenizer) -> None:
    trainer._generate_single_turn = FixedCompletions(tokenizer, trainer.max_completion_length)


BASE_ARGS = dict(
    use_cpu=True,
    bf16=False,
    report_to="none",
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    activation_checkpointing=False,
    logging_steps=1,
    save_strategy="no",
    learning_rate=1e-3,
    disable_tqdm=True,
    seed=0,
    dataloader_num_workers=0,
)


def trainable_snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def finish_distributed() -> None:
    """End a launched worker cleanly: wait for every rank, then destroy the process groups.

    A worker that leaves the interpreter with a live gloo group (e.g. a non-zero rank done while rank 0 still writes
    its results) can abort in the group's destructor ("terminate called without an active exception", SIGABRT), which
    fails the launch although training finished. CI hit this once in `test_fsdp2`'s DDP run.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
