"""RLLossGRPOTrainer / RLLossGRPOConfig: end to end on a tiny random Qwen2, offline, on CPU."""

from __future__ import annotations

import math
import os
import sys

import _launch
import pytest
import torch
from _trainer_utils import (
    BASE_ARGS,
    FixedCompletions,
    compare_with_trl,
    make_dataset,
    make_model,
    make_tokenizer,
    patch_generation,
    reward_length,
    train_fixed,
    trainable_snapshot,
)
from trl import GRPOConfig

from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer
from hf_rlloss.trainer.grpo_config import CISPO_NO_LOWER_BOUND, trl_options_to_rl_loss

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _config(tmp_path, **overrides) -> RLLossGRPOConfig:
    return RLLossGRPOConfig(output_dir=str(tmp_path / "out"), **{**BASE_ARGS, **overrides})


def _step_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def _assert_trained(trainer, before, after, extra_keys=()):
    logs = _step_logs(trainer)
    assert len(logs) == trainer.args.max_steps
    for log in logs:
        for key in (
            "loss",
            "loss/total",
            "loss/policy",
            "train_policy/kl1",
            "train_policy/ratio_abs_dev_mean",
            "train_policy/entropy",
            "train_policy/valid_tokens",
            *extra_keys,
        ):
            assert key in log, f"{key} not logged: {sorted(log)}"
            assert math.isfinite(log[key]), (key, log[key])
        assert log["train_policy/valid_tokens"] > 0
        assert abs(log["loss"] - log["loss/total"]) < 1e-5  # Trainer's loss is the step's global loss
    assert "reward" in logs[0] and "rewards/reward_length/mean" in logs[0]  # TRL's metrics, per generation
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert before and not unchanged, f"parameters not updated: {unchanged}"


# ------------------------------------------------------------------------------------------------------------------
# End to end


@pytest.mark.parametrize("loss_type", ["vanilla", "gspo", "cispo", "gpg", "sapo", "geo_mean"])
def test_train_policy_losses(tok, tmp_path, loss_type):
    # num_iterations=2: the second optimizer step re-uses the generation (off-policy, old log-probs used)
    args = _config(
        tmp_path,
        max_steps=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        rl_loss={"policy_loss_cfg": {"loss_type": loss_type}},
    )
    trainer, before, after = train_fixed(tok, args)
    _assert_trained(trainer, before, after)
    second = _step_logs(trainer)[1]
    assert second["train_policy/ratio_abs_dev_mean"] > 0  # the policy moved since the old log-probs


@pytest.mark.parametrize(
    "kl_type,reference",
    [("k1", "copy"), ("k3", "trl_beta"), ("k3+", "path")],
)
def test_train_kl(tok, tmp_path, kl_type, reference):
    model = make_model(tok)
    kwargs = {}
    if reference == "trl_beta":  # TRL's beta is mapped onto rl_loss (k3)
        args = _config(tmp_path, max_steps=2, num_iterations=2, beta=0.1, use_bias_correction_kl=False)
        assert args.rl_loss_config.kl_loss_type == "k3" and args.rl_loss_config.kl_loss_coef == 0.1
    else:
        args = _config(
            tmp_path,
            max_steps=2,
            num_iterations=2,
            rl_loss={"use_kl_loss": True, "kl_loss_type": kl_type, "kl_loss_coef": 0.1},
        )
        if reference == "path":
            ref_dir = tmp_path / "ref"
            model.save_pretrained(ref_dir)
            kwargs["ref_model"] = str(ref_dir)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer, before, after = train_fixed(tok, args, model=model, **kwargs)
    _assert_trained(trainer, before, after, extra_keys=("loss/kl", "train_policy/ref_kl"))
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    ref_state = trainer.ref_model.state_dict()
    assert all(torch.equal(ref_state[k], initial[k]) for k in initial), "the reference must stay the initial policy"
    first, second = _step_logs(trainer)
    assert abs(first["train_policy/ref_kl"]) < 1e-6  # the policy equals the reference before the first update
    assert second["train_policy/ref_kl"] != 0.0


