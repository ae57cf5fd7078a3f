"""Tool calls in the asynchronous rollout worker (`rollout/tool_calling/runner.py`,
`rollout/tool_calling/rollouts.py`): hung tools leave nothing behind and do not read as a stalled worker, a turn cut by
the budget in a tool call is its own kind, each turn asks for the budget that remains, and the recipe's YAML reaches
every worker option.

Generation is scripted (`_tools.ScriptedToolRollout`); the worker's loop runs in this process, its policy loaded.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from _async import ASYNC_ARGS, PARITY_RL_LOSS
from _tool_functions import hang, multiply
from _tools import PAIRS, ScriptedToolRollout, product_rows, reward_correct

from hf_rlloss.trainer import RLLossAsyncGRPOConfig
from hf_rlloss.trainer.async_.rollout import (
    BudgetCutError,
    HFGenerateLoop,
    HFGenerateRolloutWorker,
    HungToolCallsError,
    NoRolloutSamplesError,
)

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dict(max_tool_calling_iterations=2, max_completion_length=160, gradient_accumulation_steps=1)


rows = product_rows  # chat rows with their product column


def make_worker(policy, tok, tmp_path, pairs=PAIRS[:1], **options) -> HFGenerateRolloutWorker:
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), rl_loss=PARITY_RL_LOSS,
                                 **{**ASYNC_ARGS, **OPTIONS, **options.pop("args", {})})  # fmt: skip
    return HFGenerateRolloutWorker(policy, rows(pairs), [reward_correct], tok, args, **options)


def worker_loop(worker, script, heartbeat=None) -> HFGenerateLoop:
    """`worker`'s loop in this process, its policy loaded, version 1, generating with `script`."""
    loop = HFGenerateLoop(worker._settings, None, queue.Queue(), None, None, heartbeat)
    loop.load()
    loop.version = 1
    loop._generate_ids = lambda prompt_ids, seed, budgets=None: script(prompt_ids, budgets)
    return loop


def drain(metrics_queue) -> dict:
    out = {}
    while not metrics_queue.empty():
        for key, value in metrics_queue.get_nowait().items():
            out[key] = out.get(key, 0.0) + (value if isinstance(value, float) else 0.0)
    return out


class Script(ScriptedToolRollout):
    """Every first turn is `call`; after a reply, the answer. Cuts each completion to its budget (as a sampler
    does), and records the budgets asked for."""

    def __init__(self, tok, call: str, eos: bool = True):
        super().__init__(tok, logprobs=True)
        self.call, self.eos, self.budgets = call, eos, []

    def reply(self, text, last_user, j):
        return "It is done." if "<tool_response>" in last_user else self.call

    def __call__(self, prompt_ids, budgets=None):
        self.budgets.append(list(budgets or []))
        completions, logprobs = super().__call__(prompt_ids)
        if not self.eos:  # the call's text without its end of turn: cut by the budget
            completions = [c[:-1] for c in completions]
        if budgets:
            completions = [c[:b] for c, b in zip(completions, budgets)]
            logprobs = [lp[: len(c)] for lp, c in zip(logprobs, completions)]
        return completions, logprobs


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


# ------------------------------------------------------------------------------------------------------------------
# Hung tools


def _census() -> tuple[int, int, int]:
    """This process's threads, its tool processes (children other than multiprocessing's helpers) and RSS (bytes)."""
    me = psutil.Process()
    tools = [c for c in me.children(recursive=True) if "forkserver" not in " ".join(c.cmdline())
             and "resource_tracker" not in " ".join(c.cmdline())]  # fmt: skip
    return threading.active_count(), len(tools), me.memory_info().rss


def test_hung_tools_leave_no_thread_process_or_memory_over_30_batches(tool_policy, tool_tok, tmp_path):
    """Every conversation calls a tool that never returns (tool_timeout_s=0.1): each batch's 4 calls time out side by
    side and their processes are killed. Threads, tool processes and RSS after batch 30 are those after batch 5."""
    worker = make_worker(tool_policy, tool_tok, tmp_path, tools=[hang], tool_timeout_s=0.1)
    loop = worker_loop(worker, Script(tool_tok, call("hang", seconds=3600)))
    loop.s.reward_funcs, loop.s.reward_names = [_zero], ["zero"]
    census, start = {}, time.monotonic()
    for batch in range(1, 31):
        assert len(loop._generate_batch()) == 4
        if batch in (5, 30):
            census[batch] = _census()
    metrics = drain(loop.metrics_queue)
    assert metrics["rollout/errors/tool_timeout_total"] == 120  # every call timed out, and was counted
    (threads5, tools5, rss5), (threads30, tools30, rss30) = census[5], census[30]
    assert threads30 == threads5 and tools5 <= 4 and tools30 <= 4, census
    assert rss30 - rss5 < 2 * 2**20, census
    assert time.monotonic() - start < 60  # 4 hung calls side by side: about one timeout per batch
    loop.multiturn.close()


