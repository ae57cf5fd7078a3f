"""Parity with stock TRL 1.16 `GRPOTrainer` for the TRL GRPO options the loss layer maps (issue 12).

Each test trains stock `GRPOTrainer` (`GRPOConfig`) and `RLLossGRPOTrainer` (`RLLossGRPOConfig`) with the same TRL
options, the same tiny model, seed and completions (`FixedCompletions`: a function of the prompt only), and compares
the parameters after 3 optimizer steps. SGD keeps float round-off from being amplified. `num_iterations=2` makes the
second step off-policy (old log-probs differ from the current ones), so ratio-dependent terms are exercised.

Where our normalization (global over the optimizer step) and TRL's (per micro-batch, or by the generation batch's
token count) could differ, the layout is TRL's parity layout (`steps_per_generation == gradient_accumulation_steps`),
except in the uneven-layout test, which uses a sequence-normalized loss (`grpo`), equal in both for any layout.
"""

from __future__ import annotations

import pytest
import torch
from _trainer_utils import (
    BASE_ARGS,
    compare_with_trl,
    make_model,
    make_tokenizer,
    tiny_config,
    train_fixed,
    with_generation_ids,
)
from trl import GRPOTrainer

from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer

torch.set_num_threads(1)

TOLERANCE = 1e-6
# No gradient clipping: a clipped update keeps only the gradient's direction, which hides a wrong overall scale (e.g.
# a denominator off by 8/7 passed at 7e-9 with max_grad_norm=1).
COMMON = dict(
    max_steps=3, gradient_accumulation_steps=2, num_iterations=2, optim="sgd", learning_rate=0.05, max_grad_norm=0.0
)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _parity(tok, tmp_path, model=None, trainer_kwargs=None, **options):
    """Train stock TRL and RLLossGRPOTrainer with the same options (on top of `COMMON`); return our trainer's step
    logs and the largest parameter difference. `model` makes a fresh model (or returns a path) for each run."""
    return compare_with_trl(tok, tmp_path, {**COMMON, **options}, model, trainer_kwargs)


def _saved_model(tok, tmp_path):
    """A model saved to disk: stock TRL with beta > 0 loads its reference from the policy's path."""
    path = tmp_path / "model"
    make_model(tok).save_pretrained(path)
    return lambda: str(path)


# ------------------------------------------------------------------------------------------------------------------
# The sequence-normalized loss types mapped before issue 12 (dapo: test_trainer.py::test_parity_with_trl_dapo)


@pytest.mark.parametrize("loss_type", ["dr_grpo", "luspo", "sapo"])
def test_sequence_normalized_loss_types(tok, tmp_path, loss_type):
    _, _, diff = _parity(tok, tmp_path, loss_type=loss_type)
    assert diff < TOLERANCE, diff


# ------------------------------------------------------------------------------------------------------------------
# mask_truncated_completions: a truncated completion's mask is all zero, yet TRL's sequence-mean losses count its row


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "luspo", "sapo"])
def test_mask_truncated_completions(tok, tmp_path, loss_type):
    # No gradient clipping: clipping to norm 1 rescales the update and would hide a wrong sequence count S.
    options = dict(loss_type=loss_type, mask_truncated_completions=True, max_grad_norm=0.0)
    trainer, logs, diff = _parity(tok, tmp_path, **options)
    assert diff < TOLERANCE, diff
    assert trainer.rl_loss_config.count_empty_sequences  # the mapping counts the masked rows, as TRL
    # FixedCompletions truncates some completions (no EOS at max_completion_length): TRL masks them out whole.
    assert any(log.get("completions/clipped_ratio", 0.0) > 0.0 for log in logs)
    # The same loss with the masked rows left out of S (today's layer default) is a different update.
    rl_loss = {**trainer.rl_loss_config.to_dict(), "count_empty_sequences": False}
    trl_options = {**BASE_ARGS, **COMMON, **options}
    del trl_options["loss_type"]  # rl_loss is set: TRL's loss options stay at their defaults
    _, _, off = train_fixed(tok, RLLossGRPOConfig(output_dir=str(tmp_path / "off"), rl_loss=rl_loss, **trl_options))
    ours = {name: p.detach() for name, p in trainer.model.named_parameters() if p.requires_grad}
    off_diff = max((ours[k] - off[k]).abs().max().item() for k in off)
    assert off_diff > 1e-4, off_diff  # so |TRL − off| > 1e-4 − 1e-6: without the field there is no parity


# ------------------------------------------------------------------------------------------------------------------
# Item 3: off-policy sequence mask, the two-sided delta clip, VESPO