def test_on_policy_first_iteration(tok, tmp_path):
    # GA=2, steps_per_generation=2, num_iterations=2: TRL's condition for old log-probs holds, so they are computed
    # after generation with the same chunked path as the loss; the first iteration is exactly on-policy.
    args = _config(tmp_path, max_steps=2, gradient_accumulation_steps=2, num_iterations=2)
    trainer, _, _ = train_fixed(tok, args)
    first, second = _step_logs(trainer)
    assert first["train_policy/ratio_abs_dev_mean"] < 1e-5
    assert abs(first["train_policy/ratio_max"] - 1) < 1e-5 and abs(first["train_policy/ratio_min"] - 1) < 1e-5
    assert abs(first["train_policy/kl1"]) < 1e-6 and abs(first["train_policy/kl3"]) < 1e-6
    assert second["train_policy/ratio_abs_dev_mean"] > 1e-5


# ------------------------------------------------------------------------------------------------------------------
# Normalization: parity with TRL, invariance to how the step is split


def test_parity_with_trl_dapo(tok, tmp_path):
    """TRL's default `dapo` normalizes by the tokens of the whole generation batch (over ranks and slices); with
    steps_per_generation == gradient_accumulation_steps and on-policy data this equals the step's global token mean,
    i.e. rl_loss token-mean vanilla with the same clip ranges. SGD keeps float round-off from being amplified."""
    common = dict(max_steps=3, gradient_accumulation_steps=2, optim="sgd", learning_rate=0.05, epsilon_high=0.28)
    trainer, logs, diff = compare_with_trl(tok, tmp_path, {**common, "loss_type": "dapo"})
    cfg = trainer.rl_loss_config
    assert cfg.agg_mode == "token-mean" and cfg.policy_loss_cfg.cliprange_high == 0.28
    assert diff < 1e-5, diff
    # Same loss too (TRL's dapo logs the same global token mean).
    assert len(logs) == 3


def test_gradient_accumulation_invariance(tok, tmp_path):
    """One micro-batch of 8 or two of 4: same global token mean, same update."""
    common = dict(max_steps=2, optim="sgd", learning_rate=0.05)
    layouts = [
        dict(per_device_train_batch_size=8, gradient_accumulation_steps=1),
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
    ]
    one, two = (train_fixed(tok, _config(tmp_path, **common, **layout))[2] for layout in layouts)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-6


