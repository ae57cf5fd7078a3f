"""Tool-calling and environment rollouts through TRL's `tools=` / `environment_factory` path, end to end (issue 25).

TRL's own tool tests need Qwen's real tokenizer. Here the tokenizer is the byte-level test tokenizer with Qwen's two
turn markers added as special tokens (`<|im_end|>` the EOS), a compact Qwen-style chat template that renders tool
calls and tool results (prefix-preserving, as TRL's multi-turn training needs; TRL's copy of the Qwen3 template works
too, but its tool prompt is about 750 byte tokens) and TRL's Qwen3 response parser
(`trl.chat_template_utils.qwen3_template`), which reads `<tool_call>` blocks: everything is in memory.

Generation is scripted (`ScriptedToolRollout` replaces `_generate_single_turn`): half of each group calls
`multiply` with the prompt's numbers, TRL runs the tool, appends its result (masked by TRL's `tool_mask`) and
generates again; the scripted model then answers with the tool's result. The other half answers at once (wrongly).
"""

from __future__ import annotations

import math

import pytest
import torch
from _tools import (
    MultiplyEnvironment,
    ScriptedToolRollout,
    dataset,
    multiply,
    reward_correct,
    tool_model,
    tool_tokenizer,
)
from _trainer_utils import BASE_ARGS, trainable_snapshot
from trl import GRPOConfig, GRPOTrainer

from hf_rlloss import GRPOLossConfig
from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer

torch.set_num_threads(1)

TOLERANCE = 1e-6
OPTIONS = dict(
    max_steps=2,
    gradient_accumulation_steps=2,
    num_iterations=2,
    optim="sgd",
    learning_rate=0.05,
    max_grad_norm=0.0,
    max_completion_length=160,
    max_tool_calling_iterations=2,
)


@pytest.fixture(scope="module")
def tok():
    return tool_tokenizer()


def _train(tok, tmp_path, name, trainer_cls=RLLossGRPOTrainer, environment=False, **options):
    """Train on the scripted tool rollouts; return the trainer and its trainable parameters before and after."""
    stock = trainer_cls is GRPOTrainer
    config_cls = GRPOConfig if stock else RLLossGRPOConfig
    args = config_cls(output_dir=str(tmp_path / name), **{**BASE_ARGS, **OPTIONS, **options})
    tools = {"environment_factory": MultiplyEnvironment} if environment else {"tools": [multiply]}
    trainer = trainer_cls(
        tool_model(tok), reward_correct, args=args, train_dataset=dataset(), processing_class=tok, **tools
    )
    trainer._generate_single_turn = ScriptedToolRollout(tok)
    before = trainable_snapshot(trainer.model)
    trainer.train()
    return trainer, before, trainable_snapshot(trainer.model)


def _step_logs(trainer):
    return [h for h in trainer.state.log_history if "train_runtime" not in h]


@pytest.mark.parametrize("environment", [False, True], ids=["tools", "environment_factory"])
def test_same_update_as_trl(tok, tmp_path, environment):
    """Multi-turn tool rollouts: the same update as stock TRL (1e-6), TRL's keys logged alike, tool results masked."""
    from test_trl_metric_names import _compare

    stock, before, trl_after = _train(tok, tmp_path, "trl", GRPOTrainer, environment)
    ours, our_before, our_after = _train(tok, tmp_path, "ours", environment=environment)
    assert all(torch.equal(before[k], our_before[k]) for k in before)
    assert max((trl_after[k] - before[k]).abs().max().item() for k in before) > 1e-3  # not vacuous
    diff = max((trl_after[k] - our_after[k]).abs().max().item() for k in before)
    assert diff < TOLERANCE, diff
    checked = _compare(_step_logs(stock), _step_logs(ours))
    assert {"tools/call_frequency", "tools/failure_frequency", "entropy", "clip_ratio/region_mean"} <= checked
    assert _step_logs(ours)[0]["tools/call_frequency"] == 0.5 and _step_logs(ours)[0]["tools/failure_frequency"] == 0
    batches = ours._buffered_inputs
    tool_results = sum(int(((b["completion_mask"] == 1) & (b["tool_mask"] == 0)).sum()) for b in batches)
    assert tool_results > 0, "no tool-result token in the batch"
    if environment:
        assert sum(env.calls for env in ours.environments) == len(ours.environments) // 2


def _tool_batch(tok, tmp_path):
    """One micro-batch of a trained run's tool rollouts (with TRL's `tool_mask`)."""
    trainer, _, _ = _train(tok, tmp_path, "batch", max_steps=1, num_iterations=1, gradient_accumulation_steps=1)
    batch = trainer._buffered_inputs[0]
    assert "tool_mask" in batch
    return trainer, batch


