"""Shared-prompt generation (`hf_rlloss/trainer/common/shared_prefill.py`): each distinct prompt prefilled once, its
cache copied to its rows, gives the completions and recorded log-probs of an ordinary HF `generate` call.

Tolerance of the recorded log-probs: the first sampled token's logits come from a forward of the last prompt token
over a cache computed by a prefill of U rows, instead of one prefill of B rows: the same float32 products summed in
another order (another GEMM blocking). Each dot product of ≤ 128 terms of O(1) values carries a rounding error of at
most ~128·u·|x| with u = 6e-8, about 1e-5 per layer; through 2 layers and a log-softmax over logits of O(10), 1e-4
bounds |Δ log p|. Tokens are compared exactly: greedy and sampled tokens differ only when two logits (or a uniform
draw and a CDF boundary) are within that round-off of each other, which random tiny models never put within 1e-4.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import transformers

from hf_rlloss.trainer.common.rollout_recording import SampledTokenLogprobs, recording_logprobs
from hf_rlloss.trainer.common.shared_prefill import distinct_rows, sharing_prompts
from hf_rlloss.trainer.common.transformers_compat import transformers_at_least

LOGP_TOL = 1e-4  # derived in the module docstring
VOCAB, PAD = 64, 0


def _tiny(family: str) -> torch.nn.Module:
    """A tiny random model of `family` (2 layers, hidden 32), float32, eval mode (no dropout)."""
    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, pad_token_id=PAD, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=64, **common))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(intermediate_size=64, **common))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=64, head_dim=8, **common))
    elif family == "gemma2":  # sliding window shorter than the prompts; softcapping
        config = transformers.Gemma2Config(intermediate_size=64, head_dim=8, sliding_window=4, **common)
        model = transformers.Gemma2ForCausalLM(config)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8, **common
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    elif family == "gpt_oss":  # sliding window, attention sinks, MoE
        config = transformers.GptOssConfig(
            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, head_dim=8, **common
        )
        model = transformers.GptOssForCausalLM(config)
        torch.nn.init.normal_(model.model.layers[0].self_attn.sinks, std=1.0)
    elif family == "gpt2":  # learned absolute positions
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, pad_token_id=PAD, eos_token_id=1,
            bos_token_id=2,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        raise ValueError(family)
    return model.float().eval()


def _batch(lengths=(9, 5, 12), repeats=(3, 3, 2), interleaved=False):
    """Left-padded prompts of different lengths, each repeated (grouped as TRL's sampler does, or interleaved)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    rows = [p for p, r in zip(prompts, repeats, strict=True) for _ in range(r)]
    if interleaved:
        rows = rows[::2] + rows[1::2]
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.full((width - len(r),), PAD), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]).long() for r in rows])
    return ids, mask


def _generate(model, ids, mask, share: bool, **settings):
    """Completions `(B, new)`, recorded log-probs `(B, new)` and the first forward's input shape."""
    shapes = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    recorder = SampledTokenLogprobs()
    recording = recording_logprobs(model, recorder) if settings.get("num_beams", 1) == 1 else contextlib.nullcontext()
    torch.manual_seed(7)
    try:
        with torch.no_grad(), recording, sharing_prompts(model, share):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, **settings)
    finally:
        hook.remove()
    logprobs = recorder.finish(out[:, -1])[0] if recorder.previous is not None else None
    return out[:, ids.size(1) :], logprobs, shapes[0]


FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "qwen3_moe", "gpt_oss", "gpt2"]
SAMPLING = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.1)


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefill_gives_the_ordinary_completions_and_logprobs(family):
    model = _tiny(family)
    ids, mask = _batch()
    for settings in (dict(do_sample=False), SAMPLING):
        tokens, logprobs, first_forward = _generate(model, ids, mask, share=False, **settings)
        shared_tokens, shared_logprobs, shared_first_forward = _generate(model, ids, mask, share=True, **settings)
        assert first_forward == (8, 12)  # the ordinary prefill: every row, every prompt token
        assert shared_first_forward == (3, 11)  # the shared one: 3 distinct prompts, all but their last token
        assert torch.equal(shared_tokens, tokens), settings
        assert (shared_logprobs - logprobs).abs().max() <= LOGP_TOL, settings