def _on_one_and_two_processes(tmp_path, batch_sizes: tuple[int, int], *script_args: str) -> tuple[dict, dict]:
    """`dist_trainer_script.py` run with 1 process and with 2 (per-device batches `batch_sizes`); what each saved."""
    script = os.path.join(HERE, "dist_trainer_script.py")
    results = []
    for nproc, batch_size in zip((1, 2), batch_sizes):
        out = tmp_path / f"{nproc}proc.pt"
        cmd = [*_launch.torchrun(nproc), script, "--per-device-batch-size", str(batch_size), *script_args]
        result = _launch.run([*cmd, "--out", str(out)], timeout=300, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        results.append(torch.load(out))
    return results[0], results[1]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    """2 ranks × 2 sequences × GA 2 == 1 rank × 4 sequences × GA 2, off-policy second step (num_iterations=2)."""
    one, two = _on_one_and_two_processes(
        tmp_path, (4, 2), "--steps", "2", "--grad-accum", "2", "--num-iterations", "2"
    )
    assert one["world_size"] == 1 and two["world_size"] == 2
    diff = max((one["params"][k] - two["params"][k]).abs().max().item() for k in one["params"])
    assert diff < 1e-5, diff
    for a, b in zip(one["history"], two["history"]):
        if "loss/total" in a:
            assert a["train_policy/valid_tokens"] == b["train_policy/valid_tokens"]
            assert abs(a["loss/total"] - b["loss/total"]) < 1e-5


# ------------------------------------------------------------------------------------------------------------------
# TRL features


def test_peft_lora_with_kl_and_gradient_checkpointing(tok, tmp_path):
    from peft import LoraConfig

    args = _config(
        tmp_path,
        max_steps=2,
        num_iterations=2,
        activation_checkpointing=True,
        rl_loss={"use_kl_loss": True, "kl_loss_type": "k3", "kl_loss_coef": 0.1},
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer, before, after = train_fixed(tok, args, peft_config=lora)
    assert trainer.ref_model is None  # the reference is the base model, adapter disabled
    assert before and all("lora_" in name for name in before)
    _assert_trained(trainer, before, after, extra_keys=("train_policy/ref_kl",))
    assert _step_logs(trainer)[1]["train_policy/ref_kl"] > 0


def test_bf16_eval_checkpoint_and_model_card(tok, tmp_path):
    args = _config(
        tmp_path,
        max_steps=2,
        bf16=True,
        activation_checkpointing=True,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
        rl_loss={"compile_epilogue": False},  # the compiled epilogue is tested on its own (slow: compilation)
    )
    model = make_model(tok)
    trainer = RLLossGRPOTrainer(
        model,
        reward_length,
        args=args,
        train_dataset=make_dataset(),
        eval_dataset=make_dataset(4),
        processing_class=tok,
    )
    patch_generation(trainer, tok)
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert evals and math.isfinite(evals[0]["eval_loss"]) and "eval_train_policy/entropy" in evals[0]
    assert all(math.isfinite(h["loss"]) for h in _step_logs(trainer))
    out = tmp_path / "out"
    assert (out / "checkpoint-2" / "model.safetensors").exists()
    card = (out / "README.md").read_text()
    assert "hf-rlloss" in card
    saved = torch.load(out / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert saved.rl_loss_config == args.rl_loss_config


def test_config_from_yaml(tmp_path):
    from trl import TrlParser

    path = tmp_path / "cfg.yaml"
    path.write_text(
        "output_dir: out\nuse_cpu: true\nbf16: false\nreport_to: none\nmax_completion_length: 64\n"
        "rl_loss:\n  policy_loss_cfg:\n    loss_type: vanilla\n    cliprange_high: 0.28\n"
        "  loss_agg_mode: seq-mean-token-sum-norm\n"
    )
    (args,) = TrlParser((RLLossGRPOConfig,)).parse_args_and_config(["--config", str(path)])
    assert args.rl_loss_config.policy_loss_cfg.cliprange_high == 0.28
    assert args.rl_loss_config.loss_scale_factor == 64.0  # Dr. GRPO's constant defaults to max_completion_length
    cli = [
        "--output_dir",
        "out",
        "--use_cpu",
        "true",
        "--bf16",
        "false",
        "--rl_loss",
        '{"use_kl_loss": true, "kl_loss_type": "k3+"}',
    ]
    (args,) = TrlParser((RLLossGRPOConfig,)).parse_args_and_config(cli)
    assert args.rl_loss_config.use_kl_loss and args.rl_loss_config.kl_loss_type == "k3+"


def test_subclass_build_loss_data(tok, tmp_path):
    """The documented hook: zero advantages and no KL leave the policy untouched (plain policy gradient)."""

    class ZeroAdvantageTrainer(RLLossGRPOTrainer):
        def build_loss_data(self, inputs):
            data = super().build_loss_data(inputs)
            data["advantages"] = torch.zeros_like(data["advantages"])
            return data

    args = _config(tmp_path, max_steps=1, optim="sgd", rl_loss={"policy_loss_cfg": {"loss_type": "gpg"}})
    _, before, after = train_fixed(tok, args, trainer_cls=ZeroAdvantageTrainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_rollout_func_logprobs_reach_the_loss(tok, tmp_path):
    """Rollout (sampler) log-probs from a `rollout_func` are kept and given to the loss as `rollout_logprobs`."""
    fixed = FixedCompletions(tok, 8)
    seen = []

    def rollout_func(prompts, trainer):
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        completion_ids, _ = fixed(prompt_ids, None, None, len(prompts))
        logprobs = [[-1.0 - 0.01 * i for i in range(len(c))] for c in completion_ids]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    class Recording(RLLossGRPOTrainer):
        def build_loss_data(self, inputs):
            data = super().build_loss_data(inputs)
            seen.append(data)
            return data

    args = _config(tmp_path, max_steps=1)
    trainer = Recording(
        make_model(tok),
        reward_length,
        args=args,
        train_dataset=make_dataset(),
        processing_class=tok,
        rollout_func=rollout_func,
    )
    trainer.train()
    assert seen and all("rollout_logprobs" in data for data in seen)
    data = seen[0]
    valid = data["shifted_labels"] != -100
    assert torch.all(data["rollout_logprobs"][valid] <= -1.0)
    assert math.isfinite(_step_logs(trainer)[0]["loss"])


def test_rollout_func_logprobs_on_the_sampled_support_are_compared_with_the_replayed_truncation(tok, tmp_path):
    """vLLM-like rollout log-probs under top_k=5 (log π_S = log π − log K, computed here from full logits) match the
    trainer's π_old renormalized over its replayed top-k support: only numerical mismatch, and the kept mass."""
    from transformers import TopKLogitsWarper

    fixed = FixedCompletions(tok, 8)

    def rollout_func(prompts, trainer):
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        completion_ids, _ = fixed(prompt_ids, None, None, len(prompts))
        logprobs = []
        model = trainer.accelerator.unwrap_model(trainer.model)
        for prompt, completion in zip(prompt_ids, completion_ids):
            ids = torch.tensor([prompt + completion])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].double()  # (completion, V), temperature 1
            full = torch.log_softmax(logits, dim=-1)
            kept = torch.isfinite(TopKLogitsWarper(top_k=5)(None, logits.clone()))
            log_kept = torch.logsumexp(full.masked_fill(~kept, float("-inf")), dim=-1)
            logprobs.append((full.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1) - log_kept).tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    trainer = RLLossGRPOTrainer(
        make_model(tok),
        reward_length,
        args=_config(tmp_path, max_steps=1, top_k=5),
        train_dataset=make_dataset(),
        processing_class=tok,
        rollout_func=rollout_func,
    )
    trainer.train()
    log = _step_logs(trainer)[0]
    assert log["mismatch/mismatch_logprob_abs_diff"] <= 1e-5, log
    assert log["rollout_is/mean"] == pytest.approx(1.0, abs=1e-4)
    assert 0.0 < log["mismatch/kept_mass_mean"] < 0.5  # 5 of 259 tokens of a near-uniform random model


# ------------------------------------------------------------------------------------------------------------------
# Mapping of TRL options, bad input


@pytest.mark.parametrize(
    "options,expected",
    [
        ({"loss_type": "dapo", "epsilon_high": 0.28}, ("vanilla", "token-mean", 0.2, 0.28)),
        ({"loss_type": "grpo"}, ("vanilla", "seq-mean-token-mean", 0.2, 0.2)),
        ({"loss_type": "dr_grpo"}, ("vanilla", "seq-mean-token-sum-norm", 0.2, 0.2)),
        ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, ("gspo", "seq-mean-token-sum", 0.2, 0.2)),
        ({"loss_type": "cispo", "epsilon_high": 5.0}, ("cispo", "token-mean", CISPO_NO_LOWER_BOUND, 4.0)),
        ({"loss_type": "sapo"}, ("sapo", "seq-mean-token-mean", None, None)),
        ({"loss_type": "cispo", "importance_sampling_level": "sequence"}, ("cispo_seq", "token-mean", 1.0, -0.8)),
        ({"loss_type": "vespo"}, ("vespo", "token-mean", None, None)),
        (
            {"loss_type": "sapo", "importance_sampling_level": "sequence"},
            ("sapo_seq", "seq-mean-token-mean", None, None),
        ),
        ({"loss_type": "grpo", "delta": 1.5}, ("vanilla", "seq-mean-token-mean", 0.2, 0.2)),
    ],
)
def test_trl_options_mapping(tmp_path, options, expected):
    args = RLLossGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_completion_length=32, **options)
    cfg = args.rl_loss_config
    loss_type, agg, low, high = expected
    assert (cfg.policy_loss_cfg.loss_type, cfg.agg_mode) == (loss_type, agg)
    if low is not None:
        assert (cfg.policy_loss_cfg.cliprange_low, cfg.policy_loss_cfg.cliprange_high) == (low, high)
    if agg == "seq-mean-token-sum-norm":
        assert cfg.loss_scale_factor == 32.0
    assert cfg.count_empty_sequences == (agg != "token-mean")  # TRL's sequence-mean losses count every row
    mapped, _ = trl_options_to_rl_loss(args)
    assert RLLossGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, rl_loss=mapped).rl_loss_config == cfg


