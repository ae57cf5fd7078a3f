"""Resuming `RLLossAsyncGRPOTrainer` with `HFGenerateRolloutWorker` from a checkpoint (`async_/resume.py`).

* With `fixed_lag` the policy version of each batch is a function of its index, so a run is repeatable: interrupted
  at a checkpoint and resumed, it trains bit-exactly the parameters of the uninterrupted run, from the same samples
  (prompts, completions, log-probs, versions).
* Without it, the resumed worker still starts at the first untrained prompt, and the version counter goes on exactly
  (the resumed run ends at the uninterrupted run's version).

The worker's loop runs in a thread of the test's process (`ThreadedWorker`: the same loop, channels and weight
transfer as the spawned process, without a Python start-up per run).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from _async import ASYNC_ARGS
from _trainer_utils import make_dataset, reward_length, trainable_snapshot
from transformers import AutoModelForCausalLM

from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker, QueueWeightTransfer
from hf_rlloss.trainer.async_.rollout.loop import worker_main
from hf_rlloss.trainer.async_.staleness import version_for_batch

torch.set_num_threads(1)

SGD = dict(optim="sgd", learning_rate=0.05, max_grad_norm=0.0, lr_scheduler_type="constant")


class ThreadedWorker(HFGenerateRolloutWorker):
    """`HFGenerateRolloutWorker` whose loop runs in a thread; records every sample the trainer pulls.

    A thread shares the process' RNG with the trainer, and a resumed trainer sets it (`_load_rng_state`) after it
    starts the worker: the loop therefore starts when the trainer first asks for a sample, after that. (The worker's
    process has an RNG of its own.)"""

    def start(self) -> None:
        self.pulled = []
        asked = threading.Event()
        get = self.rollout_buffer.get

        def recording_get(*args, **kwargs):
            asked.set()
            sample = get(*args, **kwargs)
            self.pulled.append(sample)
            return sample

        def run(*args):
            while not asked.wait(0.1):
                if self._stop.is_set():
                    return
            worker_main(*args)

        self.rollout_buffer.get = recording_get
        self._heartbeat.value = time.time()
        self._process = threading.Thread(
            target=run,
            args=(self._settings, self.rollout_buffer, self.metrics_queue, self.weights, self._stop,
                  self._ready, self._failed, self._errors, self._heartbeat),
            daemon=True,
        )  # fmt: skip
        self._process.start()

    def stop(self) -> None:
        if self._process is not None:
            self._stop.set()
            self._process.join(timeout=60)
            self._process = None


def _train(policy, tok, out, steps, fixed_lag, resume=None, weight_sync_steps=1):
    args = RLLossAsyncGRPOConfig(
        output_dir=str(out), max_steps=steps, save_steps=2, queue_maxsize=8, heartbeat_stale_after_s=120,
        rl_loss={"rollout_is": {"level": "token", "upper": 2.0}},
        weight_sync_steps=weight_sync_steps, **{**ASYNC_ARGS, **SGD, "max_staleness": 1, "save_strategy": "steps"},
    )  # fmt: skip
    worker = ThreadedWorker(policy, make_dataset(), [reward_length], tok, args, fixed_lag=fixed_lag)
    trainer = RLLossAsyncGRPOTrainer(policy, [reward_length], args, make_dataset(), tok, rollout_worker=worker,
                                     weight_transfer=QueueWeightTransfer(worker))  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    pulled = [(worker.start_group + s.group_id, s.prompt, s.model_version, s.input_ids.tolist(),
               s.old_log_probs.tolist()) for s in worker.pulled]  # fmt: skip
    return trainer, trainable_snapshot(trainer.model), pulled


@pytest.mark.parametrize("sync", [1, 3], ids=["sync-every-step", "checkpoint-between-syncs"])
def test_resume_with_fixed_lag_is_bit_exact(policy, tok, tmp_path, sync):
    """4 steps uninterrupted (checkpoints at 2 and 4) against 2 steps resumed from checkpoint-2: the same samples
    from the first untrained prompt on and equal parameters. Each batch is sampled from the policy one step older
    than its step's: with a sync every step, batch 2 from version 2, older than the checkpoint's version 3; with a
    sync every 3 steps, batches 0-3 from version 1 (the initial weights), which is not the checkpoint's policy
    either. The checkpoint saves those versions."""
    full, full_params, full_pulled = _train(policy, tok, tmp_path / "full", 4, 1, weight_sync_steps=sync)
    start = trainable_snapshot(AutoModelForCausalLM.from_pretrained(policy))
    state = json.loads((tmp_path / "full" / "checkpoint-2" / "rollout_state.json").read_text())
    # one prompt per step: 2 trained (the prompt pulled ahead for step 3 is not); version 1 (cold sync) + the syncs
    assert state["prompt_index"] == 2 and state["model_version"] == 1 + 2 // sync
    assert sorted(state["rollout_weights"]) == {1: ["2", "3"], 3: ["1"]}[sync]
    batches = range(len(full_pulled) // 4)
    assert [s[2] for s in full_pulled[::4]] == [version_for_batch(b, 1, sync) for b in batches]

    resumed, resumed_params, resumed_pulled = _train(
        policy, tok, tmp_path / "resumed", 4, 1, resume=str(tmp_path / "full" / "checkpoint-2"), weight_sync_steps=sync
    )
    assert resumed.state.global_step == 4
    after = [s for s in full_pulled if s[0] >= state["prompt_index"]]
    assert len(resumed_pulled) >= 8 and resumed_pulled == after[: len(resumed_pulled)]
    prompts = make_dataset()["prompt"]
    assert [s[1] for s in resumed_pulled[::4]] == prompts[2 : 2 + len(resumed_pulled) // 4]
    assert full_params.keys() == resumed_params.keys() == start.keys()
    assert max((full_params[k] - start[k]).abs().max().item() for k in start) > 1e-3  # training moved them
    assert all(torch.equal(full_params[k], resumed_params[k]) for k in full_params)
    assert resumed.model_version == full.model_version == 1 + 4 // sync
    # the loss layer's metrics of steps 3-4 (the resumed run's history holds steps 1-2 from the checkpoint); TRL's
    # collator metrics (`reward`) also count the micro-batch pulled ahead, which a resumed run pulls twice
    keys = ("loss/total", "async/version_lag_mean", "rollout_is/mean", "train_policy/valid_tokens")
    full_logs, resumed_logs = _step_logs(full), _step_logs(resumed)
    assert len(full_logs) == len(resumed_logs) == 4
    assert [[log[k] for k in keys] for log in full_logs] == [[log[k] for k in keys] for log in resumed_logs]


def _step_logs(trainer):
    return [log for log in trainer.state.log_history if "loss/total" in log]


def test_resume_without_fixed_lag_restores_the_position_and_the_version(policy, tok, tmp_path):
    """The worker sampling from the newest weights (which version samples what depends on timing): 4 steps
    uninterrupted (checkpoints at 2 and 4) and 2 steps resumed from checkpoint-2. The resumed worker serves the
    prompts from the first untrained one; the cold sync sends the checkpoint's weights as the version they are (3,
    the saved counter), not as a new one, so the resumed run's version counter ends where the uninterrupted run's
    does (an initial sync counted again would end one version ahead)."""
    full, _, _ = _train(policy, tok, tmp_path / "full", 4, fixed_lag=None)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    state = json.loads((checkpoint / "rollout_state.json").read_text())
    assert state == {"prompt_index": 2, "model_version": 3}
    resumed, _, pulled = _train(policy, tok, tmp_path / "resumed", 4, fixed_lag=None, resume=str(checkpoint))
    assert resumed._groups_before_resume == 2  # TRL's epoch count goes on from there
    groups = [s[0] for s in pulled[::4]]
    assert len(groups) >= 2 and groups == list(range(2, 2 + len(groups)))
    assert [s[1] for s in pulled[::4]] == make_dataset()["prompt"][2 : 2 + len(groups)]
    assert min(s[2] for s in pulled) == state["model_version"]  # the checkpoint's weights, under their version
    assert resumed.model_version == full.model_version == 1 + 4  # the cold sync and one sync per step


@pytest.mark.parametrize(
    "worker_kwargs, options, match",
    [
        ({"fixed_lag": 0}, {}, r"fixed_lag=0 must be an integer >= 1"),
        ({"fixed_lag": 1, "weight_lag": 1}, {}, r"weight_lag=1 and fixed_lag=1: set one of the two"),
        ({"fixed_lag": 3}, {"max_staleness": 2}, r"fixed_lag=3 .* up to 3 versions old: max_staleness=2"),
    ],
)
def test_fixed_lag_bad_input_on_the_worker(policy, tok, tmp_path, worker_kwargs, options, match):
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **{**ASYNC_ARGS, **options})
    with pytest.raises(ValueError, match=match):
        HFGenerateRolloutWorker(policy, make_dataset(), [reward_length], tok, args, **worker_kwargs)


@pytest.mark.parametrize(
    "worker_kwargs, options, match",
    [
        ({"groups_per_batch": 2}, {}, r"one rollout batch per optimizer step: .* = 8 samples, .* = 4"),
        ({}, {"num_mini_batches": 2, "max_staleness": 2}, r"fixed_lag=1 < num_mini_batches=2"),
    ],
)
def test_fixed_lag_bad_input_on_the_trainer(policy, tok, tmp_path, worker_kwargs, options, match):
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **{**ASYNC_ARGS, "max_staleness": 1, **options})
    worker = HFGenerateRolloutWorker(policy, make_dataset(), [reward_length], tok, args, fixed_lag=1, **worker_kwargs)
    with pytest.raises(ValueError, match=match):
        RLLossAsyncGRPOTrainer(policy, [reward_length], args, make_dataset(), tok, rollout_worker=worker,
                               weight_transfer=QueueWeightTransfer(worker))  # fmt: skip


def test_fixed_lag_resume_from_a_checkpoint_without_its_policy_versions_is_refused(policy, tok, tmp_path):
    from hf_rlloss.trainer.async_.resume import restore_rollout

    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), **{**ASYNC_ARGS, "max_staleness": 1})
    worker = HFGenerateRolloutWorker(policy, make_dataset(), [reward_length], tok, args, fixed_lag=1)
    with pytest.raises(ValueError, match="has no rollout_weights: it was saved by a worker without fixed_lag"):
        restore_rollout({"prompt_index": 2, "model_version": 3}, str(tmp_path), worker, QueueWeightTransfer(worker))