def test_rows_of_one_prompt_need_not_be_adjacent():
    # a process's slice of TRL's generation batch may split or reorder groups: rows are matched by content
    model = _tiny("qwen2")
    ids, mask = _batch(interleaved=True)
    tokens, logprobs, _ = _generate(model, ids, mask, share=False, **SAMPLING)
    shared_tokens, shared_logprobs, first_forward = _generate(model, ids, mask, share=True, **SAMPLING)
    assert first_forward == (3, 11)
    assert torch.equal(shared_tokens, tokens)
    assert (shared_logprobs - logprobs).abs().max() <= LOGP_TOL


def test_distinct_rows_in_order_of_appearance():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [5, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    first, inverse = distinct_rows(ids, mask)
    assert first.tolist() == [0, 1, 3]
    assert inverse.tolist() == [0, 1, 0, 2, 1]
    # the same tokens under another mask are another prompt (padding is part of the prompt)
    _, inverse = distinct_rows(ids[[0, 0]], torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert inverse.tolist() == [0, 1]


def test_unshareable_calls_run_as_ordinary_calls_and_say_why(caplog):
    model = _tiny("qwen2")
    ids, mask = _batch()
    logger = transformers.utils.logging.get_logger("hf_rlloss.trainer.common.shared_prefill")
    logger.warning_once.cache_clear()
    with caplog.at_level("WARNING"):
        logger.propagate = True
        beams, _, first_forward = _generate(model, ids, mask, share=True, num_beams=2, do_sample=False)
    assert first_forward == (16, 12)  # generate's own prefill of every beam: nothing was shared
    assert "shared-prompt generation is off" in caplog.text and "beam_search" in caplog.text
    ordinary, _, _ = _generate(model, ids, mask, share=False, num_beams=2, do_sample=False)
    assert torch.equal(beams, ordinary)


def _said(caplog, module: str):
    """Clear transformers' `warning_once` memory and capture the warnings of `hf_rlloss.<module>`."""
    logger = transformers.utils.logging.get_logger(f"hf_rlloss.{module}")
    logger.warning_once.cache_clear()  # one cache for every logger of the process
    logger.propagate = True
    return caplog.at_level("WARNING", logger=logger.name)


def test_one_token_prompts_run_as_ordinary_calls_and_say_why(caplog):
    model = _tiny("qwen2")
    ids, mask = _batch(lengths=(1, 1), repeats=(3, 2))
    with _said(caplog, "trainer.common.shared_prefill"):
        _, _, first_forward = _generate(model, ids, mask, share=True)
    assert first_forward == (5, 1)  # generate's own prefill of every row
    assert "shared-prompt generation is off" in caplog.text and "every prompt is one token long" in caplog.text


def test_positional_calls_run_as_ordinary_calls_and_say_why(caplog):
    model = _tiny("qwen2")
    ids, mask = _batch()
    with _said(caplog, "trainer.common.shared_prefill"), torch.no_grad(), sharing_prompts(model):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, eos_token_id=None)
    assert out.shape == (ids.size(0), ids.size(1) + 2)
    assert "shared-prompt generation is off" in caplog.text and "positional arguments" in caplog.text


@pytest.mark.parametrize("mode", ["rollout", "old_policy"])
def test_trainer_sets_sharing_aside_under_rollout_routing_replay_and_says_so(tmp_path, caplog, mode):
    """`routing_replay="rollout"` records the routers during generate row by row: every row is prefilled, said once
    when the trainer is built; `"old_policy"` records nothing during generation and shares."""
    from _models import tiny_moe
    from _trainer_utils import BASE_ARGS, make_dataset, make_tokenizer, reward_length

    from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer

    tok = make_tokenizer()
    args = RLLossGRPOConfig(output_dir=str(tmp_path), routing_replay=mode, **BASE_ARGS)
    with _said(caplog, "trainer.common.routing_replay"):
        trainer = RLLossGRPOTrainer(
            tiny_moe(tok, "qwen3_moe"), reward_length, args=args, train_dataset=make_dataset(), processing_class=tok
        )
    said = "shared_prompt_generation is set aside: routing_replay='rollout' records the routers" in caplog.text
    assert said == (mode == "rollout")
    prompts = [tok("add 3+4 =")["input_ids"], tok("Q: 12*3 is")["input_ids"]]
    prompt_ids = [p for p in prompts for _ in range(4)]
    width = max(map(len, prompts))
    first_forward = _trainer_generation(trainer, prompt_ids, share=True)[2]
    assert first_forward == ((8, width) if mode == "rollout" else (2, width - 1))


def test_cpu_rollout_worker_sets_sharing_aside_under_rollout_routing_replay_and_says_so(tmp_path, caplog):
    from _async import ASYNC_ARGS
    from _trainer_utils import make_dataset, make_tokenizer, reward_length

    from hf_rlloss.trainer import RLLossAsyncGRPOConfig
    from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker

    tok = make_tokenizer()
    for mode in ("rollout", "old_policy"):
        args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), routing_replay=mode, **ASYNC_ARGS)
        caplog.clear()
        with _said(caplog, "trainer.async_.rollout.hf_generate"):
            HFGenerateRolloutWorker(str(tmp_path / "policy"), make_dataset(4), [reward_length], tok, args)
        said = "shared_prompt_generation is set aside: routing_replay='rollout'" in caplog.text
        assert said == (mode == "rollout"), mode