def _data(trainer, batch, seed: int, garbage: bool):
    """The trainer's loss data of `batch`, with old, rollout and reference log-probs; with `garbage`, nonsense values
    (and NaN) at the tool-result and padding positions, which must change nothing."""
    data = trainer.build_loss_data(batch)
    g = torch.Generator().manual_seed(seed)
    shape = data["shifted_labels"].shape
    for name, scale in (("old_logprobs", 0.05), ("rollout_logprobs", 0.1), ("ref_logprobs", 0.1)):
        data[name] = -5.5 + scale * torch.randn(shape, generator=g)
    if garbage:
        outside = data["shifted_labels"] == -100
        for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
            data[name] = torch.where(outside, torch.full(shape, float("nan")), data[name])
    return data


def _loss(cfg: GRPOLossConfig, data, hidden, weight):
    ctx = cfg.build(data)
    ctx.compute_rollout_is()
    type(ctx).build_batches([ctx])
    return ctx(hidden_states=hidden, head_weight=weight)


def test_tool_results_carry_no_loss_gradient_or_metric(tok, tmp_path):
    """Tool-result tokens: no label, no gradient, and nothing of theirs reaches any metric (IS, mismatch, entropy,
    clip fractions, KL): garbage at those positions (log-probs NaN, other hidden states) changes nothing."""
    trainer, batch = _tool_batch(tok, tmp_path)
    tool_result = (batch["completion_mask"] == 1) & (batch["tool_mask"] == 0)
    data = _data(trainer, batch, 0, garbage=False)
    assert (data["shifted_labels"][tool_result] == -100).all()
    cfg = GRPOLossConfig(
        policy_loss_cfg={"loss_type": "vanilla", "cliprange_low": 0.02, "cliprange_high": 0.02},
        loss_agg_mode="token-mean",
        use_kl_loss=True,
        kl_loss_type="k3",
        kl_loss_coef=0.1,
        rollout_is={"level": "token", "upper": 1.05, "mode": "both", "mask_lower": 0.9, "mask_upper": 1.2},
    )
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(len(tok), 32, generator=g)
    hidden = torch.randn(*data["shifted_labels"].shape, 32, generator=g).requires_grad_()
    loss, metrics = _loss(cfg, data, hidden, weight)
    loss.backward()
    assert hidden.grad[tool_result].abs().max() == 0
    has_grad = hidden.grad.abs().sum(-1) > 0
    assert has_grad.any() and not (has_grad & (data["shifted_labels"] == -100)).any()  # model tokens only
    other = torch.where(tool_result.unsqueeze(-1), 100 * torch.randn(hidden.shape, generator=g), hidden.detach())
    loss2, metrics2 = _loss(cfg, _data(trainer, batch, 0, garbage=True), other, weight)
    assert math.isclose(float(loss2), float(loss), rel_tol=1e-6)
    assert metrics.keys() == metrics2.keys()
    for key in metrics:
        assert torch.allclose(torch.as_tensor(metrics2[key]), torch.as_tensor(metrics[key]), equal_nan=True), key
    # the metrics are over the model's tokens only, and not vacuous
    model_tokens = float((batch["completion_mask"] * batch["tool_mask"]).sum())
    assert float(metrics["rollout_is_acc/mask_tokens"]) == model_tokens
    assert float(metrics["train_policy/valid_tokens"] + metrics["rollout_is_acc/rejected_tokens"]) == model_tokens
    assert float(metrics["train_policy/clip_low_count"] + metrics["train_policy/clip_high_count"]) > 0
    assert float(metrics["rollout_is_acc/masked_tokens"]) > 0