@pytest.mark.parametrize(
    "options,match",
    [
        ({"rl_loss": {"policy_loss_cfg": {"cliprange_low": 1.5}}}, r"rl_loss\.policy_loss_cfg\.cliprange_low"),
        ({"rl_loss": {"kl_coef": 0.1}}, r"rl_loss\.kl_coef: unknown key"),
        ({"rl_loss": {"policy_loss_cfg": {"loss_type": "vanilla", "tau": 1}}}, r"rl_loss\.policy_loss_cfg.*'tau'"),
        ({"rl_loss": {"use_kl_loss": True}}, r"needs kl_loss_type"),
        ({"rl_loss": {"use_kl_loss": True, "kl_loss_type": "k3"}, "beta": 0.04}, r"rl_loss\.kl_loss_coef"),
        ({"rl_loss": {}, "epsilon_high": 0.28}, r"rl_loss\.policy_loss_cfg\.cliprange_high"),
        ({"rl_loss": {}, "loss_type": "grpo"}, r"loss_type='grpo' conflicts with rl_loss"),
        (
            {"rl_loss": {"loss_agg_mode": "seq-mean-token-mean"}, "loss_type": "grpo"},
            r"rl_loss\.count_empty_sequences=False, while loss_type means count_empty_sequences=True",
        ),
        ({"loss_type": "cispo", "epsilon_high": 0.0}, r"epsilon_high=0.0.*must be > 0"),
        ({"delta": 1.0}, r"delta=1.0 must be > 1"),
        ({"off_policy_mask_threshold": -0.1}, r"off_policy_mask_threshold"),
        ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile"),
        ({"entropy_coef": float("nan")}, r"rl_loss\.entropy_coef"),
        ({"sp_size": 0}, r"sp_size"),
    ],
)
def test_bad_config(tmp_path, options, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        RLLossGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **options)


