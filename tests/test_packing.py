"""Packed training forwards (`RLLossGRPOConfig.packing`, `hf_rlloss.trainer.common.packing`): the layout in closed
form, the map back to the completion-aligned hidden states, and the same update in every mode.

The trainer tests train the same tiny model on the same completions (`FixedCompletions`: a function of the prompt
only) with `packing="off"`, `"padding_free"` and `"shared_prefix"`, and compare the loss of every step and the
parameters after the last one, to 1e-6 in float32. The prompts have different lengths (left padding inside a
micro-batch) and the completions too (right padding, some truncated). The broader sweep over loss types,
aggregations, KL estimators and rollout-IS settings runs with HF_RLLOSS_FULL_MATRIX=1.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from _tolerance import reordered_sum, step_tokens
from _trainer_utils import (
    BASE_ARGS,
    FixedCompletions,
    FixedWithLogprobs,
    make_model,
    make_tokenizer,
    reward_digit,
    reward_length,
    trainable_snapshot,
)
from datasets import Dataset

from hf_rlloss.parallel.packed_attention import packed_forward, use_packed_attention
from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer
from hf_rlloss.trainer.common.packing import (
    build_layout,
    layout_fallback_reason,
    pack_padding_free,
    pack_shared_prefix,
)

HERE = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(1)

# Parameters (|θ| < 0.25, ulp ≤ 1.5e-8) after 6 SGD updates of lr 0.05 differ by the updates' round-off: the
# gradients' reordered sums (≤ 7.5e-6 relative, see LOSS_TOLERANCE) times lr·|g| ≤ 0.02 per update, ≤ 1e-6 in all.
TOLERANCE = 1e-6
MODES = ("off", "padding_free", "shared_prefix")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


# ------------------------------------------------------------------------------------------------------------------
# The layout, on a hand-made micro-batch

# Two prompts (3 and 2 tokens; the second left-padded), two completions each (right-padded). Rows 2 and 3 start their
# completions with the same token 23, so the trie also shares it... except that TreeRow keys a node on (token, next
# token): 23 is followed by 24 in row 2 and 26 in row 3, so 23 forks, while the prompt token 9 (followed by 23 in
# both) is shared. Prompt A's last token 7 is followed by 20 and 22: it forks too.
PAD = 0
PROMPTS = torch.tensor([[5, 6, 7], [5, 6, 7], [PAD, 8, 9], [PAD, 8, 9]])
COMPLETIONS = torch.tensor([[20, 21, PAD], [22, PAD, PAD], [23, 24, 25], [23, 26, PAD]])


def _batch():
    return PROMPTS, (PROMPTS != PAD).long(), COMPLETIONS, (COMPLETIONS != PAD).long()


def test_shared_prefix_layout_in_closed_form():
    layout = pack_shared_prefix(*_batch())
    # Depth-first: [5 6] [7 20 21] [7 22] | [8 9] [23 24 25] [23 26]
    assert layout.input_ids.tolist() == [[5, 6, 7, 20, 21, 7, 22, 8, 9, 23, 24, 25, 23, 26]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1, 2, 3, 4, 2, 3]]
    assert layout.forwarded_tokens == 14 and layout.padded_tokens == 4 * (3 + 3)
    # Each completion token is predicted from its predecessor's position; 9 (position 8) feeds rows 2 and 3.
    mask = COMPLETIONS != PAD
    assert layout.completion_index[mask].tolist() == [2, 3, 5, 8, 9, 10, 8, 12]
    assert torch.equal(layout.completion_mask, mask)
    kwargs = layout.attention_kwargs
    assert kwargs["tree_cu_seqlens_q"].tolist() == [0, 2, 5, 7, 9, 12, 14]
    # Each segment's path: its ancestors' positions, then its own.
    paths = [[0, 1], [0, 1, 2, 3, 4], [0, 1, 5, 6], [7, 8], [7, 8, 9, 10, 11], [7, 8, 12, 13]]
    assert kwargs["tree_kv_index"].tolist() == sum(paths, [])
    assert (kwargs["tree_max_seqlen_q"], kwargs["tree_max_seqlen_k"]) == (3, 5)


def test_padding_free_layout_in_closed_form():
    layout = pack_padding_free(*_batch())
    assert layout.input_ids.tolist() == [[5, 6, 7, 20, 21, 5, 6, 7, 22, 8, 9, 23, 24, 25, 8, 9, 23, 26]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert layout.forwarded_tokens == 18 and layout.padded_tokens == 24
    assert layout.completion_index[COMPLETIONS != PAD].tolist() == [2, 3, 7, 10, 11, 12, 15, 16]
    kwargs = layout.attention_kwargs
    assert kwargs["tree_cu_seqlens_q"].tolist() == kwargs["tree_cu_seqlens_k"].tolist() == [0, 5, 9, 14, 18]
    assert kwargs["tree_kv_index"].tolist() == list(range(18))  # every sequence is its own chain


def test_rows_without_completion_tokens_are_not_forwarded():
    prompts, prompt_mask, completions, completion_mask = _batch()
    completion_mask = completion_mask.clone()
    completion_mask[1] = 0  # e.g. a truncated completion under mask_truncated_completions
    for build in (pack_shared_prefix, pack_padding_free):
        layout = build(prompts, prompt_mask, completions, completion_mask)
        assert layout.forwarded_tokens == {"shared_prefix": 12, "padding_free": 14}[layout.mode]
        assert not layout.completion_mask[1].any()
    assert layout_fallback_reason(prompt_mask, torch.zeros_like(completion_mask)) is not None
    no_prompt = prompt_mask.clone()
    no_prompt[0] = 0
    assert "no prompt token" in layout_fallback_reason(no_prompt, completion_mask)
    assert build_layout("shared_prefix", prompts, no_prompt, completions, completion_mask) is None  # padded instead
    with pytest.raises(ValueError, match="packing='tree'; expected one of 'shared_prefix', 'padding_free', 'off'"):
        build_layout("tree", *_batch())


def test_a_micro_batch_forwarded_in_another_layout_says_why(caplog):
    """A micro-batch that cannot be packed exactly is forwarded padded (or, under SP, packed padding-free): a
    warning names the reason, once per reason."""
    import types

    from transformers.utils import logging

    from hf_rlloss.trainer.common.forwards import LossLayerForwards

    prompts, prompt_mask, completions, completion_mask = _batch()
    no_prompt = prompt_mask.clone()
    no_prompt[0] = 0
    logging.get_logger("hf_rlloss").warning_once.cache_clear()  # one cache for every logger of the process
    with caplog.at_level("WARNING"):
        assert build_layout("shared_prefix", prompts, no_prompt, completions, completion_mask) is None
    said = "packing='shared_prefix': a row has a completion but no prompt token, so this micro-batch is forwarded"
    assert said in caplog.text
    caplog.clear()
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(packing="shared_prefix"))
    batch = {"prompt_ids": prompts, "prompt_mask": no_prompt, "completion_ids": completions}
    batch["completion_mask"] = completion_mask
    with caplog.at_level("WARNING"):
        layout = LossLayerForwards._sp_layout(trainer, batch)
    assert layout.mode == "padding_free"
    assert "no prompt token, so this micro-batch is packed padding-free under SP" in caplog.text


def test_the_packing_option_is_validated(tmp_path):
    assert RLLossGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).packing == "auto"
    expected = "packing='tree'; expected one of 'auto', 'shared_prefix', 'padding_free', 'off'"
    with pytest.raises(ValueError, match=expected):
        RLLossGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, packing="tree")


def _padded_hidden(model, prompts, prompt_mask, completions, completion_mask):
    """`(B, C, H)`: the hidden states predicting each completion token, from the padded batch (the trainer's `off`)."""
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    hidden = model.model(input_ids=torch.cat([prompts, completions], 1), attention_mask=mask, position_ids=positions)
    return hidden.last_hidden_state[:, -completions.shape[1] - 1 : -1]


def _hidden_tolerance(model, padded: torch.Tensor) -> float:
    """Packed and padded hidden states differ by the float32 reordering of each layer's dot products (other row
    shapes, other BLAS blocking; the longest is the MLP's `intermediate_size` terms), each bounded by 2·γ_{n-1}
    relative to the values' scale, once per layer (tests/_tolerance.py)."""
    config = model.config
    longest = max(config.hidden_size, config.intermediate_size)
    return config.num_hidden_layers * reordered_sum(longest) * padded.abs().max().item()


def _packed_hidden(model, layout, kwargs=None):
    with packed_forward():
        hidden = model.model(
            input_ids=layout.input_ids, position_ids=layout.position_ids, **(kwargs or layout.attention_kwargs)
        ).last_hidden_state
    return layout.completion_hidden(hidden)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_hidden_states_equal_the_padded_ones_and_a_broken_layout_is_caught(attn):
    """Both packings give every completion token the hidden state of the padded batch, in value and gradient; a map
    pointing at a sibling's position, or a path that lets a completion see its sibling, is caught."""
    from _models import tiny_qwen2

    model = tiny_qwen2(vocab=32, attn=attn)
    batch = _batch()
    mask = batch[3].bool()
    padded = _padded_hidden(model, *batch)[mask]
    name = use_packed_attention(model)
    assert name == f"tree_or_{attn}" and model.config._attn_implementation == name
    assert torch.equal(_padded_hidden(model, *batch)[mask], padded)  # ordinary forwards: the native attention
    weights = torch.randn(padded.shape, generator=torch.Generator().manual_seed(0))
    (padded * weights).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.model.named_parameters()}
    for build in (pack_shared_prefix, pack_padding_free):
        layout = build(*batch)
        model.zero_grad()
        packed = _packed_hidden(model, layout)[mask]
        torch.testing.assert_close(packed, padded, rtol=0, atol=_hidden_tolerance(model, padded))
        (packed * weights).sum().backward()  # a shared position's gradient is the sum over the rows that share it
        for n, p in model.model.named_parameters():  # float32 sums in another order: 1e-5 of each gradient's scale
            torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=1e-5 * expected[n].abs().max().item())

    layout = pack_shared_prefix(*batch)
    with torch.no_grad():
        # Broken maps: off by one (each token read from its own position, not its predecessor's), and row 3's first
        # token read from the other prompt's last token. (Rows 0 and 1 read two copies of the forked token 7, which
        # hold the same hidden state: swapping those would change nothing.)
        shifted = layout.completion_index + mask.long()
        swapped = layout.completion_index.clone()
        swapped[3, 0] = swapped[0, 0]
        for index in (shifted, swapped):
            broken = type(layout)(**{**layout.__dict__, "completion_index": index})
            assert not torch.allclose(_packed_hidden(model, broken)[mask], padded, atol=1e-4)
        # A broken mask: row 3's last segment [23 26] also sees row 2's segment [23 24 25].
        kwargs = dict(layout.attention_kwargs)
        kv, cu_k = kwargs["tree_kv_index"], kwargs["tree_cu_seqlens_k"]
        leak = torch.arange(9, 12)
        kwargs["tree_kv_index"] = torch.cat([kv[: int(cu_k[-2])], leak, kv[int(cu_k[-2]) :]])
        kwargs["tree_cu_seqlens_k"] = torch.cat([cu_k[:-1], cu_k[-1:] + len(leak)])
        kwargs["tree_max_seqlen_k"] = int(kwargs["tree_cu_seqlens_k"].diff().max())
        assert not torch.allclose(_packed_hidden(model, layout, kwargs)[mask], padded, atol=1e-4)


