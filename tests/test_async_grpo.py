"""`RLLossAsyncGRPOTrainer` (issue 22): TRL's async GRPO trainer with the loss layer's loss.

* configured as TRL (vanilla, token clip, no KL, `behavior_as_old_policy`) it makes stock `AsyncGRPOTrainer`'s update
  on the same injected rollout samples;
* at `max_staleness=0`, fed the completions `RLLossGRPOTrainer` generated, it makes the synchronous trainer's update
  (decoupled objective, rollout IS and KL to the reference included);
* bad input gets a clear error naming the option.

SGD without gradient clipping (as in test_trl_parity.py): round-off is not amplified, a wrong scale is not hidden.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from _async import (
    ASYNC_ARGS,
    PARITY_RL_LOSS,
    FixedRolloutWorker,
    NoWeightTransfer,
    fixed_samples,
    prompts_dataset,
)
from _trainer_utils import (
    BASE_ARGS,
    FixedWithLogprobs,
    make_dataset,
    reward_digit,
    reward_length,
    trainable_snapshot,
)
from transformers import AutoModelForCausalLM
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer, RLLossGRPOConfig, RLLossGRPOTrainer
from hf_rlloss.trainer.async_grpo_trainer import portable_async_trl

torch.set_num_threads(1)

TOLERANCE = 1e-6
SGD = dict(optim="sgd", learning_rate=0.05, max_grad_norm=0.0, max_steps=3, lr_scheduler_type="constant")


def _train_async(trainer_cls, args, policy, tok, samples):
    with portable_async_trl():
        trainer = trainer_cls(
            policy, [], args, prompts_dataset(), tok,
            rollout_worker=FixedRolloutWorker(samples), weight_transfer=NoWeightTransfer(),
        )  # fmt: skip
    before = trainable_snapshot(trainer.model)
    trainer.train()
    return trainer, before, trainable_snapshot(trainer.model)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_configured_as_trl_equals_stock_async_trainer(policy, tok, tmp_path):
    """TRL's loss mapped (epsilon, epsilon_high → vanilla, no dual clip, token-mean) with TRL's π_old (the sampler's
    log-probs): the same parameters as stock AsyncGRPOTrainer after 3 steps on the same packed rows."""
    samples = fixed_samples(4)  # 3 steps of one group each, and one more the dataloader prefetches
    options = {**ASYNC_ARGS, **SGD, "epsilon_high": 0.28}
    stock = AsyncGRPOConfig(output_dir=str(tmp_path / "trl"), **options)
    ours = RLLossAsyncGRPOConfig(output_dir=str(tmp_path / "ours"), behavior_as_old_policy=True, **options)
    _, before, stock_after = _train_async(AsyncGRPOTrainer, stock, policy, tok, samples)
    trainer, our_before, our_after = _train_async(RLLossAsyncGRPOTrainer, ours, policy, tok, samples)
    assert _max_diff(before, our_before) == 0.0
    assert _max_diff(stock_after, before) > 1e-3, "the parameters hardly moved: the comparison would be vacuous"
    assert _max_diff(stock_after, our_after) < TOLERANCE
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    assert len(logs) == 3
    for log in logs:  # clipping happened, and the trainer's loss is the loss layer's
        assert abs(log["loss"] - log["loss/total"]) < 1e-6
        assert log["async/version_lag_max"] >= log["async/version_lag_mean"] >= 1.0
        assert log["async/dropped_stale_frac"] == 0.0
    assert any(log["train_policy/clip_frac_high"] > 0 for log in logs)


class _RecordGenerations:
    """Wraps `RLLossGRPOTrainer._generate_and_score_completions` and keeps each generation batch it returns."""

    def __init__(self, trainer):
        self.inner = trainer._generate_and_score_completions
        self.batches = []

    def __call__(self, *args, **kwargs):
        batch = self.inner(*args, **kwargs)
        self.batches.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()})
        return batch


def _as_rollout_samples(batches, version_of_step) -> list[RolloutSample]:
    """The synchronous trainer's generation batches as TRL rollout samples: prompt (unpadded) + completion, the
    sampler's log-probs on the completion tokens, the trainer's advantages; one group per generation batch."""
    samples = []
    for step, batch in enumerate(batches):
        for i in range(batch["prompt_ids"].shape[0]):
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
            keep = batch["completion_mask"][i].bool()
            completion = batch["completion_ids"][i][keep].tolist()
            logps = batch["sampling_per_token_logps"][i][keep].tolist()
            samples.append(
                RolloutSample(
                    prompt=[], completion=[], input_ids=np.asarray(prompt + completion),
                    completion_mask=np.asarray([0] * len(prompt) + [1] * len(completion)),
                    old_log_probs=np.asarray([0.0] * len(prompt) + logps, dtype=np.float32),
                    advantage=float(batch["advantages"][i]), model_version=version_of_step(step), group_id=step,
                    metrics={"reward": 0.0},
                )
            )  # fmt: skip
    return samples


def test_staleness_zero_equals_synchronous_trainer(policy, tok, tmp_path):
    """max_staleness=0 and the synchronous trainer's own completions: the decoupled objective (π_old from the no-grad
    pass, which on-policy equals the current policy), rollout IS against the sampler's log-probs and the KL to the
    reference give RLLossGRPOTrainer's parameters after 3 steps."""
    rl_loss = PARITY_RL_LOSS
    sync_options = {**BASE_ARGS, **SGD, "scale_rewards": "none", "gradient_accumulation_steps": 1}
    sync_args = RLLossGRPOConfig(output_dir=str(tmp_path / "sync"), rl_loss=rl_loss, **sync_options)
    sync = RLLossGRPOTrainer(policy, [reward_length, reward_digit], args=sync_args, train_dataset=make_dataset(),
                             processing_class=tok)  # fmt: skip
    sync._generate_single_turn = FixedWithLogprobs(tok, sync.max_completion_length)
    recorder = sync._generate_and_score_completions = _RecordGenerations(sync)
    before = trainable_snapshot(sync.model)
    sync.train()
    sync_after = trainable_snapshot(sync.model)
    assert len(recorder.batches) == 3 and all(b["prompt_ids"].shape[0] == 4 for b in recorder.batches)

    # Step k (0-based) trains at policy version k + 1 (the cold sync makes the first version 1): tagged with it, the
    # samples are trained at lag 0 (the dataloader pulls them one step ahead, when they look one version "early").
    samples = _as_rollout_samples(recorder.batches + recorder.batches[-1:], version_of_step=lambda step: step + 1)
    options = {**ASYNC_ARGS, **SGD, "max_staleness": 1}
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path / "async"), rl_loss=rl_loss, **options)
    trainer, our_before, our_after = _train_async(RLLossAsyncGRPOTrainer, args, policy, tok, samples)
    assert _max_diff(before, our_before) == 0.0
    assert _max_diff(sync_after, before) > 1e-3
    assert _max_diff(sync_after, our_after) < TOLERANCE
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    assert all(log["async/version_lag_max"] == 0.0 for log in logs)
    assert any(log["rollout_is/fraction_high"] > 0 for log in logs)  # the IS truncation acted
    assert any(log["loss/kl"] != 0.0 for log in logs)