def test_bad_trainer_arguments(tok, tmp_path):
    model = make_model(tok)
    kl = {"use_kl_loss": True, "kl_loss_type": "k3"}
    model.is_loaded_in_4bit = True  # a quantized in-memory policy cannot be deep-copied into a reference
    with pytest.raises(ValueError, match="needs a reference model"):
        RLLossGRPOTrainer(
            model,
            reward_length,
            args=_config(tmp_path, rl_loss=kl),
            train_dataset=make_dataset(),
            processing_class=tok,
        )
    del model.is_loaded_in_4bit
    with pytest.raises(ValueError, match="use_kl_loss is false"):
        RLLossGRPOTrainer(
            model,
            reward_length,
            args=_config(tmp_path),
            train_dataset=make_dataset(),
            processing_class=tok,
            ref_model=make_model(tok),
        )
    with pytest.raises(TypeError, match="RLLossGRPOConfig"):
        RLLossGRPOTrainer(
            model,
            reward_length,
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False),
            train_dataset=make_dataset(),
            processing_class=tok,
        )
    model.config.final_logit_softcapping = 30.0  # read into rl_loss.logit_softcapping; a different value is refused
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30.0.*logit_softcapping=20.0: they must match"):
        RLLossGRPOTrainer(
            model,
            reward_length,
            args=_config(tmp_path, rl_loss={"logit_softcapping": 20.0}),
            train_dataset=make_dataset(),
            processing_class=tok,
        )
    model.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="both scales"):
        RLLossGRPOTrainer(
            model, reward_length, args=_config(tmp_path), train_dataset=make_dataset(), processing_class=tok
        )


