"""Vision-language models (issue 12, item 11): `RLLossGRPOTrainer` trains a VLM with the same update as stock TRL.

Two tiny random VLMs are built in memory with their processors (no Hub access): Gemma 3 (SigLIP tower, one
`pixel_values` row per image, `token_type_ids` for the images' bidirectional attention) and Qwen2-VL (patch-flattened
`pixel_values` with `image_grid_thw`, `mm_token_type_ids`, M-RoPE positions computed by the model). Qwen2-VL's
processor is built without its video processor, which needs torchvision (not installed here). The prompts are
conversational with one generated PIL image each, of equal length (no left padding), as in the text parity tests.
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
from _trainer_utils import BASE_ARGS, FixedCompletions, trainable_snapshot
from datasets import Dataset
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from trl import GRPOConfig, GRPOTrainer

from hf_rlloss.multimodal import MULTIMODAL_FIELDS, SP_REFUSAL, multimodal_inputs
from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer, SampledTokenLogprobs

torch.set_num_threads(1)

TOLERANCE = 1e-6
COMMON = dict(max_steps=3, gradient_accumulation_steps=2, num_iterations=2, optim="sgd", learning_rate=0.05)
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


def _ids(tok, config_cls, **config):
    """The model config with the tokenizer's special ids."""
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return config_cls(**config, **ids)


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


@pytest.fixture(scope="module", params=sorted(VLMS))
def vlm(request):
    """`(name, processor, make_model, image specials)`; `make_model()` gives the same random model every call."""
    processor, config, model_cls, image_specials = VLMS[request.param]()

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

    return request.param, processor, make_model, image_specials


def _dataset(n: int = 16) -> Dataset:
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


def _trainer(vlm, trainer_cls, args, **kwargs):
    _, processor, make_model, image_specials = vlm
    trainer = trainer_cls(
        make_model(),
        [reward_length, reward_checksum],
        args=args,
        train_dataset=_dataset(),
        processing_class=processor,
        **kwargs,
    )
    completions = FixedCompletions(processor.tokenizer, trainer.max_completion_length)
    completions.low = 3 + image_specials  # never an image token in a completion
    trainer._generate_single_turn = completions
    return trainer


def _vision_tower(model) -> torch.nn.Module:
    return model.base_model.vision_tower if hasattr(model.base_model, "vision_tower") else model.base_model.visual


# ------------------------------------------------------------------------------------------------------------------


def test_multimodal_fields_are_trls():
    """The fields passed through are the multimodal keyword arguments of TRL's log-prob forward."""
    assert {"pixel_values", "image_grid_thw", "num_images", "token_type_ids", "mm_token_type_ids"} <= set(
        MULTIMODAL_FIELDS
    )
    assert not {"model", "input_ids", "attention_mask", "compute_aux_loss"} & set(MULTIMODAL_FIELDS)


def test_parity_with_trl(vlm, tmp_path):
    """Stock `GRPOTrainer` and `RLLossGRPOTrainer`, same tiny VLM, seed and completions: the parameters after 3
    optimizer steps (the second off-policy, with old log-probs from the no-grad pass) agree to 1e-6, the vision tower's
    included; and the vision tower ran in every training forward and in the no-grad passes."""
    options = {**BASE_ARGS, **COMMON, "loss_type": "dapo"}
    stock = _trainer(vlm, GRPOTrainer, GRPOConfig(output_dir=str(tmp_path / "trl"), **options))
    ours = _trainer(vlm, RLLossGRPOTrainer, RLLossGRPOConfig(output_dir=str(tmp_path / "ours"), **options))
    calls = {True: 0, False: 0}  # vision-tower forwards with / without gradient

    def count(*_):
        calls[torch.is_grad_enabled()] += 1

    _vision_tower(ours.model).register_forward_hook(count)
    before = trainable_snapshot(ours.model)
    for trainer in (stock, ours):
        trainer.train()
    trl_after, our_after = trainable_snapshot(stock.model), trainable_snapshot(ours.model)
    assert trl_after.keys() == our_after.keys() == before.keys()
    vision = [k for k in before if ".visual." in f".{k}" or "vision_tower" in k]
    assert vision, "no vision-tower parameters found"
    moved = max((our_after[k] - before[k]).abs().max().item() for k in vision)
    assert moved > 1e-4, "the vision tower did not train: the images did not reach the loss forward"
    diff = max((trl_after[k] - our_after[k]).abs().max().item() for k in before)
    assert diff < TOLERANCE, diff
    # 3 steps × 2 micro-batches with gradient; old log-probs of the 2 generation batches, 2 rows chunks each
    assert calls[True] == 6 and calls[False] == 4, calls


