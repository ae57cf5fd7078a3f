"""Multi-turn rollouts (tools, environments) in the asynchronous trainer's CPU rollout worker
(`rollout/tool_calling/rollouts.py`).

Generation is scripted (`_tools.ScriptedToolRollout`, with sampler log-probs): half of each group calls `multiply`,
then answers with its result; the other half answers at once. The same script drives `RLLossGRPOTrainer` (TRL's
synchronous tool loop) and the worker, so that:

* the worker's samples are the synchronous trainer's rollouts: tokens, tool masks, behaviour log-probs, rewards;
* the asynchronous trainer, trained on them at lag 0, makes the synchronous trainer's update (1e-6), and a tool token
  leaking into the loss breaks that;
* the rollout IS weights of a multi-turn sample equal an independent computation over its model tokens;
* bad input gets a named error, or is counted: a tool that raises or hangs, a reply that exceeds the context, a
  malformed tool call; a bad configuration is refused at construction.
"""

from __future__ import annotations

import math
import queue
import re
import time

import numpy as np
import pytest
import torch
from _async import ASYNC_ARGS, PARITY_RL_LOSS, FixedRolloutWorker, NoWeightTransfer
from _tools import (
    PAIRS,
    MultiplyEnvironment,
    ScriptedToolRollout,
    ScriptedWorkerLoop,
    multiply,
    product_rows,
    reward_correct,
    tool_model,
)
from _trainer_utils import BASE_ARGS, trainable_snapshot
from datasets import Dataset
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer, RLLossGRPOConfig, RLLossGRPOTrainer
from hf_rlloss.trainer.async_.rollout import (
    ContextOverflowError,
    HFGenerateLoop,
    HFGenerateRolloutWorker,
    MalformedToolCallError,
    NonFiniteRewardError,
    QueueWeightTransfer,
    RolloutWorkerDiedError,
    ToolRaisedError,
    ToolTimeoutError,
)
from hf_rlloss.trainer.async_grpo_trainer import portable_async_trl

torch.set_num_threads(1)

TOLERANCE = 1e-6
RL_LOSS = PARITY_RL_LOSS
OPTIONS = dict(
    optim="sgd",
    learning_rate=0.05,
    max_grad_norm=0.0,
    max_steps=3,
    lr_scheduler_type="constant",
    max_completion_length=160,
    max_tool_calling_iterations=2,
    gradient_accumulation_steps=1,
)


rows = product_rows  # chat rows with their product column


def worker_loop(policy, tok, args, script=None, dataset=None, **options) -> HFGenerateLoop:
    """The worker's loop in this process, its policy loaded, version 1, generating with `script` (default: the
    scripted tool rollout with log-probs)."""
    worker = HFGenerateRolloutWorker(policy, dataset or rows(PAIRS), [reward_correct], tok, args, **options)
    loop = HFGenerateLoop(worker._settings, None, queue.Queue(), None, None, None)
    loop.load()
    loop.version = 1
    script = script or ScriptedToolRollout(loop.s.tokenizer, logprobs=True)
    loop._generate_ids = lambda prompt_ids, seed, budgets=None: script(prompt_ids)
    return loop


def drain(metrics_queue) -> dict:
    out = {}
    while not metrics_queue.empty():
        for key, value in metrics_queue.get_nowait().items():
            out.setdefault(key, []).append(value)
    return out


class _Record:
    """Wraps `RLLossGRPOTrainer._generate_and_score_completions`; keeps the batches it returns."""

    def __init__(self, trainer):
        self.inner, self.batches = trainer._generate_and_score_completions, []

    def __call__(self, *args, **kwargs):
        batch = self.inner(*args, **kwargs)
        self.batches.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()})
        return batch


@pytest.fixture(scope="module")
def sync_run(tool_tok, tmp_path_factory):
    return _sync_run(tool_tok, tmp_path_factory.mktemp("sync"), RL_LOSS)