# ------------------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("value", [-1, 0])
def test_max_staleness_below_one_is_refused(tmp_path, value):
    """max_staleness counts versions at training; the prefetch makes every asynchronous sample at least 1 late."""
    with pytest.raises(ValueError, match=f"max_staleness={value} must be an integer >= 1: .* trained at least 1"):
        RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_staleness=value)


def test_decoupled_objective_gets_rollout_is_by_default(tmp_path):
    """Unset rl_loss, or rl_loss without rollout_is: the decoupled objective weighs by the truncated IS weight."""
    for rl_loss in (None, {"policy_loss_cfg": {"loss_type": "vanilla"}}):
        cfg = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, rl_loss=rl_loss).rl_loss_config
        assert cfg.rollout_is.enabled and (cfg.rollout_is.level, cfg.rollout_is.upper) == ("token", 2.0)
    trl = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, behavior_as_old_policy=True)
    assert not trl.rl_loss_config.rollout_is.enabled  # TRL's choice: the clip against the sampler protects
    ablation = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, allow_uncorrected_staleness=True)
    assert not ablation.rl_loss_config.rollout_is.enabled
    mini = RLLossAsyncGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, num_mini_batches=2, rl_loss={"rollout_is": {}}
    )
    assert not mini.rl_loss_config.rollout_is.enabled  # the clip binds from the second mini-batch