def test_attention_sinks_and_sliding_windows_are_packed_exactly():
    """GPT-OSS (attention sinks: one extra logit per head in every softmax; sliding-window layers of 4 tokens, shorter
    than the sequences; eager attention as its native one): the packed hidden states equal the padded ones."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64,
    )  # fmt: skip
    model = GptOssForCausalLM(config).float()
    torch.nn.init.normal_(model.model.layers[0].self_attn.sinks, std=1.0)  # sinks that matter
    batch = _batch()
    mask = batch[3].bool()
    padded = _padded_hidden(model, *batch)[mask]
    assert config._attn_implementation == "eager" and use_packed_attention(model) == "tree_or_eager"
    for build in (pack_shared_prefix, pack_padding_free):
        tolerance = _hidden_tolerance(model, padded)
        torch.testing.assert_close(_packed_hidden(model, build(*batch))[mask], padded, rtol=0, atol=tolerance)


@pytest.mark.parametrize(
    "case,expected",
    [
        ({}, "shared_prefix"),
        ({"_is_vlm": True}, "off"),
        ({"attention_dropout": 0.1}, "off"),
        ({"aux_loss_enabled": True}, "padding_free"),
        ({"sp_mesh": "a mesh"}, "off"),
        ({"packing": "off"}, "off"),
    ],
)
def test_the_trainer_falls_back_where_packing_is_not_exact(case, expected):
    """`_setup_packing` (on a stand-in trainer): vision-language models and attention dropout train padded, a trained
    MoE router loss padding-free (TRL's token means), SP keeps its own packing; each fallback logs its reason."""
    from types import SimpleNamespace

    from _models import tiny_qwen2
    from transformers.testing_utils import CaptureLogger

    from hf_rlloss.trainer import grpo_trainer
    from hf_rlloss.trainer.common.lm_head import causal_lm

    model = tiny_qwen2(attention_dropout=case.get("attention_dropout", 0.0))
    trainer = SimpleNamespace(sp_mesh=None, _is_vlm=False, aux_loss_enabled=False, _causal_lm=causal_lm)
    for key in ("sp_mesh", "_is_vlm", "aux_loss_enabled"):
        setattr(trainer, key, case.get(key, getattr(trainer, key)))
    args = SimpleNamespace(packing=case.get("packing", "shared_prefix"))
    with CaptureLogger(grpo_trainer.logger) as captured:
        RLLossGRPOTrainer._setup_packing(trainer, args, model)
    assert trainer._packing == expected
    assert model.config._attn_implementation == ("sdpa" if expected == "off" else "tree_or_sdpa")
    reasons = {"_is_vlm": "vision-language", "attention_dropout": "attention_dropout=0.1", "aux_loss_enabled": "MoE"}
    for key, reason in reasons.items():
        assert (reason in captured.out) == (key in case), captured.out


# ------------------------------------------------------------------------------------------------------------------
# The same update in every mode


def make_uneven_dataset(n: int = 16) -> Dataset:
    """Prompts of 13 to 26 characters (byte tokens): each micro-batch mixes lengths, so prompts are left-padded."""
    return Dataset.from_dict({"prompt": [f"Q{i:02d}:" + " add" * (i % 4) + f" {i % 7}+{i % 5} =" for i in range(n)]})


COMMON = dict(
    max_steps=3, gradient_accumulation_steps=2, num_iterations=2, optim="sgd", learning_rate=0.05, max_grad_norm=0.0
)
# A step's loss is a float32 sum over its per-token terms, which a packed and a padded forward (other row shapes,
# other BLAS blocking) produce and add in different orders: at most 2·γ_{n-1} of their magnitude apart, n = 64
# tokens, 7.5e-6 (tests/_tolerance.py); relative to the loss above 1 (seq-mean-token-sum reaches 11.7, whose ulp is
# 9.5e-7). A wrong layout moves the loss by whole per-token terms, ≥ 1e-3.
LOSS_TOLERANCE = reordered_sum(step_tokens({**BASE_ARGS, **COMMON}))


def train_mode(tok, tmp_path, mode: str, rollout_logprobs: bool = False, evaluate: bool = False, **options):
    """Train the tiny model with `packing=mode` on fixed completions; the step logs, the parameters after training,
    and (with `evaluate`) the evaluation metrics."""
    options = {**BASE_ARGS, **COMMON, **options}
    if evaluate:
        options.update(per_device_eval_batch_size=4, max_steps=1)
    args = RLLossGRPOConfig(output_dir=str(tmp_path / mode), packing=mode, **options)
    trainer = RLLossGRPOTrainer(
        make_model(tok),
        [reward_length, reward_digit],
        args=args,
        train_dataset=make_uneven_dataset(),
        eval_dataset=make_uneven_dataset(8) if evaluate else None,
        processing_class=tok,
    )
    generator = FixedWithLogprobs if rollout_logprobs else FixedCompletions
    trainer._generate_single_turn = generator(tok, trainer.max_completion_length)
    trainer.train()
    assert trainer._packing == mode
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    metrics = trainer.evaluate() if evaluate else None
    return logs, trainable_snapshot(trainer.model), metrics


def assert_same_update(tok, tmp_path, modes=MODES, **options):
    """Every mode: the same loss at every step and the same parameters, to 1e-6; the forwarded positions shrink."""
    runs = {mode: train_mode(tok, tmp_path, mode, **options) for mode in modes}
    (logs, params, metrics), reference = runs["off"], "off"
    for mode in modes:
        other_logs, other_params, other_metrics = runs[mode]
        assert len(other_logs) == len(logs) > 0
        for a, b in zip(logs, other_logs):
            scale = max(1.0, abs(a["loss/total"]))
            assert abs(a["loss/total"] - b["loss/total"]) < LOSS_TOLERANCE * scale, (mode, a["loss/total"])
            assert a["train_policy/valid_tokens"] == b["train_policy/valid_tokens"]
            assert a["packing/padded_tokens"] == b["packing/padded_tokens"]
            assert b["packing/ratio"] == b["packing/padded_tokens"] / b["packing/forwarded_tokens"]
            if mode != reference:
                assert b["packing/forwarded_tokens"] < a["packing/forwarded_tokens"] == a["packing/padded_tokens"]
        diff = max((params[k] - other_params[k]).abs().max().item() for k in params)
        assert diff < TOLERANCE, (mode, diff)
        if metrics is not None:
            scale = max(1.0, abs(metrics["eval_loss"]))
            assert abs(metrics["eval_loss"] - other_metrics["eval_loss"]) < LOSS_TOLERANCE * scale, mode
    if "shared_prefix" in modes and "padding_free" in modes:
        for a, b in zip(runs["padding_free"][0], runs["shared_prefix"][0]):
            assert b["packing/forwarded_tokens"] < a["packing/forwarded_tokens"]  # prompts forwarded once
    moved = max((params[k] - make_model(tok).state_dict()[k]).abs().max().item() for k in params)
    assert moved > 1e-3, "the parameters hardly moved: the comparison would be vacuous"


@pytest.mark.slow  # 3 trainings
def test_every_mode_gives_the_same_update_grpo_with_kl_and_checkpointing(tok, tmp_path):
    """TRL's default loss (`grpo`: seq-mean-token-mean), the KL to a reference (no-grad reference pass), the second
    step off-policy (`num_iterations=2`: the no-grad old log-prob pass), activation checkpointing (the backward
    recomputes the layers outside the packed forward: the attention must still be the tree one)."""
    rl_loss = {"loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": True, "kl_loss_type": "k3", "kl_loss_coef": 0.1}
    assert_same_update(tok, tmp_path, rl_loss=rl_loss, activation_checkpointing=True)


@pytest.mark.slow  # 5 trainings
def test_every_mode_gives_the_same_update_with_rollout_is_entropy_and_opsm(tok, tmp_path):
    """token-mean, rollout IS on the engine's log-probs (truncated token weights), the entropy bonus with
    `top_entropy_quantile`, the off-policy sequence mask; and the evaluation loss."""
    rl_loss = {
        "policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
        "loss_agg_mode": "token-mean",
        "rollout_is": {"level": "token", "mode": "truncate", "upper": 2.0},
        "entropy_coef": 0.01,
        "top_entropy_quantile": 0.5,
        "off_policy_mask_threshold": 0.5,
    }
    assert_same_update(tok, tmp_path, rollout_logprobs=True, rl_loss=rl_loss)
    modes = ("off", "shared_prefix")
    assert_same_update(tok, tmp_path / "eval", modes, rollout_logprobs=True, evaluate=True, rl_loss=rl_loss)


FULL_MATRIX = pytest.mark.skipif(
    os.environ.get("HF_RLLOSS_FULL_MATRIX") != "1", reason="the broad packing sweep: set HF_RLLOSS_FULL_MATRIX=1"
)
SWEEP = [
    {"policy_loss_cfg": {"loss_type": loss_type}, "loss_agg_mode": agg}
    for loss_type in ("vanilla", "gspo", "cispo", "sapo")
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
] + [
    {"use_kl_loss": True, "kl_loss_type": kl, "kl_loss_coef": 0.1} for kl in ("k1", "k2", "k3", "k3+")
] + [
    {"rollout_is": {"level": level, "mode": mode, "upper": 2.0}}
    for level in ("token", "sequence", "geometric")
    for mode in ("truncate", "mask")
]  # fmt: skip


@pytest.mark.slow
@FULL_MATRIX
@pytest.mark.parametrize("rl_loss", SWEEP, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_sweep_every_mode_gives_the_same_update(tok, tmp_path, rl_loss):
    assert_same_update(tok, tmp_path, rollout_logprobs="rollout_is" in rl_loss, rl_loss=rl_loss)


# ------------------------------------------------------------------------------------------------------------------
# Two processes


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_every_mode_gives_the_same_update(tmp_path):
    """One launch of 2 processes trains `off` and `shared_prefix` (DDP): the same losses and parameters, and the
    packing metrics summed over both ranks."""
    sys.path.insert(0, HERE)
    import _launch

    out = tmp_path / "result.pt"
    cmd = [*_launch.torchrun(2), os.path.join(HERE, "dist_packing_script.py"), "--out", str(out)]
    result = _launch.run(cmd, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = torch.load(out)
    assert runs["world_size"] == 2
    off, packed = runs["off"], runs["shared_prefix"]
    diff = max((off["params"][k] - packed["params"][k]).abs().max().item() for k in off["params"])
    assert diff < TOLERANCE, diff
    assert len(off["history"]) == len(packed["history"]) > 0
    for a, b in zip(off["history"], packed["history"]):
        assert abs(a["loss/total"] - b["loss/total"]) < LOSS_TOLERANCE * max(1.0, abs(a["loss/total"]))
        assert a["packing/forwarded_tokens"] == a["packing/padded_tokens"] == b["packing/padded_tokens"]
        assert b["packing/forwarded_tokens"] < b["packing/padded_tokens"]
        # 2 ranks × 2 micro-batches × 2 sequences of (P + C) positions, P >= 13 bytes, C = 8
        assert a["packing/padded_tokens"] >= 2 * 2 * 2 * (13 + 8)