# ------------------------------------------------------------------------------------------------------------------
# Rollout log-probs from HF generate, rollout IS in the trainer


def _left_padded_prompts(n: int = 16):
    """Prompts of 1 to 11 byte tokens: every generation batch is left-padded."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["abcdefghijk"[: 1 + i % 11] for i in range(n)]})


def _generate_for_real(tok, tmp_path, trainer_cls=RLLossGRPOTrainer, **overrides):
    """Train with TRL's real HF `generate` (sampling) on left-padded prompts, not the fixed completions."""
    args = _config(tmp_path, max_steps=2, **overrides)
    trainer = trainer_cls(
        make_model(tok), [reward_length], args=args, train_dataset=_left_padded_prompts(), processing_class=tok
    )
    before = trainable_snapshot(trainer.model)
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in trainable_snapshot(trainer.model).items())
    return _step_logs(trainer)


SAMPLING = {
    "plain": {},
    "tempered": {"temperature": 0.7},
    "top_k": {"top_k": 10},
    "top_p": {"top_p": 0.8},
    "top_k+top_p, sampled support": {"top_k": 10, "top_p": 0.8, "rollout_logprobs_support": "sampled"},
}


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_hf_generate_rollout_logprobs_match_the_trainer_under_truncated_sampling(tok, tmp_path, sampling):
    """fp32, on-policy, left-padded prompts: the recorded rollout log-probs are on the trainer's support (the full
    vocabulary, or both renormalized over the sampled support), so only numerical noise is left, at every step."""
    logs = _generate_for_real(tok, tmp_path, **SAMPLING[sampling])
    truncated = "top" in sampling
    for log in logs:
        assert log["mismatch/mismatch_logprob_abs_diff"] <= 1e-5, log
        assert log["rollout_is/mean"] == pytest.approx(1.0, abs=1e-4)
        assert log["mismatch/mismatch_k3_kl"] <= 1e-8
        assert log["rollout_is/nonfinite_tokens"] == 0
        if truncated:  # the truncation is reported as what it is: the kept mass, not a mismatch
            assert 0.0 < log["mismatch/kept_mass_min"] <= log["mismatch/kept_mass_mean"] < 0.99
        else:
            assert log["mismatch/kept_mass_mean"] == pytest.approx(1.0, abs=1e-6)


class _NoisyRollout(RLLossGRPOTrainer):
    """Rollout log-probs off by a fixed pseudo-random ±0.5 per token, as an inference engine with other numerics."""

    def build_loss_data(self, inputs):
        data = super().build_loss_data(inputs)
        g = torch.Generator().manual_seed(0)
        noise = torch.rand(data["rollout_logprobs"].shape, generator=g) - 0.5
        data["rollout_logprobs"] = data["rollout_logprobs"] + noise
        return data


def test_rollout_is_in_the_trainer_rejects_and_reports(tok, tmp_path):
    rl_loss = {"rollout_is": {"level": "token", "mode": "both", "lower": 0.8, "upper": 1.25}}
    logs = _generate_for_real(tok, tmp_path, trainer_cls=_NoisyRollout, top_k=3, rl_loss=rl_loss)
    for log in logs:
        assert log["mismatch/mismatch_logprob_abs_diff"] == pytest.approx(0.25, abs=0.1)
        assert 0.0 < log["rollout_is/masked_fraction"] < 1.0  # |noise| > log 1.25 ≈ 0.22 is rejected
        assert log["rollout_is/rejected_token_fraction"] == pytest.approx(log["rollout_is/masked_fraction"])
        assert math.isfinite(log["loss"])