class HangingEnvironment:
    """An environment whose tool waits for `RELEASE` (set at the end of the test: its threads then end)."""

    release = threading.Event()

    def reset(self, **row):
        return None

    def wait(self, seconds: float) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        self.release.wait(seconds)
        return "done"


def _zero(completions, **kwargs):
    return [0.0] * len(completions)


def test_hung_environment_threads_are_bounded_by_a_named_error(tool_policy, tool_tok, tmp_path):
    """An environment's method runs in the rollout process (its state lives there) and cannot be killed: past
    max_hung_tool_threads hung calls the worker stops with HungToolCallsError, naming the bound."""
    worker = make_worker(tool_policy, tool_tok, tmp_path, tools=None, environment_factory=HangingEnvironment,
                         tool_timeout_s=0.1, max_hung_tool_threads=3)  # fmt: skip
    loop = worker_loop(worker, Script(tool_tok, call("wait", seconds=3600)))
    loop.s.reward_funcs, loop.s.reward_names = [_zero], ["zero"]
    try:
        assert len(loop._generate_batch()) == 4  # 4 calls timed out: 4 threads left running
        assert drain(loop.metrics_queue)["rollout/errors/tool_timeout_total"] == 4
        with pytest.raises(HungToolCallsError, match="max_hung_tool_threads=3"):
            loop._generate_batch()
        assert sum(thread.name == "tool-wait" for thread in threading.enumerate()) == 4  # none started past it
    finally:
        HangingEnvironment.release.set()


def test_a_healthy_batch_with_hung_calls_is_not_called_stalled(tool_policy, tool_tok, tmp_path):
    """8 hung calls in a batch, tool_timeout_s=0.25, heartbeat_stale_after_s=1: one after another they would take
    2 s without a heartbeat (8 > 1 / 0.25); side by side, each ending ticks it, and the health check passes
    throughout."""
    worker = make_worker(tool_policy, tool_tok, tmp_path, pairs=PAIRS[:2], tools=[hang], tool_timeout_s=0.25,
                         args={"per_device_train_batch_size": 8})  # fmt: skip
    loop = worker_loop(worker, Script(tool_tok, call("hang", seconds=3600)), heartbeat=worker._heartbeat)
    loop.s.reward_funcs, loop.s.reward_names = [_zero], ["zero"]
    loop._generate_batch()  # warm: the tool processes' fork server started
    failures, done = [], threading.Event()

    def watch():
        while not done.is_set():
            try:
                worker.check_health(1.0)
            except RuntimeError as error:
                failures.append(str(error))
            time.sleep(0.02)

    worker._heartbeat.value = time.time()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        samples = loop._generate_batch()
    finally:
        done.set()
        watcher.join()
    assert len(samples) == 8 and failures == []
    loop.multiturn.close()


# ------------------------------------------------------------------------------------------------------------------
# The completion budget


def _budget_run(tool_policy, tool_tok, tmp_path, policy, **options):
    worker = make_worker(tool_policy, tool_tok, tmp_path, tools=[multiply], on_rollout_error=policy,
                         args={"max_completion_length": 24}, **options)  # fmt: skip
    loop = worker_loop(worker, Script(tool_tok, call("multiply", a=123456, b=654321), eos=False))
    loop.s.reward_funcs, loop.s.reward_names = [_zero], ["zero"]
    return loop


def test_a_turn_cut_in_a_tool_call_is_a_budget_cut_that_drop_treats_as_chosen(tool_policy, tool_tok, tmp_path):
    """The budget (24 tokens) runs out in the middle of `<tool_call>`: counted as budget_cut, not malformed. Under
    drop it is trained (on_budget_cut="keep", the default) or its group dropped ("rollout_error"); under raise with
    "rollout_error", the named error."""
    loop = _budget_run(tool_policy, tool_tok, tmp_path / "keep", "drop")
    samples = loop._generate_batch()
    metrics = drain(loop.metrics_queue)
    assert len(samples) == 4 and all(len(s.input_ids) - s.completion_mask.argmax() == 24 for s in samples)
    assert metrics["rollout/errors/budget_cut_total"] == 4
    assert "rollout/errors/malformed_tool_call_total" not in metrics
    assert not any(key.startswith("rollout/dropped_groups/") for key in metrics)
    loop = _budget_run(tool_policy, tool_tok, tmp_path / "error", "drop", on_budget_cut="rollout_error")
    assert loop._generate_batch() == []
    assert drain(loop.metrics_queue)["rollout/dropped_groups/budget_cut_total"] == 1
    loop.s.max_dropped_groups = 2
    with pytest.raises(NoRolloutSamplesError, match="on_budget_cut='keep'"):
        loop._generate_batch()
    loop = _budget_run(tool_policy, tool_tok, tmp_path / "raise", "raise", on_budget_cut="rollout_error")
    with pytest.raises(BudgetCutError, match="on_budget_cut='rollout_error'"):
        loop._generate_batch()