def test_decoupled_objective_without_protection_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rl_loss.rollout_is is off .* the PPO clip never binds"):
        RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, rl_loss={"rollout_is": {}})
    with pytest.raises(ValueError, match="num_mini_batches=0 must be an integer >= 1"):
        RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, num_mini_batches=0)


def test_rollout_is_with_behavior_as_old_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rl_loss.rollout_is with behavior_as_old_policy=True"):
        RLLossAsyncGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, behavior_as_old_policy=True, rl_loss={"rollout_is": {"upper": 2}}
        )


def test_epsilon_conflicting_with_rl_loss_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"epsilon=0.1 conflicts with rl_loss \(rl_loss.policy_loss_cfg.cliprange_lo"):
        RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, epsilon=0.1, rl_loss={})


def test_invalid_rl_loss_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="rl_loss.policy_loss_cfg.cliprange_low"):
        RLLossAsyncGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, rl_loss={"policy_loss_cfg": {"cliprange_low": 1.5}}
        )


@pytest.mark.parametrize(
    "options",
    [
        {"rl_loss": {"rollout_is": {"upper": 2.0}}},
        {"allow_uncorrected_staleness": True},
        {"behavior_as_old_policy": True},
    ],
    ids=["rollout-is", "is-off", "trl-old-policy"],
)
def test_missing_behaviour_logprobs_are_refused(policy, tok, tmp_path, options):
    """A sampler that reports no log-probs (NaN): with IS or without, the first step says so (the loss layer would
    otherwise drop every token and train nothing)."""
    samples = fixed_samples(2)
    for sample in samples:
        sample.old_log_probs[:] = np.nan
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1, **options, **ASYNC_ARGS)
    with pytest.raises(ValueError, match="the sampler's log-probs of [0-9]+ trained tokens .* are missing"):
        _train_async(RLLossAsyncGRPOTrainer, args, policy, tok, samples)


# ------------------------------------------------------------------------------------------------------------------
# On CPU end to end: HF generate in its own process, weights through a shared-memory queue


@pytest.mark.slow  # a spawned process imports torch/transformers/trl (10-30 s on 2 shared cores)
def test_cpu_worker_and_queue_transfer_train(policy, tok, tmp_path):
    """Two optimizer steps with the rollout process: samples tagged with the version they were sampled from, the
    recorded log-probs equal the trainer's π_old at version lag 0 (the mismatch is round-off), the weights reach the
    worker (its later samples come from later versions)."""
    from _trainer_utils import make_dataset, reward_digit, reward_length

    from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker, QueueWeightTransfer

    args = RLLossAsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=2, queue_maxsize=4, heartbeat_stale_after_s=120,
        rl_loss={"rollout_is": {"level": "token", "upper": 2.0}, "use_kl_loss": True, "kl_loss_type": "k3"},
        **{**ASYNC_ARGS, "max_staleness": 1},
    )  # fmt: skip
    worker = HFGenerateRolloutWorker(policy, make_dataset(), [reward_length, reward_digit], tok, args)
    trainer = RLLossAsyncGRPOTrainer(policy, [reward_length, reward_digit], args, make_dataset(), tok,
                                     rollout_worker=worker, weight_transfer=QueueWeightTransfer(worker))  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    assert len(logs) == 2
    first = logs[0]
    assert first["async/version_lag_max"] == 0.0
    assert first["mismatch/mismatch_logprob_abs_diff"] < 1e-5  # same weights: recorder == trainer's π_old
    assert all(math.isfinite(log["loss/total"]) and log["async/version_lag_max"] <= 1.0 for log in logs)
    assert worker._process is None  # stopped at the end of training


