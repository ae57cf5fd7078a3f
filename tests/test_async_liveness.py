"""Liveness of `RLLossAsyncGRPOTrainer` when samples cannot be trained: too stale or empty.

* A step with no trained token takes no optimizer step (Adam's momentum would still move the parameters), and says
  so in `async/skipped_empty_steps_total`.
* `max_consecutive_empty_steps` such steps in a row, or `queue_maxsize` + that many steps' worth of samples dropped
  as too stale in a row, stop training with `NoTrainableSamplesError` instead of spinning.
* A configuration under which samples can only be too stale when trained is refused at construction (the region
  itself: `test_async_staleness_region.py`).
* The CPU worker trains a completion up to its first EOS, as TRL's completion mask: nothing generate pads after it.
"""

from __future__ import annotations

import time

import pytest
import torch
from _async import ASYNC_ARGS, FixedRolloutWorker, NoWeightTransfer, fixed_samples, prompts_dataset
from _trainer_utils import make_dataset, reward_length, trainable_snapshot
from transformers import TrainerCallback

from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
from hf_rlloss.trainer.async_.rollout import HFGenerateLoop, HFGenerateRolloutWorker
from hf_rlloss.trainer.async_grpo_trainer import NoTrainableSamplesError, portable_async_trl

torch.set_num_threads(1)

ADAM = dict(optim="adamw_torch", learning_rate=1e-2, weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant")


class _Snapshots(TrainerCallback):
    """The trainable parameters after each optimizer step."""

    def __init__(self):
        self.after: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after.append(trainable_snapshot(model))


def _empty_groups(samples, groups):
    """`samples` with the completions of `groups` trained on no token (empty completions)."""
    for sample in samples:
        if sample.group_id in groups:
            sample.completion_mask[:] = 0
    return samples


def _trainer(policy, tok, tmp_path, samples, **options):
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **{**ASYNC_ARGS, **ADAM, **options})
    with portable_async_trl():
        trainer = RLLossAsyncGRPOTrainer(
            policy, [], args, prompts_dataset(), tok,
            rollout_worker=FixedRolloutWorker(samples), weight_transfer=NoWeightTransfer(),
        )  # fmt: skip
    return trainer


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_a_step_without_trained_tokens_takes_no_optimizer_step(policy, tok, tmp_path):
    """Adam, one group per step; step 2's completions are all empty. Its gradient is zero, but Adam's momentum from
    step 1 would move the parameters: the step is skipped (parameters unchanged, counted), steps 1 and 3 train."""
    samples = _empty_groups(fixed_samples(5), {1})
    trainer = _trainer(policy, tok, tmp_path, samples, max_steps=3)
    snapshots = _Snapshots()
    trainer.add_callback(snapshots)
    before = trainable_snapshot(trainer.model)
    trainer.train()
    first, second, third = snapshots.after
    assert _max_diff(first, before) > 1e-3 and _max_diff(third, second) > 1e-3
    assert _max_diff(second, first) == 0.0, "the empty step moved the parameters"
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    assert [log["train_policy/valid_tokens"] for log in logs][1] == 0
    assert [log["async/skipped_empty_steps_total"] for log in logs] == [0.0, 1.0, 0.0]


def test_consecutive_empty_steps_stop_training(policy, tok, tmp_path):
    """max_consecutive_empty_steps=2: two empty steps in a row stop training with a named error (the first is
    skipped), instead of stepping on nothing for ever."""
    samples = _empty_groups(fixed_samples(6), {1, 2, 3, 4})
    trainer = _trainer(policy, tok, tmp_path, samples, max_steps=5, max_consecutive_empty_steps=2)
    with pytest.raises(NoTrainableSamplesError, match=r"2 consecutive optimizer steps without a trained token"):
        trainer.train()
    assert trainer.state.global_step == 2  # step 1 trained, step 2 skipped, step 3 refused


def test_samples_all_too_stale_stop_training(policy, tok, tmp_path):
    """Every sample 100 versions old: each is dropped when pulled; after queue_maxsize + a worker batch (a group, for
    a worker that does not say) + max_consecutive_empty_steps steps' worth (4 + 4 + 2 × 4 samples) training stops
    with a named error, in well under TRL's 5 s poll (without the
    bound the trainer pulls and drops for as long as the worker produces)."""
    samples = fixed_samples(6, version=-100)
    trainer = _trainer(policy, tok, tmp_path, samples, max_steps=2, max_staleness=1, queue_maxsize=4,
                       max_consecutive_empty_steps=2)  # fmt: skip
    start = time.monotonic()
    with pytest.raises(NoTrainableSamplesError, match=r"the last 16 samples .* were all too stale to train"):
        trainer.train()
    assert time.monotonic() - start < 4.0