def test_no_grad_logps_match_trl(vlm, tmp_path):
    """Old and reference log-probs of a generation batch, scored 3 rows at a time (the images cut by rows), equal
    TRL's fused-head log-probs of the whole batch; without the images they differ (the check is not vacuous)."""
    args = RLLossGRPOConfig(output_dir=str(tmp_path), **BASE_ARGS, max_steps=1, beta=0.1, num_iterations=2)
    trainer = _trainer(vlm, RLLossGRPOTrainer, args)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([trainer.train_dataset[i] for i in range(8)])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    length = batch["completion_ids"].size(1)
    fields = multimodal_inputs(batch)
    with torch.no_grad():
        expected, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, length, **fields
        )
    valid = batch["completion_mask"].bool()
    for name, logps in {
        "old": trainer.compute_per_token_logps(trainer.model, ids, mask, length, 3, multimodal=fields),
        "ref": trainer.compute_ref_per_token_logps(batch),  # the in-memory policy's copy
        "old, from TRL's call": batch["old_per_token_logps"],
        "ref, from the trainer's call": batch["ref_per_token_logps"],
    }.items():
        assert (logps - expected)[valid].abs().max() < 1e-5, name
    blind = trainer.compute_per_token_logps(trainer.model, ids, mask, length, 3)
    assert (blind - expected)[valid].abs().max() > 1e-3


def test_sequence_parallelism_refused(vlm, tmp_path):
    args = RLLossGRPOConfig(output_dir=str(tmp_path), **BASE_ARGS, max_steps=1)
    args.sp_size = 2  # past the config's own multi-process check: the trainer's VLM check comes first
    with pytest.raises(ValueError, match="sequence parallelism .* does not support vision-language models"):
        _trainer(vlm, RLLossGRPOTrainer, args)
    assert "shard" in SP_REFUSAL


@pytest.mark.parametrize("support", ["full", "sampled"])
def test_generate_rollout_logprobs_match_the_trainer_on_left_padded_prompts(vlm, tmp_path, support):
    """Real HF `generate` (sampling) on prompts of different lengths, so every batch is left-padded: the log-probs
    recorded during generation equal the trainer's (from its loss forward) to float32 noise at every step, so the
    trainer sees the images, token types and positions that generation did (M-RoPE positions for Qwen2-VL). TRL
    suppresses the image token in generation: that is a truncation of the support, reported as the kept mass (about
    1 − 1/V for a random model), and compared on the full vocabulary or replayed on the trainer's distribution."""
    _, processor, make_model, _ = vlm
    prompts = [[{"role": "user", "content": "?" * (1 + i % 9)}] for i in range(16)]
    dataset = _dataset().remove_columns("prompt").add_column("prompt", prompts)
    args = RLLossGRPOConfig(
        output_dir=str(tmp_path), **{**BASE_ARGS, "max_steps": 2}, rollout_logprobs_support=support
    )
    trainer = RLLossGRPOTrainer(
        make_model(), [reward_length], args=args, train_dataset=dataset, processing_class=processor
    )
    assert trainer.generation_config.suppress_tokens == [trainer.model.config.image_token_id]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    assert len(logs) == 2
    vocab = len(processor.tokenizer)
    for log in logs:
        assert log["mismatch/mismatch_logprob_abs_diff"] <= 1e-5, log
        assert log["mismatch/mismatch_k3_kl"] <= 1e-8, log
        assert 1 - 3 / vocab < log["mismatch/kept_mass_min"] <= log["mismatch/kept_mass_mean"] < 1 - 1e-4, log


@pytest.mark.parametrize("top_k", [None, 8])
def test_recorder_treats_token_suppression_as_truncation(top_k):
    """Closed form (float64 reference): with a suppressed token (TRL's image token) the sampling distribution is
    unchanged, the recorded log-prob is `log_softmax(z / T)` over the whole vocabulary, and the kept log-mass is that
    of the tokens neither suppressed nor cut by top-k."""
    torch.manual_seed(0)
    vocab, temperature = 30, 0.7

    def processors():  # HF's order: the suppression before the temperature and the truncating warpers
        warpers = [SuppressTokensLogitsProcessor([2, 5]), TemperatureLogitsWarper(temperature)]
        return LogitsProcessorList(warpers + ([TopKLogitsWarper(top_k)] if top_k else []))

    recorder = SampledTokenLogprobs()
    installed = recorder.install(processors())
    assert isinstance(installed[1], type(recorder.before_truncation)), installed
    assert isinstance(installed[2], SuppressTokensLogitsProcessor), installed  # after the temperature
    ids, scores = torch.zeros(3, 1, dtype=torch.long), torch.randn(3, vocab)
    final = installed(ids, scores.clone())
    torch.testing.assert_close(final, processors()(ids, scores.clone()), atol=0, rtol=0)  # same sampling
    token = final.argmax(dim=-1)
    logps, kept_logmass = recorder.finish(token)
    full = torch.log_softmax(scores.double() / temperature, dim=-1)
    expected_kept = torch.logsumexp(full.masked_fill(~torch.isfinite(final), float("-inf")), dim=-1)
    torch.testing.assert_close(logps[:, 0].double(), full.gather(-1, token[:, None])[:, 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(kept_logmass[:, 0].double(), expected_kept, atol=1e-6, rtol=0)
    assert (kept_logmass < -1e-3).all()


def test_recorder_leaves_a_suppression_it_cannot_move():
    """A processor that is not known to commute with the suppression sits between it and the temperature: nothing
    moves (the order of the processors is HF's)."""
    recorder = SampledTokenLogprobs()
    original = [SuppressTokensLogitsProcessor([2]), MinLengthLogitsProcessor(3, 1), TemperatureLogitsWarper(0.7)]
    installed = recorder.install(LogitsProcessorList(original))
    assert list(installed) == [*original, recorder]