def _exits_at_once(worker):
    """Replace the worker's process by one that exits with code 3 as soon as it starts."""
    import os

    worker._process = worker._ctx.Process(target=os._exit, args=(3,), daemon=True)
    worker._process.start()
    worker._ready.set()
    worker._process.join(timeout=30)


def test_dead_or_stalled_worker_is_reported(policy, tok, tmp_path):
    from _trainer_utils import make_dataset

    from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **ASYNC_ARGS)
    worker = HFGenerateRolloutWorker(policy, make_dataset(), [], tok, args)
    worker._heartbeat.value = time.time() - 100
    with pytest.raises(RuntimeError, match="no progress for 100s > heartbeat_stale_after_s=50s"):
        worker.check_health(50.0)
    worker._errors.put("Traceback: ValueError: boom")
    worker._failed.set()
    with pytest.raises(RuntimeError, match="the rollout process failed") as info:
        worker.check_health(1e9)
    assert "boom" in str(info.value.__cause__)
    worker._failed.clear()
    _exits_at_once(worker)
    with pytest.raises(RuntimeError, match=r"the rollout process exited \(exit code 3\)"):
        worker.check_health(1e9)


def test_trainer_ends_with_an_error_when_the_worker_dies(policy, tok, tmp_path):
    """TRL's queue polls every 5 s and then asks the worker's health: the trainer raises instead of waiting."""
    from _trainer_utils import make_dataset

    from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker, QueueWeightTransfer

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1, **ASYNC_ARGS)
    worker = HFGenerateRolloutWorker(policy, make_dataset(), [], tok, args)
    worker.start = lambda: _exits_at_once(worker)
    trainer = RLLossAsyncGRPOTrainer(policy, [], args, make_dataset(), tok, rollout_worker=worker,
                                     weight_transfer=QueueWeightTransfer(worker))  # fmt: skip
    start = time.time()
    with pytest.raises(RuntimeError, match="the rollout process exited"):
        trainer.train()
    assert time.time() - start < 60


@pytest.mark.parametrize(
    "option, value, match",
    [
        ("vllm_server_base_url", "http://gpu:8000", "vllm_server_base_url=.* configures TRL's vLLM rollout worker"),
        ("max_tool_calling_iterations", 3, "max_tool_calling_iterations=3 without tools or environment_factory"),
    ],
)
def test_vllm_only_option_on_cpu_worker_is_refused(policy, tok, tmp_path, option, value, match):
    from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{option: value})
    with pytest.raises(ValueError, match=match):
        HFGenerateRolloutWorker(policy, prompts_dataset(), [], tok, args)


def test_a_worker_recording_no_logprobs_is_refused(policy, tok, tmp_path):
    from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), allow_uncorrected_staleness=True, **ASYNC_ARGS)
    worker = HFGenerateRolloutWorker(policy, prompts_dataset(), [], tok, args, record_logprobs=False)
    with pytest.raises(ValueError, match="records_logprobs is False"):
        RLLossAsyncGRPOTrainer(policy, [], args, prompts_dataset(), tok, rollout_worker=worker,
                               weight_transfer=NoWeightTransfer())  # fmt: skip