def test_off_policy_sequence_mask(tok, tmp_path):
    trainer, logs, diff = _parity(tok, tmp_path, loss_type="dapo", off_policy_mask_threshold=0.01)
    assert diff < TOLERANCE, diff
    assert trainer.rl_loss_config.off_policy_mask_threshold == 0.01
    assert logs[0]["train_policy/opsm_masked_frac"] == 0.0  # on-policy: nothing to drop
    assert 0.0 < logs[1]["train_policy/opsm_masked_frac"] < 1.0  # off-policy: some negative-advantage sequences


def test_delta_two_sided_clip(tok, tmp_path):
    trainer, logs, diff = _parity(tok, tmp_path, loss_type="dapo", delta=1.02)
    assert diff < TOLERANCE, diff
    assert trainer.rl_loss_config.policy_loss_cfg.delta == 1.02
    assert logs[1]["train_policy/ratio_max"] > 1.02  # the clip min(r, delta) is active on some tokens


def test_vespo(tok, tmp_path):
    options = dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.5)
    trainer, logs, diff = _parity(tok, tmp_path, loss_type="vespo", **options)
    pcfg = trainer.rl_loss_config.policy_loss_cfg
    assert pcfg.loss_type == "vespo" and (pcfg.vespo_k_pos, pcfg.vespo_lambda_neg) == (1.5, 1.5)
    assert diff < TOLERANCE, diff
    assert logs[1]["train_policy/ratio_abs_dev_mean"] > 1e-3  # off-policy: the gamma weight is not 1


# ------------------------------------------------------------------------------------------------------------------
# Item 4: CISPO with TRL's epsilon_high (absolute cap), token and sequence level


@pytest.mark.parametrize(
    "epsilon_high,level,loss",
    [(0.5, "token", "cispo"), (1.02, "token", "cispo"), (1.02, "sequence", "cispo_seq")],
)
def test_cispo(tok, tmp_path, caplog, epsilon_high, level, loss):
    trainer, logs, diff = _parity(
        tok, tmp_path, loss_type="cispo", epsilon_high=epsilon_high, importance_sampling_level=level
    )
    pcfg = trainer.rl_loss_config.policy_loss_cfg
    assert pcfg.loss_type == loss and pcfg.cliprange_low == 1.0
    assert diff < TOLERANCE, diff
    if epsilon_high < 1:
        assert "absolute cap" in caplog.text
        assert logs[0]["train_policy/clip_frac_high"] == 1.0  # every on-policy weight 1 is capped at 0.5
    elif level == "token":
        assert logs[1]["train_policy/clip_frac_high"] > 0.0


def test_sapo_sequence_level(tok, tmp_path):
    trainer, logs, diff = _parity(tok, tmp_path, loss_type="sapo", importance_sampling_level="sequence")
    assert diff < TOLERANCE, diff
    assert trainer.rl_loss_config.policy_loss_cfg.loss_type == "sapo_seq"
    assert logs[1]["train_policy/ratio_abs_dev_mean"] > 1e-3  # off-policy: s_i ≠ 1


# ------------------------------------------------------------------------------------------------------------------
# Item 8: the KL term weighted by the policy ratio (use_bias_correction_kl)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl(tok, tmp_path, level):
    trainer, logs, diff = _parity(
        tok,
        tmp_path,
        model=_saved_model(tok, tmp_path),
        loss_type="dapo",
        beta=0.1,
        use_bias_correction_kl=True,
        importance_sampling_level=level,
    )
    assert diff < TOLERANCE, diff
    assert trainer.rl_loss_config.kl_bias_correction == level
    assert logs[1]["train_policy/ref_kl"] > 0  # the KL and its ratio-weighted gradient are non-trivial


# ------------------------------------------------------------------------------------------------------------------
# Item 9: an optimizer step spanning two generation batches


def test_uneven_layout_step_spans_two_generations(tok, tmp_path):
    # 4 × 2 = 8 micro-steps per generation, 3 per optimizer step: step 3 takes micro-steps 6, 7 (generation 1) and
    # 8 (generation 2), normalized as two groups weighted 2/3 and 1/3. `grpo` normalizes per sequence, and every
    # micro-batch holds the same number of sequences, so this equals TRL's per-micro-batch normalization exactly.
    trainer, logs, diff = _parity(
        tok, tmp_path, loss_type="grpo", steps_per_generation=4, gradient_accumulation_steps=3, num_iterations=2
    )
    assert diff < TOLERANCE, diff
    assert trainer._step == 9 and trainer._rl_step_remaining == 0


# ------------------------------------------------------------------------------------------------------------------
# Item 10: an LM head trained through PEFT (modules_to_save), KL to the adapter-disabled reference