def test_multi_turn_completion_is_one_sequence(tok, tmp_path):
    """GSPO's ratio, sequence-level IS and seq-mean aggregation see each row's turns (both sides of the tool result)
    as one sequence: closed forms over the row's model tokens."""
    trainer, batch = _tool_batch(tok, tmp_path)
    data = _data(trainer, batch, 0, garbage=False)
    labels = data["shifted_labels"]
    model_tokens = labels != -100
    multi_turn = ((batch["tool_mask"] == 0) & (batch["completion_mask"] == 1)).any(1)
    assert multi_turn.any() and (~multi_turn).any()
    n = model_tokens.sum(1).double()
    advantages = data["advantages"].double()
    g = torch.Generator().manual_seed(2)
    logprobs = (data["old_logprobs"] + 0.01 * torch.randn(labels.shape, generator=g)).double()
    log_r = torch.where(model_tokens, logprobs - data["old_logprobs"].double(), 0.0)

    # GSPO (seq-mean-token-mean): ℓ_i = max(−A_i s_i, −A_i clip(s_i)), s_i = exp(mean over the row's model tokens)
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "gspo", "cliprange_low": 3e-3, "cliprange_high": 4e-3})
    ctx = cfg.build(data)
    type(ctx).build_batches([ctx])
    loss, metrics = ctx(logprobs=logprobs.float())
    s = (log_r.sum(1) / n).exp()
    expected = torch.maximum(-advantages * s, -advantages * s.clamp(1 - 3e-3, 1 + 4e-3)).mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    assert float(metrics["trl/units"]) == labels.shape[0]  # TRL's sequence-level clip ratios: one per row

    # seq-mean-token-mean of the vanilla loss: each row's mean over all its model tokens, then the mean over rows
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "gpg"}, loss_agg_mode="seq-mean-token-mean")
    ctx = cfg.build(data)
    type(ctx).build_batches([ctx])
    loss, _ = ctx(logprobs=logprobs.float())
    per_row = torch.where(model_tokens, -advantages[:, None] * logprobs, 0.0).sum(1) / n
    assert float(loss) == pytest.approx(float(per_row.mean()), rel=1e-5, abs=1e-6)

    # sequence-level rollout IS: s_i = exp(Σ over the row's model tokens of log π_old − log μ)
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "gpg"}, rollout_is={"level": "sequence", "upper": 10.0})
    ctx = cfg.build(data)
    is_metrics = ctx.compute_rollout_is()
    delta = torch.where(model_tokens, data["old_logprobs"].double() - data["rollout_logprobs"].double(), 0.0)
    seq_rho = delta.sum(1).exp()
    assert float(is_metrics["rollout_is_acc/seq_weight_sum"]) == pytest.approx(float(seq_rho.sum()), rel=1e-5)
    assert float(is_metrics["rollout_is_acc/sequences"]) == labels.shape[0]


@pytest.mark.parametrize("packing", ["padding_free", "off"])
def test_every_packing_mode_makes_trls_update(tok, tmp_path, packing):
    """The default test above packs with `shared_prefix` (turns sharing a prompt forwarded once); the other modes give
    TRL's update too."""
    _, before, trl_after = _train(tok, tmp_path, "trl", GRPOTrainer)
    _, _, our_after = _train(tok, tmp_path, "ours", packing=packing)
    assert max((trl_after[k] - before[k]).abs().max().item() for k in before) > 1e-3
    assert max((trl_after[k] - our_after[k]).abs().max().item() for k in before) < TOLERANCE


def reward_constant_for_some(completions, product, **kwargs):
    """`reward_correct`, except one constant reward for the prompts whose product is 12 (no signal in that group)."""
    correct = reward_correct(completions, product)
    return [0.5 if p == 12 else r for r, p in zip(correct, product)]


def test_dynamic_sampling_keeps_multi_turn_groups_whole(tok, tmp_path):
    """Dynamic sampling with tool rollouts: groups without signal are dropped and regenerated; the kept groups'
    tool masks stay aligned with their tokens (each kept row has its reply tokens masked)."""
    args = RLLossGRPOConfig(output_dir=str(tmp_path / "ds"), dynamic_sampling=True,
                            **{**BASE_ARGS, **OPTIONS, "max_steps": 2, "num_iterations": 1})  # fmt: skip
    trainer = RLLossGRPOTrainer(tool_model(tok), reward_constant_for_some, args=args, train_dataset=dataset(),
                                processing_class=tok, tools=[multiply])  # fmt: skip
    trainer._generate_single_turn = ScriptedToolRollout(tok)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "dynamic_sampling/groups_generated" in h]
    assert any(log["dynamic_sampling/groups_generated"] > log["dynamic_sampling/groups_kept"] for log in logs)
    for batch in trainer._buffered_inputs:
        text = [tok.decode(ids[m.bool()]) for ids, m in zip(batch["completion_ids"], batch["completion_mask"])]
        replies = (batch["completion_mask"] == 1) & (batch["tool_mask"] == 0)
        for row, t in enumerate(text):
            assert ("<tool_response>" in t) == bool(replies[row].any())
            if replies[row].any():
                masked = tok.decode(batch["completion_ids"][row][replies[row]])
                assert masked.startswith("<|im_start|>user\n<tool_response>") and "It is" not in masked


def test_routing_replay_from_the_rollout_with_tools_is_refused(tok, tmp_path):
    args = RLLossGRPOConfig(output_dir=str(tmp_path), routing_replay="rollout", **{**BASE_ARGS, **OPTIONS})
    with pytest.raises(ValueError, match="routing_replay='rollout' with tools"):
        RLLossGRPOTrainer(tool_model(tok), reward_correct, args=args, train_dataset=dataset(), processing_class=tok,
                          tools=[multiply])  # fmt: skip