@pytest.mark.slow  # two launched gloo processes
def test_two_trainer_processes_on_gloo_equal_one(policy, tmp_path):
    """TRL's async trainer runs data-parallel on CPU (rank 0 pulls the queue and the dispatcher sends each rank its
    packed row); the loss layer's step normalization over both ranks gives one process's update on the same
    samples (8 per step: one row of 8 in one process, a row of 4 on each of two)."""
    from _launch import run, torchrun
    from dist_async_script import train

    out = tmp_path / "two.pt"
    result = run([*torchrun(2), "tests/dist_async_script.py", policy, str(out), "4"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    two = torch.load(out)
    assert two["world"] == 2 and len(two["logs"]) == 3
    _, one, one_logs = train(policy, str(tmp_path / "one"), 8)
    start = {k: p for k, p in AutoModelForCausalLM.from_pretrained(policy).named_parameters() if k in one}
    assert _max_diff(one, start) > 1e-3
    assert _max_diff(one, two["params"]) < TOLERANCE
    for a, b in zip(one_logs, two["logs"]):
        assert abs(a["loss/total"] - b["loss/total"]) < 1e-6
        assert a["train_policy/valid_tokens"] == b["train_policy/valid_tokens"]


@pytest.mark.parametrize("support", ["full", "sampled"])
def test_cpu_worker_records_the_sampled_tokens_logprobs(policy, tok, tmp_path, support):
    """The worker's loop (run here, in-process) records each sampled token's log-prob under temperature 0.8, top-k 5
    and top-p 0.9 as the policy gives it: over the whole vocabulary (`full`) or renormalized over the kept support
    (`sampled`); every sampled token lies in that support; advantages are TRL's group advantages."""
    import types

    from _trainer_utils import make_dataset, reward_length
    from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

    from hf_rlloss.trainer.async_.rollout import HFGenerateLoop, HFGenerateRolloutWorker

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), temperature=0.8, top_k=5, top_p=0.9,
                                 rollout_logprobs_support=support, **ASYNC_ARGS)  # fmt: skip
    worker = HFGenerateRolloutWorker(policy, make_dataset(), [reward_length], tok, args, groups_per_batch=2)
    loop = HFGenerateLoop(worker._settings, None, worker.metrics_queue, None, None, types.SimpleNamespace(value=0.0))
    loop.load()
    loop.version = 3
    torch.manual_seed(0)
    samples = loop._generate_batch()
    assert len(samples) == 2 * args.num_generations and {s.model_version for s in samples} == {3}
    warpers = LogitsProcessorList([TopKLogitsWarper(5), TopPLogitsWarper(0.9)])
    for sample in samples:
        ids = torch.as_tensor(sample.input_ids).unsqueeze(0)
        with torch.no_grad():
            logits = loop.model(ids).logits[0, :-1].float() / 0.8
        targets, mask = ids[0, 1:], torch.as_tensor(sample.completion_mask[1:]).bool()
        scores = logits if support == "full" else warpers(ids, logits)
        expected = torch.log_softmax(scores, -1).gather(-1, targets[:, None])[:, 0][mask]
        recorded = torch.as_tensor(sample.old_log_probs[1:])[mask]
        assert torch.isfinite(expected).all()  # the sampled token is in the truncated support
        torch.testing.assert_close(recorded, expected, atol=1e-4, rtol=0)
    rewards = np.array([s.metrics["reward"] for s in samples[: args.num_generations]])
    advantages = [s.advantage for s in samples[: args.num_generations]]
    # scale_rewards="group" (the default, TRL's GRPOTrainer's): unbiased std + 1e-4
    np.testing.assert_allclose(advantages, (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4), rtol=1e-6)


def test_weight_lag_applies_the_first_weights_at_once_then_k_versions_late(policy, tok, tmp_path):
    """`weight_lag=2`: the cold sync's weights are used at once (nothing older exists; waiting would deadlock with
    the trainer, which waits for samples), later ones when two newer versions have arrived."""
    import types

    from hf_rlloss.trainer.async_.rollout import HFGenerateLoop, HFGenerateRolloutWorker

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **ASYNC_ARGS)
    worker = HFGenerateRolloutWorker(policy, prompts_dataset(), [], tok, args, weight_lag=2)
    loop = HFGenerateLoop(worker._settings, None, None, worker.weights, None, types.SimpleNamespace(value=0.0))
    loop.load()
    state = {k: v.clone() for k, v in loop.model.state_dict().items()}
    seen = []
    for version in range(1, 6):
        worker.weights.publish(version, iter(state.items()))
        loop._apply_weights(block=False)
        seen.append(loop.version)
    assert seen == [1, 1, 1, 2, 3]


# ------------------------------------------------------------------------------------------------------------------
# Staleness: measured when a sample is trained; mini-batches; the IS weight of a stale sample


def _tagged(groups_versions: list[int], group_size: int = 4):
    """`fixed_samples` with group `g` tagged as sampled by policy version `groups_versions[g]`."""
    samples = fixed_samples(len(groups_versions), group_size=group_size)
    for sample in samples:
        sample.model_version = groups_versions[sample.group_id]
    return samples