BEAM_SAMPLE = {"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}


def test_beam_search_trains_without_rollout_logprobs(tok, tmp_path, monkeypatch):
    """No sampling distribution under beam search: nothing is recorded, the log says so once, training runs."""
    import hf_rlloss.trainer.sync.old_logprobs as trainer_module

    said = []
    monkeypatch.setattr(trainer_module.logger, "warning_once", lambda message: said.append(message))
    logs = _generate_for_real(tok, tmp_path, generation_kwargs=BEAM_SAMPLE)
    assert len(set(said)) == 1 and "'beam_sample' is not plain sampling" in said[0], said  # one message, once
    assert "no rollout log-probs are recorded" in said[0]
    for log in logs:
        assert math.isfinite(log["loss"]) and not any(k.startswith(("mismatch/", "rollout_is/")) for k in log)
    with pytest.raises(ValueError, match="rollout_is needs sampled completions.*'beam_sample'"):
        RLLossGRPOTrainer(
            make_model(tok),
            [reward_length],
            args=_config(tmp_path, generation_kwargs=BEAM_SAMPLE, rl_loss={"rollout_is": {"upper": 2.0}}),
            train_dataset=_left_padded_prompts(),
            processing_class=tok,
        )


def test_rollout_is_without_rollout_logprobs_is_rejected_at_construction(tmp_path):
    rl_loss = {"rollout_is": {"upper": 2.0}}
    with pytest.raises(ValueError, match="rollout_is needs the rollout's log-probs"):
        _config(tmp_path, rl_loss=rl_loss, record_rollout_logprobs=False)


def test_rollout_logprobs_is_the_deprecated_name_of_record_rollout_logprobs(tmp_path):
    with pytest.warns(FutureWarning, match="rollout_logprobs is deprecated.*use record_rollout_logprobs"):
        args = _config(tmp_path, rollout_logprobs=False)
    assert args.record_rollout_logprobs is False and args.rollout_logprobs is None
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="rollout_is needs the rollout's log-probs"):
        _config(tmp_path, rl_loss={"rollout_is": {"upper": 2.0}}, rollout_logprobs=False)


def test_model_given_as_a_path_with_kl(tok, tmp_path):
    # the policy and its KL reference are both loaded from the path (TRL's usual way of naming a model)
    path = tmp_path / "policy"
    make_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    rl_loss = {"use_kl_loss": True, "kl_loss_type": "k3"}
    args = _config(tmp_path, max_steps=2, rl_loss=rl_loss)
    trainer = RLLossGRPOTrainer(
        str(path), [reward_length], args=args, train_dataset=make_dataset(), processing_class=tok
    )
    patch_generation(trainer, tok)
    trainer.train()
    logs = _step_logs(trainer)
    assert logs[0]["train_policy/ref_kl"] == pytest.approx(0.0, abs=1e-6) and logs[1]["train_policy/ref_kl"] > 0


# ------------------------------------------------------------------------------------------------------------------
# Precision of the LM head


@pytest.mark.parametrize(
    "bf16, cast_lm_head_to_fp32, expected",
    [(True, False, torch.bfloat16), (True, True, torch.float32), (False, False, torch.float32)],
)
def test_head_gemm_dtype_follows_the_mixed_precision(tok, tmp_path, monkeypatch, bf16, cast_lm_head_to_fp32, expected):
    """Under bf16 autocast the head GEMMs of the loss and of the no-grad old/reference passes run in bf16 (float32
    weights, float32 gradients), unless cast_lm_head_to_fp32; float32 training stays float32."""
    kernel = sys.modules["hf_rlloss.loss.chunked_logprobs"]  # the module (the package exports a function of that name)
    seen = []
    original = kernel._chunk_logits

    def spy(h, w):
        seen.append((h.dtype, w.dtype))
        return original(h, w)

    monkeypatch.setattr(kernel, "_chunk_logits", spy)
    rl_loss = {"use_kl_loss": True, "kl_loss_type": "k3", "compile_epilogue": False}
    args = _config(
        tmp_path,
        max_steps=1,
        num_iterations=2,  # old log-probs pass
        bf16=bf16,
        cast_lm_head_to_fp32=cast_lm_head_to_fp32,
        rl_loss=rl_loss,
        optim="sgd",
    )
    trainer, before, after = train_fixed(tok, args, ref_model=make_model(tok, seed=1))
    assert set(seen) == {(expected, expected)}, seen
    # old + reference passes of the generation batch, then the loss of the micro-batch
    assert len(seen) >= 3
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(torch.isfinite(after[k]).all() and not torch.equal(before[k], after[k]) for k in before)