def test_peft_modules_to_save_head(tok, tmp_path):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    trainer, logs, diff = _parity(
        tok,
        tmp_path,
        model=lambda: make_model(tok, tie=False),
        trainer_kwargs={"peft_config": peft_config},
        loss_type="dapo",
        beta=0.1,
    )
    assert diff < TOLERANCE, diff
    head = trainer.model.get_output_embeddings()
    assert type(head).__name__ == "ModulesToSaveWrapper"
    trained = head.modules_to_save["default"].weight
    assert not torch.equal(trained, head.original_module.weight)  # the head copy trained, the original did not
    assert logs[1]["train_policy/ref_kl"] > 0  # the reference (adapter and head copy disabled) is the base model


# ------------------------------------------------------------------------------------------------------------------
# Item 5: the MoE router load-balancing loss (a tiny Qwen3-MoE)


def _tiny_moe(tok, family: str):
    """A tiny Qwen3-MoE (experts in every layer) or GPT-OSS (experts, attention sinks, sliding-window layers)."""
    from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = tiny_config(tok, head_dim=8, num_experts_per_tok=2, tie_word_embeddings=False, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4, **common)
        )
    else:
        model = GptOssForCausalLM(GptOssConfig(intermediate_size=32, num_local_experts=4, sliding_window=8, **common))
    return with_generation_ids(model, tok)


@pytest.mark.slow  # the MoE experts run slowly on CPU
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_router_aux_loss(tok, tmp_path, family):
    # 2 steps (the second off-policy) keep the slow MoE runs short
    trainer, logs, diff = _parity(tok, tmp_path, model=lambda: _tiny_moe(tok, family), loss_type="dapo", max_steps=2)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.1  # the model config's coefficient
    assert diff < TOLERANCE, diff
    for log in logs:
        assert log["aux_loss"] > 0 and log["loss/router_aux"] > 0
        # TRL's `aux_loss` is the mean of the micro-batches' losses; coef × aux / GA summed over the 2 micro-batches
        assert log["loss/router_aux"] == pytest.approx(0.1 * log["aux_loss"], rel=1e-5)


@pytest.mark.parametrize("sequence_level", [False, True])
def test_vespo_folds_trls_vllm_is_ratio_as_trl(sequence_level):
    """TRL's vLLM IS ratio (token `(B, T)` or sequence `(B, 1)`, TRL's default `sequence_mask`) enters VESPO's
    sequence weight, not the loss: `build_loss_data` + the loss layer equal TRL's own `get_gamma_weights` loss."""
    from types import SimpleNamespace

    from hf_rlloss import GRPOLossConfig, GRPOLossContext

    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    old = -torch.rand(3, 4) - 0.5
    lp = (old + 0.3 * torch.randn(3, 4)).double().requires_grad_(True)
    advantages = torch.tensor([1.0, -0.5, -1.0])
    # TRL's ratio is exp((old − sampling)·mask): 1 at padding; 0 where a mask mode rejected
    ratio = (
        torch.tensor([[1.5], [0.0], [0.7]]) if sequence_level else torch.where(mask == 1, torch.rand(3, 4) + 0.5, 1.0)
    )
    inputs = {
        "completion_ids": torch.randint(0, 5, (3, 4)),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "importance_sampling_ratio": ratio,
    }
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "vespo"})
    data = RLLossGRPOTrainer.build_loss_data(SimpleNamespace(rl_loss_config=cfg), inputs)
    ctx = cfg.build(data)
    GRPOLossContext.build_batches([ctx])
    ours = ctx(logprobs=lp)[0]

    maskd = mask.double()
    phi = GRPOTrainer.get_gamma_weights(advantages[:, None].double(), (lp - old).detach(), maskd, ratio.double())
    trl = (-phi * advantages[:, None] * lp * maskd).sum() / maskd.sum()  # dapo normalization, one micro-batch
    torch.testing.assert_close(ours, trl)
    torch.testing.assert_close(torch.autograd.grad(ours, lp)[0], torch.autograd.grad(trl, lp)[0])


# ------------------------------------------------------------------------------------------------------------------
# Item 6: final-logit softcapping (a tiny Gemma 2)