def _completion_tokens(samples, groups) -> int:
    return sum(int(s.completion_mask.sum()) for s in samples if s.group_id in groups)


def test_a_sample_stale_when_trained_is_dropped_when_pulled(policy, tok, tmp_path):
    """max_staleness=1, two groups per step. Step 2's first group (version 0) is pulled during step 1, at version 1,
    as the dataloader's prefetch, and would be trained at version 2 (lag 2). One rule, applied once: the pull compares
    with the version the sample will be trained at, so it is dropped when pulled and the next group takes its place
    (step 2 trains two groups; a filter comparing with the version at pull keeps it, and the trainer then drops it
    from the loss of a half-empty step). Counted in `async/dropped_stale_frac`; the lags logged are those at training
    (0 here; the groups tagged newer than the trainer have negative lags)."""
    samples = _tagged([1, 1, 0, 2, 3, 3, -1, 4, 4, 4])
    options = {**ASYNC_ARGS, **SGD, "per_device_train_batch_size": 8, "max_staleness": 1}
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **options)
    trainer, _, _ = _train_async(RLLossAsyncGRPOTrainer, args, policy, tok, samples)
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    assert len(logs) == 3
    assert [log["train_policy/valid_tokens"] for log in logs] == [
        _completion_tokens(samples, {0, 1}),
        _completion_tokens(samples, {3, 4}),  # group 2 dropped when pulled, group 4 in its place
        _completion_tokens(samples, {5, 7}),  # group 6 (lag 4) dropped when pulled
    ]
    assert all(log["async/version_lag_max"] == 0.0 for log in logs)
    assert logs[0]["async/dropped_stale_frac"] > 0.0  # group 2, pulled during step 1
    assert logs[1]["async/dropped_stale_frac"] > 0.0  # group 6, pulled during step 2
    assert logs[2]["async/dropped_stale_frac"] == 0.0
    assert [log["async/skipped_empty_steps_total"] for log in logs] == [0.0, 0.0, 0.0]


def test_mini_batches_make_the_clip_bind(policy, tok, tmp_path):
    """num_mini_batches=2: π_old is computed once per batch, with the weights of its first step. The first step of
    each batch trains at π_θ = π_old (ratio 1 to round-off); the second, after one SGD step, at π_θ ≠ π_old."""
    samples = fixed_samples(6)
    rl_loss = {"policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28}}
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), num_mini_batches=2, rl_loss={**rl_loss, "rollout_is": {}},
                                 **{**ASYNC_ARGS, **SGD, "max_steps": 4, "learning_rate": 0.5})  # fmt: skip
    trainer, _, _ = _train_async(RLLossAsyncGRPOTrainer, args, policy, tok, samples)
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    deviation = [log["train_policy/ratio_abs_dev_mean"] for log in logs]
    assert len(deviation) == 4
    # float32 log-probs of the same weights through the same forward: equal to a few ulps of exp(Δ) ≈ 1
    assert deviation[0] < 1e-5 and deviation[2] < 1e-5
    assert deviation[1] > 1e-2 and deviation[3] > 1e-2
    assert any(log["train_policy/clip_frac_low"] + log["train_policy/clip_frac_high"] > 0 for log in logs[1::2])