def test_on_budget_cut_is_validated_at_construction(tool_policy, tool_tok, tmp_path):
    with pytest.raises(ValueError, match=r"on_budget_cut='drop': allowed values are \('keep', 'rollout_error'\)"):
        make_worker(tool_policy, tool_tok, tmp_path, tools=[multiply], on_budget_cut="drop")


def test_each_turn_asks_for_the_budget_that_remains(tool_policy, tool_tok, tmp_path):
    """The first turn asks for max_completion_length (160) for the 4 conversations; the turn after the tool's reply
    asks, for the 2 conversations that called it, 160 minus their completion so far (call and reply)."""
    worker = make_worker(tool_policy, tool_tok, tmp_path, tools=[multiply])
    script = ScriptedBudgets(tool_tok)
    loop = worker_loop(worker, script)
    samples = loop._generate_batch()
    assert script.budgets[0] == [160] * 4
    continued = [s for s in samples if (s.completion_mask[s.completion_mask.argmax() :] == 0).any()]
    used = []
    for s in continued:  # the completion before the answer: everything up to the last reply token
        mask = s.completion_mask[s.completion_mask.argmax() :].tolist()
        used.append(len(mask) - mask[::-1].index(0))
    assert len(continued) == 2 and script.budgets[1] == [160 - n for n in used]


class ScriptedBudgets(ScriptedToolRollout):
    def __init__(self, tok):
        super().__init__(tok, logprobs=True)
        self.budgets = []

    def __call__(self, prompt_ids, budgets=None):
        self.budgets.append(list(budgets))
        return super().__call__(prompt_ids)


def test_the_worker_samples_at_most_the_largest_budget(tool_policy, tool_tok, tmp_path):
    """The HF-generate sampler is asked for the largest of a turn's budgets (each conversation is then cut to its
    own by TRL's loop)."""
    worker = make_worker(tool_policy, tool_tok, tmp_path, tools=[multiply])
    loop = HFGenerateLoop(worker._settings, None, queue.Queue(), None, None, None)
    loop.load()
    asked = []
    generate = loop.model.generate
    loop.model.generate = lambda **kwargs: asked.append(kwargs["max_new_tokens"]) or generate(**kwargs)
    completions, _ = loop._generate_ids([[5, 6, 7], [8, 9]], seed=0, budgets=[3, 7])
    assert asked == [7] and all(len(c) <= 7 for c in completions)


# ------------------------------------------------------------------------------------------------------------------
# The recipe


def test_every_worker_option_reaches_the_worker_from_the_recipe_yaml(tool_policy, tool_tok, tmp_path):
    sys.path.insert(0, str(ROOT / "recipes"))
    import grpo_async

    options = {"tool_timeout_s": 7.5, "on_rollout_error": "drop", "on_budget_cut": "rollout_error",
               "tool_processes": 2, "max_hung_tool_threads": 5, "shared_prompt_generation": False,
               "groups_per_batch": 3, "ready_timeout": 42.0, "rollout_threads": 1, "weight_lag": 1,
               "record_rollout_logprobs": False}  # fmt: skip
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "bf16": False, "max_staleness": 3,
        "max_tool_calling_iterations": 2, "per_device_train_batch_size": 4, "num_generations": 2,
        "max_completion_length": 64, "token_budget": 0, "tools": ["add"], **options,
    }))  # fmt: skip
    types = (grpo_async.AsyncScriptArguments, grpo_async.RLLossAsyncGRPOConfig, grpo_async.AsyncModelArguments)
    script_args, training_args, _ = grpo_async.parse_args(["--config", str(config)], types=types)
    worker, _ = grpo_async.build_rollout(script_args, training_args, tool_policy, rows(PAIRS), [reward_correct],
                                         tool_tok, [multiply])  # fmt: skip
    s, agent = worker._settings, worker._settings.agent
    assert (agent.tool_timeout_s, agent.on_rollout_error, agent.on_budget_cut, agent.tool_processes,
            agent.max_hung_tool_threads) == (7.5, "drop", "rollout_error", 2, 5)  # fmt: skip
    assert (s.shared_prompt_generation, s.groups_per_batch, worker._ready_timeout, s.threads, s.weight_lag,
            s.record_logprobs) == (False, 3, 42.0, 1, 1, False)  # fmt: skip