def test_distinct_prompts_and_disabled_sharing_leave_generate_alone():
    model = _tiny("qwen2")
    ids, mask = _batch(repeats=(1, 1, 1))
    assert _generate(model, ids, mask, share=True)[2] == (3, 12)  # nothing to share
    ids, mask = _batch()
    assert _generate(model, ids, mask, share=False)[2] == (8, 12)
    assert "generate" not in vars(model)  # the wrapper is removed on exit


def _trainer_generation(trainer, prompt_ids, share: bool):
    """TRL's `_generate_single_turn` through the trainer: completions, recorded log-probs, first forward's shape."""
    trainer.args.shared_prompt_generation = share
    trainer._recorded_kept_logmass = []  # set per generation batch by _generate_and_score_completions
    shapes = []
    embeddings = trainer.model.get_input_embeddings()
    hook = embeddings.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    torch.manual_seed(3)
    try:
        completions, logprobs = trainer._generate_single_turn(prompt_ids, None, {}, 4)
    finally:
        hook.remove()
    return completions, logprobs, shapes[0]


def test_trainer_generation_shares_prompts_and_records_the_same_logprobs(tmp_path):
    from _trainer_utils import BASE_ARGS, make_dataset, make_model, make_tokenizer, reward_length

    from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer

    tok = make_tokenizer()
    args = RLLossGRPOConfig(output_dir=str(tmp_path), **{**BASE_ARGS, "max_completion_length": 12}, top_k=20)
    trainer = RLLossGRPOTrainer(
        make_model(tok), reward_length, args=args, train_dataset=make_dataset(), processing_class=tok
    )
    assert args.shared_prompt_generation  # the default
    prompts = [tok("add 3+4 =")["input_ids"], tok("Q: 12*3 is")["input_ids"]]
    prompt_ids = [p for p in prompts for _ in range(4)]  # as TRL's sampler repeats them
    ordinary = _trainer_generation(trainer, prompt_ids, share=False)
    shared = _trainer_generation(trainer, prompt_ids, share=True)
    width = max(map(len, prompts))
    assert ordinary[2] == (8, width) and shared[2] == (2, width - 1)
    assert shared[0] == ordinary[0]
    assert all(len(c) > 0 for c in shared[0])
    for a, b in zip(shared[1], ordinary[1], strict=True):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= LOGP_TOL