def test_rollout_is_weight_of_stale_samples_with_gradient_accumulation(policy, tok, tmp_path):
    """One optimizer step of two micro-batches (gradient accumulation 2) on samples 3 versions stale, token-level IS
    truncated at 1.5: the update equals an independent computation on the unpacked sequences, with π_old the policy's
    log-probs, π_behavior the sampler's and the token-mean over both micro-batches' tokens."""
    samples = _tagged([-2, -2, -2])
    rl_loss = {
        "policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
        "loss_agg_mode": "token-mean",
        "rollout_is": {"level": "token", "mode": "truncate", "upper": 1.5},
    }
    options = {**ASYNC_ARGS, **SGD, "max_steps": 1, "gradient_accumulation_steps": 2, "max_staleness": 5}
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), rl_loss=rl_loss, **options)
    trainer, before, after = _train_async(RLLossAsyncGRPOTrainer, args, policy, tok, samples)
    (log,) = [h for h in trainer.state.log_history if "loss/total" in h]
    assert log["async/version_lag_max"] == 3.0

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    trained = [s for s in samples if s.group_id in (0, 1)]
    loss, tokens, truncated = 0.0, 0, 0
    for sample in trained:
        ids = torch.as_tensor(sample.input_ids).unsqueeze(0)
        mask = torch.as_tensor(sample.completion_mask[1:]).bool()
        logps = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0][mask]
        behavior = torch.as_tensor(sample.old_log_probs[1:])[mask]
        weight = torch.exp(logps.detach() - behavior).clamp(max=1.5)  # π_old / π_behavior, truncated
        truncated += int((weight == 1.5).sum())
        loss = loss - (weight * sample.advantage * logps).sum()
        tokens += int(mask.sum())
    (loss / tokens).backward()
    expected = {n: p.detach() - SGD["learning_rate"] * p.grad for n, p in model.named_parameters() if n in before}
    assert truncated > 0, "no weight reached the truncation: the test would not see it"
    assert log["train_policy/valid_tokens"] == tokens
    assert _max_diff(after, before) > 1e-3
    assert _max_diff(after, expected) < TOLERANCE


# ------------------------------------------------------------------------------------------------------------------
# The channels: a worker killed mid-write, a killed trainer, the newest weights only