# ------------------------------------------------------------------------------------------------------------------
# On-policy: the mismatch metrics from the training forward, without the no-grad old log-probs pass


def _count_calls(monkeypatch, obj, name: str) -> list[int]:
    calls, original = [], getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


def test_on_policy_mismatch_metrics_skip_the_old_logprobs_forward(tok, tmp_path, monkeypatch):
    """num_iterations=1, steps_per_generation == gradient_accumulation_steps, metrics-only rollout IS: the old
    log-probs are the training forward's, so no no-grad pass runs; logged metrics and parameters are identical to
    the run that computes them with a no-grad pass (same seed, same sampled completions)."""
    runs = {}
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(RLLossGRPOTrainer, "_old_logps_from_loss", property(lambda self: False))
        args = _config(
            tmp_path / str(skip),
            max_steps=2,
            gradient_accumulation_steps=2,
            temperature=0.7,
            top_k=5,
            repetition_penalty=1.5,  # sampled from, not trained: a real rollout/trainer mismatch to measure
            optim="sgd",
            # bitwise equality below: the no-grad pass packs the generation batch's rows in other groups than the
            # shuffled micro-batches, which changes the round-off of a packed row (test_packing.py: to 1e-6)
            packing="off",
        )
        trainer = RLLossGRPOTrainer(
            make_model(tok), [reward_length], args=args, train_dataset=make_dataset(), processing_class=tok
        )
        passes = _count_calls(monkeypatch, trainer, "compute_per_token_logps")
        trainer.train()
        runs[skip] = (_step_logs(trainer), trainable_snapshot(trainer.model), len(passes))
    (skip_logs, skip_params, skip_passes), (full_logs, full_params, full_passes) = runs[True], runs[False]
    assert skip_passes == 0 and full_passes == 2  # one no-grad pass per generation batch, only without the skip
    assert all(
        log["mismatch/mismatch_logprob_abs_diff"] > 1e-3 for log in skip_logs
    )  # the penalty: a real mismatch is measured
    for skip_log, full_log in zip(skip_logs, full_logs, strict=True):
        assert set(skip_log) == set(full_log)
        assert {"mismatch/mismatch_k3_kl", "rollout_is/mean", "train_policy/kl1", "loss"} <= set(full_log)
        different = {k: (skip_log[k], full_log[k]) for k in full_log if skip_log[k] != full_log[k]}
        assert set(different) <= {"step_time"}, different  # wall-clock time only
    for name, value in full_params.items():
        assert torch.equal(skip_params[name], value), name


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_loss_on_two_processes_is_the_global_loss(tmp_path):
    """The same evaluation batches (16 completions: 1 rank × 16, or 2 ranks × 8 whole groups) give the same eval_loss.

    Before the fix, Trainer's `gather_for_metrics` dropped the values of the last batch past the 8-prompt dataset
    length (rank 1's share of it on 2 ranks; half of it on one), so eval_loss was a skewed mean. Now it is the mean
    over the batches of each batch's loss over all ranks, which the loss layer also reports as `eval_loss/total`.
    """
    one, two = (run["metrics"] for run in _on_one_and_two_processes(tmp_path, (16, 8), "--eval-only"))
    assert one["eval_train_policy/valid_tokens"] == two["eval_train_policy/valid_tokens"]  # the same batches
    assert one["eval_loss"] != 0.0
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-6)
    for run in (one, two):
        assert run["eval_loss"] == pytest.approx(run["eval_loss/total"], abs=1e-6)  # the loss layer's reduction