def _sync_run(tool_tok, out, rl_loss):
    """`RLLossGRPOTrainer` on the scripted tool rollouts, 3 steps of one prompt × 4: its generation batches, the
    prompts it drew (in order), and its parameters before and after."""
    args = RLLossGRPOConfig(output_dir=str(out), rl_loss=rl_loss, **{**BASE_ARGS, **OPTIONS, "scale_rewards": "none"})
    trainer = RLLossGRPOTrainer(tool_model(tool_tok), reward_correct, args=args,
                                train_dataset=Dataset.from_list(rows(PAIRS * 4)), processing_class=tool_tok,
                                tools=[multiply])  # fmt: skip
    trainer._generate_single_turn = ScriptedToolRollout(tool_tok, logprobs=True)
    recorder = trainer._generate_and_score_completions = _Record(trainer)
    before = trainable_snapshot(trainer.model)
    trainer.train()
    drawn = []
    for batch in recorder.batches:
        text = tool_tok.decode(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()])
        drawn.append(tuple(map(int, re.findall(r"(\d+) times (\d+)", text)[-1])))
    return recorder.batches, drawn, before, trainable_snapshot(trainer.model)


def async_args(tmp_path, rl_loss=RL_LOSS, **options) -> RLLossAsyncGRPOConfig:
    return RLLossAsyncGRPOConfig(output_dir=str(tmp_path), rl_loss=rl_loss, **{**ASYNC_ARGS, **OPTIONS, **options})


def _worker_samples(tool_policy, tool_tok, drawn, tmp_path) -> list[RolloutSample]:
    """The worker's samples of the prompts `drawn`, scaled as the synchronous run (`scale_rewards="none"`)."""
    args = async_args(tmp_path, scale_rewards="none")
    loop = worker_loop(tool_policy, tool_tok, args, dataset=rows(drawn), tools=[multiply])
    return [sample for _ in drawn for sample in loop._generate_batch()]


def test_worker_builds_the_synchronous_trainers_rollouts(sync_run, tool_policy, tool_tok, tmp_path):
    """Tokens (prompt, model turns, tool replies), the tool mask, the behaviour log-probs of the model's tokens and the
    rewards of the worker's samples are those of RLLossGRPOTrainer's batches (TRL's loop, the same script)."""
    batches, drawn, _, _ = sync_run
    samples = _worker_samples(tool_policy, tool_tok, drawn, tmp_path)
    assert len(samples) == 4 * len(batches)
    multi_turn = 0
    for step, batch in enumerate(batches):
        for i in range(4):
            sample = samples[4 * step + i]
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
            kept = batch["completion_mask"][i].bool()
            completion = batch["completion_ids"][i][kept].tolist()
            assert sample.input_ids.tolist() == prompt + completion
            mask = sample.completion_mask[len(prompt) :]
            assert mask.tolist() == batch["tool_mask"][i][kept].tolist()
            assert sample.completion_mask[: len(prompt)].sum() == 0
            model = torch.tensor(mask, dtype=torch.bool)
            expected = batch["sampling_per_token_logps"][i][kept][model]
            assert torch.allclose(torch.tensor(sample.old_log_probs[len(prompt) :])[model], expected)
            assert (sample.old_log_probs[len(prompt) :][~model.numpy()] == 0).all()  # replies: no behaviour log-prob
            multi_turn += int((mask == 0).any())
        advantages = np.array([s.advantage for s in samples[4 * step : 4 * step + 4]])
        assert np.allclose(advantages, batch["advantages"].numpy(), atol=1e-6)  # both scale_rewards="none"
    assert multi_turn == 2 * len(batches)  # half of each group called the tool
    assert {s.metrics["tools/call_frequency"] for s in samples} == {0.0, 1.0}


def _async_update(tool_policy, tool_tok, samples, tmp_path, rl_loss=RL_LOSS, **options):
    with portable_async_trl():
        args = async_args(tmp_path, rl_loss, max_staleness=1, **options)
        trainer = RLLossAsyncGRPOTrainer(tool_policy, [], args, rows(PAIRS), tool_tok,
                                         rollout_worker=FixedRolloutWorker(samples),
                                         weight_transfer=NoWeightTransfer())  # fmt: skip
    before = trainable_snapshot(trainer.model)
    trainer.train()
    return trainer, before, trainable_snapshot(trainer.model)