def _tiny_gemma2(tok, softcap: float):
    """A tiny Gemma 2 (softcapped final logits and attention, sliding-window layers). The small `softcap` puts the
    tiny model's logits in the non-linear part of c·tanh(z/c), so that a missing softcap would break parity."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        **tiny_config(tok, intermediate_size=64, head_dim=8, sliding_window=8, final_logit_softcapping=softcap),
        attn_implementation="eager",
    )
    return with_generation_ids(Gemma2ForCausalLM(config), tok)


@pytest.mark.parametrize("cast_lm_head_to_fp32", [False, True])
def test_gemma2_softcapping(tok, tmp_path, cast_lm_head_to_fp32):
    softcap = 0.2
    model = _tiny_gemma2(tok, softcap)
    with torch.no_grad():
        ids = tok("Q01: add 1+1 =", return_tensors="pt").input_ids
        raw = model.lm_head(model.model(ids).last_hidden_state)
    assert float(raw.abs().max()) > 2 * softcap, "the softcap would be nearly linear: the test would be vacuous"
    trainer, logs, diff = _parity(
        tok,
        tmp_path,
        model=lambda: _tiny_gemma2(tok, softcap),
        loss_type="dapo",
        cast_lm_head_to_fp32=cast_lm_head_to_fp32,
    )
    assert trainer.rl_loss_config.logit_softcapping == softcap  # read from the model config
    assert diff < TOLERANCE, diff


# ------------------------------------------------------------------------------------------------------------------
# Item 1: the entropy bonus (static and adaptive), its gradient from the chunked pass


def test_entropy_bonus_static(tok, tmp_path):
    trainer, logs, diff = _parity(tok, tmp_path, loss_type="dapo", entropy_coef=0.5)
    assert trainer.rl_loss_config.entropy_coef == 0.5
    assert diff < TOLERANCE, diff
    for log in logs:  # the bonus is −coef × the micro-batches' mean entropy: non-trivial, and logged
        assert log["loss/entropy_bonus"] < -1e-2 and log["entropy_coef"] == 0.5


def test_entropy_bonus_adaptive_and_resume(tok, tmp_path):
    # target above the tiny model's entropy: the coefficient grows by delta each step and applies from step 2
    options = dict(
        loss_type="dapo", entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=100.0, entropy_coef_delta=0.2
    )
    trainer, logs, diff = _parity(tok, tmp_path, save_strategy="steps", save_steps=2, **options)
    assert diff < TOLERANCE, diff
    assert [round(log["entropy_coef"], 6) for log in logs] == [0.3, 0.5, 0.7]
    assert "loss/entropy_bonus" not in logs[0] and logs[1]["loss/entropy_bonus"] < -1e-2
    assert trainer.entropy_coef == pytest.approx(0.7)
    # the controller's state is in the checkpoint, and a resumed trainer starts from it
    import json

    state = json.loads((tmp_path / "ours" / "checkpoint-2" / "entropy_ctrl_state.json").read_text())
    assert state["entropy_coef"] == pytest.approx(0.5)
    args = RLLossGRPOConfig(
        output_dir=str(tmp_path / "resumed"),
        **{**BASE_ARGS, **COMMON, **options, "save_strategy": "steps", "save_steps": 2},
    )
    resumed, _, _ = train_fixed(tok, args, resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-2"))
    assert resumed.entropy_coef == pytest.approx(0.7)  # 0.5 restored, + delta at step 3


# ------------------------------------------------------------------------------------------------------------------
# Item 2: the high-entropy token mask (top_entropy_quantile), per micro-batch as TRL


@pytest.mark.parametrize("bonus", ["none", "static", "adaptive"])
def test_top_entropy_quantile(tok, tmp_path, bonus):
    options = {
        "none": {},
        "static": dict(entropy_coef=0.5),
        # the target sits between the kept tokens' entropy and the lower all-token one: the controller moves the
        # coefficient one way if it measures the kept tokens (as TRL), the other way if it measured all tokens
        "adaptive": dict(entropy_coef=0.5, use_adaptive_entropy=True, entropy_coef_delta=0.1),
    }[bonus]
    if bonus == "adaptive":
        probe, _, _ = _parity(tok, tmp_path / "probe", loss_type="dapo", top_entropy_quantile=0.3)
        step = [log for log in probe.state.log_history if "train_policy/entropy_kept" in log][0]
        kept, everything = step["train_policy/entropy_kept"], step["train_policy/entropy"]
        assert kept > everything + 1e-4
        options["entropy_target"] = (kept + everything) / 2
    trainer, logs, diff = _parity(tok, tmp_path, loss_type="dapo", top_entropy_quantile=0.3, **options)
    assert trainer.rl_loss_config.top_entropy_quantile == 0.3
    assert diff < TOLERANCE, diff
    assert all(0 < log["train_policy/entropy_kept"] for log in logs)
    if bonus == "adaptive":
        target, coef = options["entropy_target"], 0.5
        for log in logs:
            coef = min(coef + 0.1, 1.0) if log["train_policy/entropy_kept"] <= target else max(coef - 0.1, 0.0)
            assert log["entropy_coef"] == pytest.approx(coef)
        kept_side = [log["train_policy/entropy_kept"] > target for log in logs]
        assert kept_side != [log["train_policy/entropy"] > target for log in logs]  # the two measures disagree
