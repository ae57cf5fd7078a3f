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
    FixedRolloutWorker,
    NoWeightTransfer,
    fixed_samples,
    prompts_dataset,
    save_tiny_policy,
)
from _trainer_utils import (
    BASE_ARGS,
    FixedWithLogprobs,
    make_dataset,
    make_tokenizer,
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


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("policy"))


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
    rl_loss = {
        "policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
        "loss_agg_mode": "token-mean",
        "use_kl_loss": True,
        "kl_loss_type": "k3",
        "kl_loss_coef": 0.05,
        "rollout_is": {"level": "token", "mode": "truncate", "upper": 1.02},
    }
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

    # TRL's staleness filter runs when a sample is pulled, and the dataloader pulls the next step's micro-batch ahead:
    # step k's samples are pulled under version max(k, 1) (the cold sync makes the first version 1), so tagged with
    # it they are fresh and pass max_staleness=0.
    samples = _as_rollout_samples(recorder.batches + recorder.batches[-1:], version_of_step=lambda step: max(step, 1))
    options = {**ASYNC_ARGS, **SGD, "max_staleness": 0}
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


def test_negative_max_staleness_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_staleness=-1 must be an integer >= 0"):
        RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_staleness=-1)


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


def test_rollout_is_without_behaviour_logprobs_is_refused(policy, tok, tmp_path):
    """A sampler that reports no log-probs (NaN) cannot be corrected: the first step says so, naming the option."""
    samples = fixed_samples(2)
    for sample in samples:
        sample.old_log_probs[:] = np.nan
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), rl_loss={"rollout_is": {"upper": 2.0}}, max_steps=1,
                                 **ASYNC_ARGS)  # fmt: skip
    with pytest.raises(ValueError, match="rl_loss.rollout_is needs the sampler's log-probs"):
        _train_async(RLLossAsyncGRPOTrainer, args, policy, tok, samples)


# ------------------------------------------------------------------------------------------------------------------
# On CPU end to end: HF generate in its own process, weights through a shared-memory queue


@pytest.mark.slow  # a spawned process imports torch/transformers/trl (10-30 s on 2 shared cores)
def test_cpu_worker_and_queue_transfer_train(policy, tok, tmp_path):
    """Two optimizer steps with the rollout process: samples tagged with the version they were sampled from, the
    recorded log-probs equal the trainer's π_old at version lag 0 (the mismatch is round-off), the weights reach the
    worker (its later samples come from later versions)."""
    from _trainer_utils import make_dataset, reward_digit, reward_length

    from hf_rlloss.trainer.async_.cpu_rollout import HFGenerateRolloutWorker, QueueWeightTransfer

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

    from hf_rlloss.trainer.async_.cpu_rollout import HFGenerateRolloutWorker

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

    from hf_rlloss.trainer.async_.cpu_rollout import HFGenerateRolloutWorker, QueueWeightTransfer

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
    "option, value", [("vllm_server_base_url", "http://gpu:8000"), ("max_tool_calling_iterations", 3)]
)
def test_vllm_only_option_on_cpu_worker_is_refused(policy, tok, tmp_path, option, value):
    from hf_rlloss.trainer.async_.cpu_rollout import HFGenerateRolloutWorker

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{option: value})
    with pytest.raises(ValueError, match=f"{option}=.* configures TRL's vLLM rollout worker"):
        HFGenerateRolloutWorker(policy, prompts_dataset(), [], tok, args)


def test_rollout_is_with_a_worker_recording_no_logprobs_is_refused(policy, tok, tmp_path):
    from hf_rlloss.trainer.async_.cpu_rollout import HFGenerateRolloutWorker

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), rl_loss={"rollout_is": {"upper": 2.0}}, **ASYNC_ARGS)
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

    from hf_rlloss.trainer.async_.cpu_rollout import HFGenerateRolloutWorker, _WorkerLoop

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), temperature=0.8, top_k=5, top_p=0.9,
                                 rollout_logprobs_support=support, **ASYNC_ARGS)  # fmt: skip
    worker = HFGenerateRolloutWorker(policy, make_dataset(), [reward_length], tok, args, groups_per_batch=2)
    loop = _WorkerLoop(worker._settings, None, worker.metrics_queue, None, None, types.SimpleNamespace(value=0.0))
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
    np.testing.assert_allclose(advantages, (rewards - rewards.mean()) / (rewards.std() + 1e-8), rtol=1e-6)


def test_weight_lag_applies_the_first_weights_at_once_then_k_versions_late(policy, tok, tmp_path):
    """`weight_lag=2`: the cold sync's weights are used at once (nothing older exists; waiting would deadlock with
    the trainer, which waits for samples), later ones when two newer versions have arrived."""
    import queue as queues
    import types

    from hf_rlloss.trainer.async_.cpu_rollout import HFGenerateRolloutWorker, _WorkerLoop

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **ASYNC_ARGS)
    worker = HFGenerateRolloutWorker(policy, prompts_dataset(), [], tok, args, weight_lag=2)
    weights = queues.Queue()
    loop = _WorkerLoop(worker._settings, None, None, weights, None, types.SimpleNamespace(value=0.0))
    loop.load()
    state = {k: v.clone() for k, v in loop.model.state_dict().items()}
    seen = []
    for version in range(1, 6):
        weights.put((version, state))
        loop._apply_weights(block=False)
        seen.append(loop.version)
    assert seen == [1, 1, 1, 2, 3]