def _max_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("leak", [False, True], ids=["masked", "tool_tokens_leak"])
def test_async_trainer_on_multi_turn_samples_makes_the_synchronous_update(
    sync_run, tool_policy, tool_tok, tmp_path, leak
):
    """At lag 0, on the worker's multi-turn samples (with the synchronous trainer's advantages), the asynchronous
    trainer's parameters after 3 steps equal the synchronous trainer's. With the tool replies' tokens marked trainable
    (a leak), they do not: the comparison sees the mask."""
    _check_async_equals_sync(sync_run, tool_policy, tool_tok, tmp_path, leak, RL_LOSS)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_every_aggregation_mode_over_turns_as_the_synchronous_trainer(tool_policy, tool_tok, tmp_path, agg):
    """The other aggregation modes (token-mean: the test above) see a conversation's turns as one sequence of model
    tokens alike in both trainers."""
    rl_loss = {**RL_LOSS, "loss_agg_mode": agg}
    run = _sync_run(tool_tok, tmp_path / "sync", rl_loss)
    _check_async_equals_sync(run, tool_policy, tool_tok, tmp_path, False, rl_loss)


def _check_async_equals_sync(sync_run, tool_policy, tool_tok, tmp_path, leak, rl_loss):
    batches, drawn, before, sync_after = sync_run
    samples = _worker_samples(tool_policy, tool_tok, drawn, tmp_path / "worker")
    for k, sample in enumerate(samples):
        sample.advantage = float(batches[k // 4]["advantages"][k % 4])
        sample.model_version = k // 4 + 1  # trained at lag 0 (see test_async_grpo's parity test)
        if leak:
            sample.completion_mask = sample.completion_mask.copy()
            sample.completion_mask[int(np.argmax(sample.completion_mask)) :] = 1  # the replies too, the prompt not
    samples += samples[-4:]  # the dataloader's prefetch of a fourth step
    trainer, our_before, our_after = _async_update(tool_policy, tool_tok, samples, tmp_path / "async", rl_loss=rl_loss)
    assert _max_diff(before, our_before) == 0.0
    assert _max_diff(sync_after, before) > 1e-3
    diff = _max_diff(sync_after, our_after)
    if leak:
        assert diff > 1e-4, diff
    else:
        assert diff < TOLERANCE, diff
        logs = [h for h in trainer.state.log_history if "loss/total" in h]
        assert all(log["async/version_lag_max"] == 0.0 for log in logs)
        assert any(log["rollout_is/fraction_high"] > 0 for log in logs)


def test_rollout_is_of_a_multi_turn_sample_against_an_independent_computation(sync_run, tool_policy, tool_tok,
                                                                               tmp_path):  # fmt: skip
    """One step on the first batch: the token IS weights' statistics the trainer logs are those of ρ = π_old / μ over
    the model's tokens only (π_old: the policy's own log-probs, recomputed here by a plain forward of each sample)."""
    _, drawn, _, _ = sync_run
    samples = _worker_samples(tool_policy, tool_tok, drawn[:1], tmp_path / "worker")
    for sample in samples:
        sample.model_version = 1
    trainer, _, _ = _async_update(tool_policy, tool_tok, samples + samples, tmp_path / "async", max_steps=1)
    log = next(h for h in trainer.state.log_history if "loss/total" in h)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tool_policy, dtype=torch.float32).eval()
    rho, kl = [], []
    for sample in samples:
        ids = torch.tensor(sample.input_ids)[None]
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        trained = torch.tensor(sample.completion_mask[1:], dtype=torch.bool)
        behaviour = torch.tensor(sample.old_log_probs[1:])
        rho.append(torch.exp(logp - behaviour)[trained])
        kl.append((behaviour - logp)[trained])
    rho = torch.cat(rho).double()
    assert rho.numel() == sum(int(s.completion_mask.sum()) for s in samples)
    assert log["rollout_is/fraction_high"] == pytest.approx(float((rho > 1.02).double().mean()), abs=1e-6)
    assert log["rollout_is/mean"] == pytest.approx(float(rho.mean()), rel=1e-4)  # before truncation
    assert log["rollout_is/max"] == pytest.approx(float(rho.max()), rel=1e-4)


def _train_with_worker(tool_policy, tool_tok, tmp_path, max_steps=2, max_consecutive_empty_steps=8,
                       **worker_options):  # fmt: skip
    """RLLossAsyncGRPOTrainer with a spawned HFGenerateRolloutWorker running the scripted multi-turn rollouts."""
    args = async_args(tmp_path, max_staleness=2, max_steps=max_steps,
                      max_consecutive_empty_steps=max_consecutive_empty_steps)  # fmt: skip
    worker = HFGenerateRolloutWorker(tool_policy, rows(PAIRS), [reward_correct], tool_tok, args, **worker_options)
    worker._settings.loop_class = ScriptedWorkerLoop
    with portable_async_trl():
        transfer = QueueWeightTransfer(worker)
        trainer = RLLossAsyncGRPOTrainer(tool_policy, [reward_correct], args, rows(PAIRS), tool_tok,
                                         rollout_worker=worker, weight_transfer=transfer)  # fmt: skip
    before = trainable_snapshot(trainer.model)
    try:
        trainer.train()
    finally:
        worker.stop()
    return trainer, before, trainable_snapshot(trainer.model)


@pytest.mark.parametrize("source", ["tools", "environment_factory"])
def test_spawned_worker_trains_on_multi_turn_rollouts(tool_policy, tool_tok, tmp_path, source):
    """The whole pipeline (spawned worker, sample channel, weight queue, trainer): half of the conversations call the
    tool, a third of the forwarded tokens are masked replies or prompts, and the policy moves."""
    options = {"tools": [multiply]} if source == "tools" else {"environment_factory": MultiplyEnvironment}
    trainer, before, after = _train_with_worker(tool_policy, tool_tok, tmp_path, **options)
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    assert len(logs) == 2 and _max_diff(before, after) > 1e-4
    assert all(log["tools/call_frequency"] == 0.5 and log["rollout/turns_mean"] == 1.5 for log in logs)
    assert all(log["train_policy/valid_tokens"] > 0 and log["tools/loop_exhausted_frac"] == 0 for log in logs)


def test_a_tool_error_under_raise_stops_training_with_its_name(tool_policy, tool_tok, tmp_path):
    with pytest.raises(RolloutWorkerDiedError) as caught:
        _train_with_worker(tool_policy, tool_tok, tmp_path, tools=[multiply_badly], on_rollout_error="raise")
    assert "ToolRaisedError: tool 'multiply' raised ZeroDivisionError" in str(caught.value.__cause__)


# ------------------------------------------------------------------------------------------------------------------
# Bad input


def multiply_badly(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b // 0


multiply_badly.__name__ = "multiply"


def divide(a: int, b: int) -> float:
    """Divide two integers.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def wait(seconds: float) -> str:
    """Wait.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


class _Calls(ScriptedToolRollout):
    """Every first turn is `call` (a tool call's text); after a reply, the answer."""

    def __init__(self, tok, call: str):
        super().__init__(tok, logprobs=True)
        self.call = call

    def reply(self, text, last_user, j):
        if "<tool_response>" in last_user:
            return "It is done."
        return self.call


def _call(name: str, **arguments) -> str:
    import json

    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def _errors(tool_policy, tool_tok, tmp_path, call, policy="feed_back", tools=(divide,), **options):
    """One batch of a worker whose model always makes `call`: its samples and metrics."""
    args = async_args(tmp_path, max_completion_length=300)
    loop = worker_loop(tool_policy, tool_tok, args, _Calls(tool_tok, call), rows(PAIRS[:1]),
                       tools=list(tools), on_rollout_error=policy, **options)  # fmt: skip
    loop.s.reward_funcs, loop.s.reward_names = [_zero], ["zero"]
    samples = loop._generate_batch()
    return samples, drain(loop.metrics_queue)


def _zero(completions, **kwargs):
    return [0.0] * len(completions)


def _tool_replies(sample, tok) -> str:
    return tok.decode(sample.input_ids[sample.completion_mask == 0])


@pytest.mark.parametrize(
    "case, call, error, options",
    [
        ("raises", _call("divide", a=1, b=0), ToolRaisedError, {}),
        ("hangs", _call("wait", seconds=30), ToolTimeoutError, {"tool_timeout_s": 0.3, "tools": (wait,)}),
        ("unknown tool", _call("root", x=2), MalformedToolCallError, {}),
        ("not an object", '<tool_call>\n{"name": "divide", "arguments": [1, 2]}\n</tool_call>', MalformedToolCallError,
         {}),
        ("does not parse", '<tool_call>\n{"name": "divide", "arguments": {"a": 1,\n</tool_call>',
         MalformedToolCallError, {}),
    ],
    ids=["raises", "hangs", "unknown_tool", "arguments_not_an_object", "does_not_parse"],
)  # fmt: skip
def test_bad_tool_calls_are_named_counted_and_follow_the_policy(tool_policy, tool_tok, tmp_path, case, call, error,
                                                                options):  # fmt: skip
    """feed_back: the samples are kept, the error counted; drop: the group is dropped and counted; raise: the named
    error."""
    samples, metrics = _errors(tool_policy, tool_tok, tmp_path / "fb", call, **options)
    assert len(samples) == 4
    assert sum(metrics[f"rollout/errors/{error.kind}_total"]) == 4
    failures = 0.0 if case == "does not parse" else 1.0  # TRL's count: the call failed (none parsed: no call)
    assert [s.metrics["tools/failure_frequency"] for s in samples] == [failures] * 4
    if case == "raises":
        assert "division by zero" in _tool_replies(samples[0], tool_tok)  # TRL's feed-back, as GRPOTrainer's
    if case == "hangs":
        assert "did not return within tool_timeout_s=0.3s" in _tool_replies(samples[0], tool_tok)
    if case == "not an object":  # Python's own error, fed back as TRL does, naming the tool
        assert "divide() argument after ** must be a mapping, not list" in _tool_replies(samples[0], tool_tok)
    samples, metrics = _errors(tool_policy, tool_tok, tmp_path / "drop", call, policy="drop", **options)
    assert samples == [] and sum(metrics[f"rollout/dropped_groups/{error.kind}_total"]) == 1
    with pytest.raises(error):
        _errors(tool_policy, tool_tok, tmp_path / "raise", call, policy="raise", **options)


class HugeReplyEnvironment:
    """An environment whose tool replies with more text than the completion budget holds."""

    def reset(self, **row):
        return None

    def read(self, page: int) -> str:
        """Read a page.

        Args:
            page: The page number.
        """
        return "x" * 1000


def test_a_reply_exceeding_the_context_is_named(tool_policy, tool_tok, tmp_path):
    samples, metrics = _errors(tool_policy, tool_tok, tmp_path / "fb", _call("read", page=1), tools=(),
                               environment_factory=HugeReplyEnvironment)  # fmt: skip
    assert sum(metrics["rollout/errors/context_overflow_total"]) == 4
    assert all((s.completion_mask[s.completion_mask.nonzero()[0][0] :] == 1).all() for s in samples)  # not appended
    with pytest.raises(ContextOverflowError, match="max_completion_length=300"):
        _errors(tool_policy, tool_tok, tmp_path / "raise", _call("read", page=1), policy="raise", tools=(),
                environment_factory=HugeReplyEnvironment)  # fmt: skip


def test_environment_tools_and_reward_as_trl(tool_policy, tool_tok, tmp_path):
    """An environment_factory environment written for TRL: one instance per sample, reset with the row, its method a
    tool, its get_reward a reward column named after its class; the reward functions get `environments=`."""
    seen = {}

    class Scored(MultiplyEnvironment):
        def get_reward(self):
            return float(self.calls)

    def reward(completions, environments, **kwargs):
        seen["environments"] = environments
        return [0.0] * len(completions)

    loop = worker_loop(tool_policy, tool_tok, async_args(tmp_path), dataset=rows(PAIRS[:1]),
                       environment_factory=MultiplyEnvironment)  # fmt: skip
    loop.multiturn.reward_types = [Scored]
    loop.multiturn.pool[None] = [Scored() for _ in range(4)]
    loop.s.reward_funcs, loop.s.reward_names = [reward], ["reward"]
    samples = loop._generate_batch()
    assert [s.metrics["rewards/Scored"] for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert len({id(e) for e in seen["environments"]}) == 4
    assert sum((s.completion_mask[np.argmax(s.completion_mask) :] == 0).any() for s in samples) == 2


@pytest.mark.parametrize(
    "options, match",
    [
        ({"on_rollout_error": "ignore"}, "on_rollout_error='ignore': allowed values are"),
        ({"tool_timeout_s": 0}, "tool_timeout_s=0 must be"),
        ({"tools": [lambda a: a]}, "must be picklable"),
        ({"tools": None}, "max_tool_calling_iterations=2 without tools"),
        ({"environment_factory": dict}, "without a callable reset"),
    ],
)
def test_bad_agent_configuration_is_refused_at_construction(tool_policy, tool_tok, tmp_path, options, match):
    options = {"tools": [multiply], **options}
    with pytest.raises((ValueError, TypeError), match=match):
        HFGenerateRolloutWorker(tool_policy, rows(PAIRS), [reward_correct], tool_tok, async_args(tmp_path), **options)


def test_routing_replay_from_the_rollout_with_tools_is_refused(tool_policy, tool_tok, tmp_path):
    args = async_args(tmp_path, routing_replay="rollout")
    with pytest.raises(ValueError, match="routing_replay='rollout' with tools"):
        HFGenerateRolloutWorker(tool_policy, rows(PAIRS), [reward_correct], tool_tok, args, tools=[multiply])


def test_tools_on_the_trainer_with_an_injected_worker_are_refused(tool_policy, tool_tok, tmp_path):
    with pytest.raises(ValueError, match="pass them to the rollout worker"), portable_async_trl():
        RLLossAsyncGRPOTrainer(tool_policy, [reward_correct], async_args(tmp_path), rows(PAIRS), tool_tok,
                               tools=[multiply], rollout_worker=FixedRolloutWorker([]),
                               weight_transfer=NoWeightTransfer())  # fmt: skip


def test_a_run_dropping_every_group_ends_in_a_named_error_within_its_bound(tool_policy, tool_tok, tmp_path):
    """A tool that always fails, under "drop": every group is dropped. The spawned worker stops after
    max_consecutive_empty_steps (2) steps' worth of groups dropped in a row, and the trainer raises it by name, instead
    of waiting for ever on a worker that makes empty batches (and, formerly, ticked its heartbeat)."""
    start = time.monotonic()
    with pytest.raises(RolloutWorkerDiedError) as caught:
        _train_with_worker(tool_policy, tool_tok, tmp_path, tools=[multiply_badly], on_rollout_error="drop",
                           max_consecutive_empty_steps=2)  # fmt: skip
    cause = str(caught.value.__cause__)
    assert "NoRolloutSamplesError: the last 2 prompt groups were all dropped" in cause, cause
    assert "tool_raised: 2" in cause
    assert time.monotonic() - start < 90.0


class NaNRewardEnvironment(MultiplyEnvironment):
    """An environment whose `get_reward` is NaN for the conversations that called its tool."""

    def get_reward(self):
        return math.nan if self.calls else 1.0


@pytest.mark.parametrize("policy", ["feed_back", "drop", "raise"])
def test_a_non_finite_environment_reward_is_counted_and_follows_the_policy(tool_policy, tool_tok, tmp_path, policy):
    loop = worker_loop(tool_policy, tool_tok, async_args(tmp_path), dataset=rows(PAIRS[:1]),
                       environment_factory=NaNRewardEnvironment, on_rollout_error=policy)  # fmt: skip
    if policy == "raise":
        with pytest.raises(NonFiniteRewardError, match="NaNRewardEnvironment returned nan"):
            loop._generate_batch()
        return
    samples = loop._generate_batch()
    metrics = drain(loop.metrics_queue)
    assert sum(metrics["rollout/errors/nonfinite_reward_total"]) == 2  # the two conversations that called the tool
    if policy == "drop":
        assert samples == [] and sum(metrics["rollout/dropped_groups/nonfinite_reward_total"]) == 1
    else:  # the environment's column left unscored (as TRL's skipped reward), and said so
        column = [s.metrics["rewards/NaNRewardEnvironment"] for s in samples]
        assert [math.isnan(r) for r in column] == [True, False, True, False]
        assert all(math.isfinite(s.advantage) for s in samples)