@pytest.mark.parametrize(
    "weight_lag, options, match",
    [
        (1, {"max_staleness": 1}, r"weight_lag=1, .* max_staleness=1: .* = 1 \+ 1 = 2 versions .* weight_lag <= 0"),
        (2, {"max_staleness": 1}, r"weight_lag=2, .* max_staleness=1: .* = 3 versions"),
        (5, {"max_staleness": 4}, r"weight_lag=5, .* = 6 versions .* max_staleness >= 6, or weight_lag <= 3"),
        (3, {"max_staleness": 2, "gradient_accumulation_steps": 2}, r"= 4 versions .* weight_lag <= 1"),
        (1, {"max_staleness": 1, "weight_sync_steps": 2}, r"weight_sync_steps=2, .* = 2 versions"),
        (1, {"max_staleness": 2, "num_mini_batches": 2}, r"num_mini_batches=2 .* = 1 \+ 2 = 3 versions"),
        (-1, {}, r"weight_lag=-1 must be an integer >= 0"),
    ],
)
def test_weight_lag_that_can_only_drop_samples_is_refused(policy, tok, tmp_path, weight_lag, options, match):
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **{**ASYNC_ARGS, **options})
    with pytest.raises(ValueError, match=match):
        HFGenerateRolloutWorker(policy, make_dataset(), [reward_length], tok, args, weight_lag=weight_lag)


@pytest.mark.parametrize(
    "weight_lag, options",
    [(0, {"max_staleness": 1}), (2, {"max_staleness": 3}), (0, {"max_staleness": 1, "weight_sync_steps": 2}),
     (1, {"max_staleness": 2, "weight_sync_steps": 2, "gradient_accumulation_steps": 2})],
)  # fmt: skip
def test_weight_lag_that_can_train_is_accepted(policy, tok, tmp_path, weight_lag, options):
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **{**ASYNC_ARGS, **options})
    HFGenerateRolloutWorker(policy, make_dataset(), [reward_length], tok, args, weight_lag=weight_lag)


def test_mini_batches_that_can_only_drop_samples_are_refused_by_the_config(tmp_path):
    with pytest.raises(ValueError, match=r"num_mini_batches=2 with max_staleness=1: .* = 0 \+ 2 = 2 versions"):
        RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **{**ASYNC_ARGS, "max_staleness": 1, "num_mini_batches": 2})


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_consecutive_empty_steps_below_one_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match=rf"max_consecutive_empty_steps={value!r} must be an integer >= 1"):
        RLLossAsyncGRPOConfig(output_dir=str(tmp_path), max_consecutive_empty_steps=value, **ASYNC_ARGS)


def test_cpu_worker_trains_up_to_the_first_eos_as_trl_masks(policy, tok, tmp_path):
    """Rows that end early are padded by `generate` after their EOS: the samples keep the completion up to and
    including its first EOS (TRL's completion mask: trained up to the first EOS), so no pad after an EOS is trained; a
    pad the policy sampled before any EOS is an ordinary token, as in TRL."""
    import types

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), allow_uncorrected_staleness=True, **ASYNC_ARGS)
    worker = HFGenerateRolloutWorker(policy, prompts_dataset(1), [], tok, args, record_logprobs=False)
    loop = HFGenerateLoop(worker._settings, None, None, worker.weights, None, types.SimpleNamespace(value=0.0))
    loop.load()
    loop.metrics_queue = types.SimpleNamespace(put_nowait=lambda item: None)
    pad, eos, a, b = tok.pad_token_id, tok.eos_token_id, 40, 41
    generated = [[a, eos, pad, pad], [eos, pad, pad, pad], [pad, pad, pad, pad], [a, b, a, eos]]

    def generate(input_ids, **kwargs):
        return torch.cat([input_ids, torch.tensor(generated)], dim=1)

    loop.model.generate = generate
    samples = loop._generate_batch()
    expected = [[a, eos], [eos], [pad, pad, pad, pad], [a, b, a, eos]]
    for sample, completion in zip(samples, expected, strict=True):
        prompt = int((sample.completion_mask == 0).sum())
        assert sample.input_ids[prompt:].tolist() == completion
        assert sample.completion_mask[prompt:].tolist() == [1] * len(completion)