def test_config_rejects_a_non_boolean_shared_prompt_generation(tmp_path):
    from hf_rlloss.trainer import RLLossGRPOConfig

    with pytest.raises(ValueError, match="shared_prompt_generation='yes' must be true or false"):
        RLLossGRPOConfig(output_dir=str(tmp_path), use_cpu=True, shared_prompt_generation="yes")


def test_cpu_rollout_worker_shares_prompts(tmp_path):
    # the asynchronous trainer's HF generate worker (`async_cpu.HFGenerateRolloutWorker`), its loop run in-process
    import queue

    from _async import ASYNC_ARGS, save_tiny_policy
    from _trainer_utils import make_dataset, make_tokenizer, reward_length

    from hf_rlloss.trainer import RLLossAsyncGRPOConfig
    from hf_rlloss.trainer.async_.rollout import HFGenerateLoop, HFGenerateRolloutWorker

    policy, tok = save_tiny_policy(tmp_path / "policy"), make_tokenizer()
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **ASYNC_ARGS, top_k=20)
    runs = {}
    for share in (False, True):
        worker = HFGenerateRolloutWorker(policy, make_dataset(4), [reward_length], tok, args,
                                         shared_prompt_generation=share)  # fmt: skip
        loop = HFGenerateLoop(worker._settings, None, queue.Queue(), None, None, None)
        loop.load()
        loop.version = 1
        shapes = []
        embeddings = loop.model.get_input_embeddings()
        embeddings.register_forward_hook(lambda m, a, out, s=shapes: s.append(tuple(a[0].shape)))
        torch.manual_seed(0)
        runs[share] = loop._generate_batch(), shapes[0]
    (ordinary, ordinary_first), (shared, shared_first) = runs[False], runs[True]
    groups = len(ordinary) // args.num_generations
    assert ordinary_first[0] == len(ordinary) and shared_first == (groups, ordinary_first[1] - 1)
    for a, b in zip(shared, ordinary, strict=True):
        assert np.array_equal(a.input_ids, b.input_ids)
        assert np.abs(a.old_log_probs - b.old_log_probs).max() <= LOGP_TOL


# --- decoding into the preallocated cache (`hf_rlloss/trainer/common/preallocated_cache.py`) ---