def _write_half_then_die(channel, payload_bytes: int) -> None:
    """Send a frame's header and half its payload, then SIGKILL this process (what the OOM killer does)."""
    import os
    import pickle
    import signal

    from hf_rlloss.trainer.async_.rollout.channel import HEADER

    payload = pickle.dumps(np.random.default_rng(0).bytes(payload_bytes))
    os.write(channel._writer.fileno(), HEADER.pack(len(payload)) + payload[: len(payload) // 2])
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_mid_write_is_named_within_seconds():
    """A 50 KB sample half-written when its writer is killed: the read raises the health check's error naming the
    dead process, within seconds, instead of blocking for ever as `multiprocessing.Queue.get` does."""
    import multiprocessing
    import threading

    from hf_rlloss.trainer.async_.rollout.channel import SampleChannel

    ctx = multiprocessing.get_context("fork")  # the channel's mechanics; no need to import torch in the child
    channel = SampleChannel(ctx, maxsize=4)
    writer = ctx.Process(target=_write_half_then_die, args=(channel, 50_000))

    def health():
        if not writer.is_alive():
            raise RuntimeError(f"rollout process exited (exit code {writer.exitcode})")

    channel.health = health
    writer.start()
    channel.close_writer()
    outcome = []

    def read():
        try:
            outcome.append(channel.get(timeout=60.0))
        except Exception as err:  # noqa: BLE001 - the test inspects it
            outcome.append(err)

    start = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=20.0)
    assert not reader.is_alive(), "the read hangs on the half-written message"
    assert time.monotonic() - start < 20.0
    (error,) = outcome
    assert isinstance(error, RuntimeError) and "exit code -9" in str(error)


def _trainer_with_a_worker(report) -> None:
    """A stand-in trainer: starts a worker child that watches it as the rollout worker does, reports its PID, and
    waits to be killed."""
    import multiprocessing
    import os

    from hf_rlloss.trainer.async_.rollout.process import exit_with_parent

    worker = multiprocessing.get_context("fork").Process(target=exit_with_parent, args=(os.getpid(), 0.1))
    worker.start()
    report.send(worker.pid)
    time.sleep(120)


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_worker_exits_when_its_trainer_is_killed():
    import multiprocessing
    import os
    import signal

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    trainer = ctx.Process(target=_trainer_with_a_worker, args=(send,))
    trainer.start()
    try:
        assert receive.poll(30.0)
        worker_pid = receive.recv()
        assert _running(worker_pid)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(timeout=10)
        deadline = time.monotonic() + 10.0
        while _running(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(worker_pid), "the worker outlived its trainer"
    finally:
        for pid in (trainer.pid, locals().get("worker_pid")):
            if pid is not None and _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_latest_weights_keep_the_newest_version_and_no_descriptors_pile_up(policy, tok, tmp_path):
    """Weights sent while the worker is busy overwrite each other in one shared copy (the worker loads the newest,
    and later versions reach it: dropping them fails this test); the trainer's open file descriptors do not grow."""
    import os
    import types

    from hf_rlloss.trainer.async_.rollout import HFGenerateLoop, HFGenerateRolloutWorker, QueueWeightTransfer

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **ASYNC_ARGS)
    worker = HFGenerateRolloutWorker(policy, prompts_dataset(), [], tok, args)
    transfer = QueueWeightTransfer(worker)
    loop = HFGenerateLoop(worker._settings, None, None, worker.weights, None, types.SimpleNamespace(value=0.0))
    loop.load()
    base = {k: v.clone() for k, v in loop.model.state_dict().items()}

    def send(version):  # as TRL does: send, then bump the version
        transfer.send_weights((k, v + version) for k, v in base.items())
        worker.update_model_version(version)

    send(1)
    loop._apply_weights(block=True)
    assert loop.version == 1
    fds = len(os.listdir("/proc/self/fd"))
    for version in range(2, 30):
        send(version)
    assert len(os.listdir("/proc/self/fd")) <= fds
    loop._apply_weights(block=False)
    assert loop.version == 29
    for name, value in loop.model.state_dict().items():
        torch.testing.assert_close(value, base[name] + 29, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------------------
# Parity with TRL: the MoE router loss


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory, tok):
    """A tiny Qwen3-MoE (4 experts, top 2, router_aux_loss_coef 0.1) saved to disk."""
    from _trainer_utils import tiny_config
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = tiny_config(tok, head_dim=8, num_experts_per_tok=2, tie_word_embeddings=False, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4, **common)
    )
    path = tmp_path_factory.mktemp("moe")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_moe_router_loss_as_stock_async_trainer(moe_policy, tok, tmp_path):
    """TRL's async trainer adds router_aux_loss_coef × the model's load-balancing loss: configured as TRL, the loss
    layer's trainer makes the same update on an MoE policy (2 SGD steps), and logs TRL's `aux_loss`."""
    samples = fixed_samples(3)
    options = {**ASYNC_ARGS, **SGD, "max_steps": 2, "epsilon_high": 0.28}
    stock = AsyncGRPOConfig(output_dir=str(tmp_path / "trl"), **options)
    ours = RLLossAsyncGRPOConfig(output_dir=str(tmp_path / "ours"), behavior_as_old_policy=True, **options)
    stock_trainer, before, stock_after = _train_async(AsyncGRPOTrainer, stock, moe_policy, tok, samples)
    trainer, _, our_after = _train_async(RLLossAsyncGRPOTrainer, ours, moe_policy, tok, samples)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.1
    assert _max_diff(stock_after, before) > 1e-3
    assert _max_diff(stock_after, our_after) < TOLERANCE
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    stock_logs = [h for h in stock_trainer.state.log_history if "aux_loss" in h]
    assert [log["aux_loss"] for log in logs] == pytest.approx([log["aux_loss"] for log in stock_logs], rel=1e-5)


def test_auto_tree_attention_on_cuda_without_kernels_says_it_uses_sdpa(monkeypatch, caplog):
    """`tree_attention="auto"` picks TRL's FA3 kernel on CUDA when the `kernels` package is there; without it the
    portable SDPA tree attention runs, and a warning says why."""
    from hf_rlloss.trainer.async_.attention import TREE_ATTENTION, tree_attention_name

    monkeypatch.setitem(__import__("sys").modules, "kernels", None)  # `import kernels` raises ImportError
    with caplog.at_level("WARNING"):
        name = tree_attention_name("auto", "cuda")
    assert name != TREE_ATTENTION and "the kernels package is not installed" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        tree_attention_name("auto", "cpu")  # SDPA is the only tree attention off CUDA: nothing falls back
    assert "kernels" not in caplog.text