def test_preallocated_layer_holds_what_a_dynamic_layer_holds():
    # every operation generate and beam search use, against transformers' concatenating layer; copies are exact
    from transformers.cache_utils import DynamicLayer

    from hf_rlloss.trainer.common.preallocated_cache import PreallocatedLayer

    gen = torch.Generator().manual_seed(0)
    kv = lambda n: (torch.randn(3, 2, n, 4, generator=gen), torch.randn(3, 2, n, 5, generator=gen))  # noqa: E731
    prompt = kv(6)
    rows = torch.tensor([0, 0, 2, 1])  # the batch's rows copy these cache rows
    dynamic = DynamicLayer()
    dynamic.update(*prompt)
    dynamic.reorder_cache(rows)
    layer = PreallocatedLayer.holding(*prompt, rows, capacity=9)
    buffer = layer._key_buffer

    def same():
        assert torch.equal(layer.keys, dynamic.keys) and torch.equal(layer.values, dynamic.values)
        assert layer.get_seq_length() == dynamic.get_seq_length()
        assert layer.get_mask_sizes(1) == dynamic.get_mask_sizes(1)

    same()
    for n in (1, 2):  # decoding steps and a 2-token chunk: written in place, the same buffer
        step = kv(n)
        step = (step[0][:1].expand(4, -1, -1, -1), step[1][:1].expand(4, -1, -1, -1))
        out = layer.update(*step)
        assert torch.equal(out[0], dynamic.update(*step)[0]) and layer._key_buffer is buffer
        same()
    dynamic.crop(-2), layer.crop(-2)  # assisted decoding's rollback
    same()
    step = (torch.ones(4, 2, 1, 4), torch.ones(4, 2, 1, 5))
    dynamic.update(*step), layer.update(*step)  # overwrites the cropped positions
    same()
    assert layer._key_buffer is buffer and layer.capacity == 9
    step = (torch.full((4, 2, 4, 4), 2.0), torch.full((4, 2, 4, 5), 2.0))
    dynamic.update(*step), layer.update(*step)  # past the capacity: the buffer grows, nothing is lost
    same()
    assert layer.capacity >= 10 and layer._key_buffer is not buffer
    dynamic.reorder_cache(torch.tensor([3, 1])), layer.reorder_cache(torch.tensor([3, 1]))  # beam search's selection
    dynamic.update(*(t[:2] for t in step)), layer.update(*(t[:2] for t in step))
    same()
    if transformers_at_least("5.18"):  # before, DynamicLayer.reset zeroed what update grows
        dynamic.reset(), layer.reset()
        dynamic.update(*prompt), layer.update(*prompt)
        same()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_decoding_writes_into_one_preallocated_buffer_and_gives_the_ordinary_results(family, monkeypatch):
    # Gemma 2 alternates sliding-window layers (kept as transformers' own) and full-attention layers (preallocated)
    from transformers.cache_utils import DynamicLayer

    from hf_rlloss.trainer.common.preallocated_cache import PreallocatedLayer

    model = _tiny(family)
    ids, mask = _batch()
    new = 10
    # the buffers are sized from either way of giving the length
    length = dict(max_new_tokens=new) if family == "llama" else dict(max_length=ids.size(1) + new)
    writes = {}  # layer -> (buffer address, capacity, filled positions) after each update
    update = PreallocatedLayer.update

    def spy(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        writes.setdefault(id(self), []).append((self._key_buffer.data_ptr(), self.capacity, out[0].shape[-2]))
        return out

    concatenated = []
    dynamic_update = DynamicLayer.update

    def dynamic_spy(self, key_states, *args, **kwargs):
        if key_states.size(0) == ids.size(0):  # the batch's rows: not the shared prefill of the distinct prompts
            concatenated.append(type(self))
        return dynamic_update(self, key_states, *args, **kwargs)

    monkeypatch.setattr(PreallocatedLayer, "update", spy)
    monkeypatch.setattr(DynamicLayer, "update", dynamic_spy)
    runs = {}
    for name, share, preallocate in (("today", False, False), ("concat", True, False), ("prealloc", True, True)):
        writes.clear(), concatenated.clear()
        recorder = SampledTokenLogprobs()
        with torch.no_grad(), recording_logprobs(model, recorder), sharing_prompts(model, share, preallocate):
            out = model.generate(input_ids=ids, attention_mask=mask, eos_token_id=None, **length)
        runs[name] = out[:, ids.size(1) :], recorder.finish(out[:, -1])[0]
        full = [t for t in model.config.layer_types if t == "full_attention"] if family == "gemma2" else [0, 1]
        if name == "prealloc":
            assert len(writes) == len(full)  # every full-attention layer decodes into a preallocated buffer
            for steps in writes.values():
                # the last prompt token, then every generated token but the last, all into one buffer of the
                # call's positions (prompt + completion): no reallocation, no copy of the cache per step
                assert len(steps) == new and len({address for address, _, _ in steps}) == 1
                assert [n for _, _, n in steps] == list(range(ids.size(1), ids.size(1) + new))
                assert {capacity for _, capacity, _ in steps} == {ids.size(1) + new}
        # transformers' concatenating update decodes the full-attention layers of the other runs, none of this one
        # (sliding-window layers have their own update, kept as it is)
        assert len(concatenated) == (0 if name == "prealloc" else new * len(full)), name
    for name in ("concat", "prealloc"):
        assert torch.equal(runs[name][0], runs["today"][0]), name
        assert (runs[name][1] - runs["today"][1]).abs().max() <= LOGP_TOL, name
