"""Asynchronous GRPO with the hf_rlloss loss layer: generation and training side by side, on any machine.

    accelerate launch --config_file accelerate_configs/single_process.yaml recipes/grpo_async.py \\
        --config recipes/smollm2_135m/arithmetic/config_async.yaml

The trainer (`RLLossAsyncGRPOTrainer`, TRL's async trainer with the loss layer) runs in the launched process; without
`vllm: true` a second process (`HFGenerateRolloutWorker`) samples with HF `generate` from its own copy of the policy,
which the trainer updates through a shared-memory queue every `weight_sync_steps`. With `vllm: true` TRL's own vLLM
worker and NCCL weight transfer are used unchanged (a vLLM server at `vllm_server_base_url`). Every YAML key is a
field of `AsyncScriptArguments`, `RLLossAsyncGRPOConfig` or `AsyncModelArguments`; the data, rewards, model
resolution and run summary are `recipes/grpo.py`'s.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import torch
from accelerate import PartialState
from grpo import GRPOScriptArguments, load_data, parse_args, setup_logging
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from hf_rlloss import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
from hf_rlloss.recipe_support.assets import resolve_model
from hf_rlloss.recipe_support.callbacks import MetricsPlotCallback, RunSummaryCallback
from hf_rlloss.recipe_support.cpu_precision import usable_cpu_count
from hf_rlloss.recipe_support.heldout import evaluate_completions
from hf_rlloss.recipe_support.rewards import get_reward_funcs
from hf_rlloss.recipe_support.tools import (
    addition_conversations,
    evaluate_with_tools,
    get_tools,
    warm_up_tool_calls,
    with_tool_template,
)
from hf_rlloss.trainer.async_.rollout import AgentSpec

logger = logging.getLogger(__name__)


@dataclass
class AsyncScriptArguments(GRPOScriptArguments):
    """`GRPOScriptArguments` plus the rollout side.

    Args:
        vllm (`bool`, *optional*, defaults to `False`): generate with TRL's vLLM worker (a running vLLM server, NCCL
            weight sync) instead of HF `generate` in a second process.
        rollout_threads (`int`, *optional*, defaults to `1`): torch threads of the HF-generate process.
        weight_lag (`int`, *optional*, defaults to `0`): the HF-generate process applies the trainer's weights this
            many versions late (forces staleness, for experiments).
        record_rollout_logprobs (`bool`, *optional*, defaults to `True`): the HF-generate process records the
            sampled tokens' log-probs (rollout IS and the mismatch metrics need them).
        fixed_lag (`int`, *optional*): the HF-generate process samples the batch of step `t` from exactly the
            policy after step `t − 1 − fixed_lag` (`HFGenerateRolloutWorker(fixed_lag=...)`): a repeatable run that
            resumes from a checkpoint (`resume_from_checkpoint`) bit-exactly.
        vllm_engine (`bool`, *optional*, defaults to `False`): the rollout process samples with a vLLM engine
            (`VLLMRolloutWorker`, any machine with vLLM installed, its CPU build included) instead of HF `generate`.
        tools (`list[str]`, *optional*, defaults to `[]`): tools from `hf_rlloss.recipe_support.tools.TOOLS`: the
            rollout process runs TRL's tool-calling loop (`max_tool_calling_iterations` calls at most); a tokenizer
            whose chat template renders no tools gets `CHATML_TOOL_TEMPLATE` (ChatML models such as SmolLM2).
        on_rollout_error (`str`, *optional*, defaults to `"feed_back"`): what a conversation that met a tool error
            becomes: `"feed_back"`, `"drop"` or `"raise"` (`AgentSpec`).
        tool_timeout_s (`float`, *optional*, defaults to `60`): how long one tool call may run.
        on_budget_cut (`str`, *optional*, defaults to `"keep"`): a turn cut by `max_completion_length` in the middle
            of a tool call: `"keep"` (trained as a truncated completion) or `"rollout_error"` (follows
            `on_rollout_error`).
        tool_processes (`int`, *optional*, defaults to `4`): processes the tools run in (a hung call is stopped with
            its process); `0`: threads of the rollout process.
        max_hung_tool_threads (`int`, *optional*, defaults to `16`): timed-out tool calls still running in threads
            beyond which the rollout process stops (`HungToolCallsError`).
        shared_prompt_generation (`bool`, *optional*, defaults to `True`): the rollout process prefills each prompt
            once for its `num_generations` completions.
        groups_per_batch (`int`, *optional*): prompts per `generate` call of the rollout process; defaults to one
            optimizer step's worth.
        ready_timeout (`float`, *optional*, defaults to `600`): seconds to wait for the rollout process to load.
        vllm_engine_max_model_len (`int`, *optional*): `VLLMRolloutWorker`'s `max_model_len` (the engine's context).
        vllm_engine_kv_cache_gib (`int`, *optional*, defaults to `1`): `VLLMRolloutWorker`'s `kv_cache_gib`.
        tool_warmup_steps (`int`, *optional*, defaults to `0`): with `tools`, fine-tune the policy this many steps
            on worked tool conversations of training problems before GRPO (`warm_up_tool_calls`: the call format,
            which a small model does not write on its own); the warmed-up policy is saved to
            `<output_dir>/tool_warmup` and trained from there.
        tool_warmup_learning_rate (`float`, *optional*, defaults to `5e-5`): the warm-up's AdamW learning rate.
        heldout_samples (`int`, *optional*, defaults to `2`): completions sampled per held-out problem (at
            `temperature`) before and after training. With `tools` the held-out accuracy is their mean; without, it
            is the greedy accuracy (as the synchronous recipe's). Both are in `<output_dir>/heldout.json`, with
            every item's result.
    """

    vllm: bool = field(default=False, metadata={"help": "use TRL's vLLM worker and NCCL weight transfer"})
    rollout_threads: int = field(default=1, metadata={"help": "torch threads of the HF-generate process"})
    weight_lag: int = field(default=0, metadata={"help": "apply the weights this many versions late"})
    record_rollout_logprobs: bool = field(default=True, metadata={"help": "record the sampled tokens' log-probs"})
    fixed_lag: int | None = field(default=None, metadata={"help": "sample each batch from a fixed policy version"})
    vllm_engine: bool = field(default=False, metadata={"help": "sample with VLLMRolloutWorker (a vLLM engine)"})
    tools: list[str] = field(default_factory=list, metadata={"help": "tools from recipe_support.tools.TOOLS"})
    on_rollout_error: str = field(default="feed_back", metadata={"help": "feed_back, drop or raise"})
    tool_timeout_s: float = field(default=60.0, metadata={"help": "how long one tool call may run (seconds)"})
    on_budget_cut: str = field(default="keep", metadata={"help": "a call cut by the budget: keep or rollout_error"})
    tool_processes: int = field(default=4, metadata={"help": "processes the tools run in; 0: threads"})
    max_hung_tool_threads: int = field(default=16, metadata={"help": "hung tool threads before the worker stops"})
    shared_prompt_generation: bool = field(default=True, metadata={"help": "prefill each prompt once per group"})
    groups_per_batch: int | None = field(default=None, metadata={"help": "prompts per generate call"})
    ready_timeout: float = field(default=600.0, metadata={"help": "seconds to wait for the rollout process"})
    vllm_engine_max_model_len: int | None = field(default=None, metadata={"help": "VLLMRolloutWorker's context"})
    vllm_engine_kv_cache_gib: int = field(default=1, metadata={"help": "VLLMRolloutWorker's KV cache (GiB)"})
    tool_warmup_steps: int = field(default=0, metadata={"help": "steps teaching the tool-call format first"})
    tool_warmup_learning_rate: float = field(default=5e-5, metadata={"help": "learning rate of the tool warm-up"})
    heldout_samples: int = field(default=2, metadata={"help": "sampled completions per held-out problem"})

    def __post_init__(self):
        if self.vllm and self.vllm_engine:
            raise ValueError("vllm and vllm_engine: choose one (TRL's vLLM server worker, or VLLMRolloutWorker)")
        if self.tools and self.vllm:
            raise ValueError(
                "tools with vllm=true: TRL's vLLM worker takes its own tool options; this recipe "
                "passes tools to VLLMRolloutWorker (vllm_engine: true) or HFGenerateRolloutWorker"
            )
        if self.tool_warmup_steps < 0 or (self.tool_warmup_steps and not self.tools):
            raise ValueError(f"tool_warmup_steps={self.tool_warmup_steps}: an integer >= 0, and > 0 only with tools")


@dataclass
class AsyncModelArguments:
    """The policy. TRL's `ModelConfig` is not used: its `dtype` clashes with `AsyncGRPOConfig.dtype`, which is the
    one TRL's async trainer loads the model with (and LoRA is not offered by this recipe).

    Args:
        model_name_or_path (`str`): a `builtin:` model, a hub id or a local folder.
        model_revision (`str`, *optional*, defaults to `"main"`): the hub revision.
    """

    model_name_or_path: str = field(default="builtin:smollm2-135m-instruct", metadata={"help": "the policy"})
    model_revision: str = field(default="main", metadata={"help": "hub revision"})


def build_rollout(script_args, training_args, model_path, dataset, reward_funcs, tokenizer, tools=()):
    """The rollout worker and weight transfer: `None, None` for TRL's vLLM worker, else a worker process
    (`VLLMRolloutWorker` or `HFGenerateRolloutWorker`) and its shared-memory weight queue."""
    if script_args.vllm:
        return None, None
    from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker, QueueWeightTransfer

    worker_class, engine = HFGenerateRolloutWorker, {}
    if script_args.vllm_engine:
        from hf_rlloss.trainer.async_.rollout import VLLMRolloutWorker as worker_class

        engine = {"max_model_len": script_args.vllm_engine_max_model_len,
                  "kv_cache_gib": script_args.vllm_engine_kv_cache_gib}  # fmt: skip
    worker = worker_class(
        model_path, dataset, reward_funcs, tokenizer, training_args, **engine, **worker_options(script_args),
        tools=list(tools) or None,
    )  # fmt: skip
    return worker, QueueWeightTransfer(worker)


def worker_options(script_args) -> dict:
    """The rollout worker's keyword arguments that `AsyncScriptArguments` sets (all but the data, the tools and the
    vLLM engine's)."""
    s = script_args
    return dict(
        record_logprobs=s.record_rollout_logprobs, shared_prompt_generation=s.shared_prompt_generation,
        groups_per_batch=s.groups_per_batch, weight_lag=s.weight_lag, fixed_lag=s.fixed_lag,
        threads=s.rollout_threads, ready_timeout=s.ready_timeout, tool_timeout_s=s.tool_timeout_s,
        on_rollout_error=s.on_rollout_error, on_budget_cut=s.on_budget_cut, tool_processes=s.tool_processes,
        max_hung_tool_threads=s.max_hung_tool_threads,
    )  # fmt: skip


def warm_up_tools(script_args, training_args, model_path, tokenizer, train, tools) -> str:
    """Stage 2b: the tool warm-up on worked conversations of the first training problems; the warmed-up policy's
    path (`<output_dir>/tool_warmup`, written by the main process)."""
    out = os.path.join(training_args.output_dir, "tool_warmup")
    state = PartialState()
    if state.is_main_process:
        steps, batch = script_args.tool_warmup_steps, 8
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        conversations = addition_conversations(list(train.select(range(min(len(train), steps * batch)))))
        losses = warm_up_tool_calls(model, tokenizer, conversations, tools, steps, batch,
                                    script_args.tool_warmup_learning_rate)  # fmt: skip
        logger.info("tool warm-up: %d steps, loss %.3f -> %.3f", steps, losses[0], losses[-1])
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    state.wait_for_everyone()
    return out


def heldout_evaluation(model, tokenizer, rows, tools, script_args, training_args) -> dict:
    """One held-out evaluation (`evaluate_with_tools`; without tools, `evaluate_completions`): sampled at the training
    temperature (`heldout_samples` completions per item, seeded) and greedy, with the items. The accuracy the summary
    reports is the sampled one with tools and the greedy one without (as the synchronous recipe's). Tools run in
    threads of the trainer's process (`tool_processes=0`), with the run's timeout."""
    spec = AgentSpec(tools=list(tools), max_iterations=training_args.max_tool_calling_iterations,
                     tool_timeout_s=script_args.tool_timeout_s, tool_processes=0)  # fmt: skip
    args = (model, tokenizer, rows, spec, training_args.max_completion_length)
    evaluate = evaluate_with_tools
    if not tools:
        args, evaluate = (model, tokenizer, rows, training_args.max_completion_length), evaluate_completions
    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cpu_count())  # before and after training: the rollout process is not running
    try:
        sampled = evaluate(
            *args, temperature=training_args.temperature, samples_per_item=script_args.heldout_samples,
            seed=training_args.seed,
        )  # fmt: skip
        greedy = evaluate(*args)
    finally:
        torch.set_num_threads(threads)
    items = [{"prompt": r["prompt"][-1]["content"], "answer": r["answer"]} for r in rows]
    accuracy = sampled["accuracy"] if tools else greedy["accuracy"]
    return {"accuracy": accuracy, "sampled": sampled, "greedy": greedy, "items": items}


def heldout_before(script_args, training_args, splits, tokenizer, tools, model_path) -> tuple[list, dict, str]:
    """Stage 2b: the held-out problems (the main process's; none without a test split or with `heldout_size` 0),
    their evaluation before training (with a tool warm-up: before it, `untrained`, and after it, `step_0`), and the
    path training starts from (the warmed-up policy's, with a warm-up)."""
    test = splits.get(script_args.dataset_test_split)
    heldout, evaluations = [], {}
    if script_args.heldout_size > 0 and test is not None and PartialState().is_main_process:
        heldout = list(test.select(range(min(script_args.heldout_size, len(test)))))

    def evaluate(path: str) -> dict:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return heldout_evaluation(model, tokenizer, heldout, tools, script_args, training_args)

    if tools and script_args.tool_warmup_steps:
        if heldout:
            evaluations["untrained"] = evaluate(model_path)
        train = splits[script_args.dataset_train_split]
        model_path = warm_up_tools(script_args, training_args, model_path, tokenizer, train, tools)
    if heldout:
        evaluations["step_0"] = evaluate(model_path)
    return heldout, evaluations, model_path


def heldout_after(trainer, model_path, tokenizer, heldout, evaluations, tools, script_args, summary) -> None:
    """Stage 4: the held-out evaluation of the trained policy, added to the run summary, and every evaluation with
    each item's result in `<output_dir>/heldout.json`."""
    training_args = trainer.args
    # the trained weights in a plain copy: the trainer's model runs its packed-attention implementation
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(trainer.accelerator.unwrap_model(trainer.model).state_dict())
    evaluations[f"step_{trainer.state.global_step}"] = heldout_evaluation(
        model, tokenizer, heldout, tools, script_args, training_args
    )
    summary.heldout += [(int(k[5:]), v["accuracy"]) for k, v in evaluations.items() if k.startswith("step_")]
    if "untrained" in evaluations:
        untrained = evaluations["untrained"]["accuracy"]
        summary.notes.append(f"held-out accuracy before the tool warm-up {untrained:.2f}")
        summary.values["heldout_untrained"] = untrained
    with open(os.path.join(training_args.output_dir, "heldout.json"), "w") as f:
        json.dump(evaluations, f, indent=1)


def main(
    script_args: AsyncScriptArguments, training_args: RLLossAsyncGRPOConfig, model_args: AsyncModelArguments
) -> None:
    # Stage 0: validate what can be validated before anything heavy is loaded
    reward_funcs = get_reward_funcs(script_args.reward_funcs)
    tools = get_tools(script_args.tools)
    set_seed(training_args.seed)
    state = PartialState()
    if training_args.use_cpu:  # the trainer's share of the cores; the rollout process has rollout_threads
        torch.set_num_threads(script_args.cpu_threads or 1)

    # Stage 1: logging
    setup_logging(training_args, logger)

    # Stage 2: data, model path, tokenizer (TRL's async trainer loads the model from its path itself)
    splits = load_data(script_args, training_args.seed)
    dataset = splits[script_args.dataset_train_split]
    with state.main_process_first():
        model_path = resolve_model(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tools:  # a template that renders them
        tokenizer = with_tool_template(tokenizer)

    # Stage 2b: the tool warm-up and the held-out evaluation before training
    heldout, evaluations, model_path = heldout_before(script_args, training_args, splits, tokenizer, tools, model_path)
    decoding = f"sampled, {script_args.heldout_samples} per prompt" if tools else "greedy"

    # Stage 3: rollout side and trainer
    worker, transfer = build_rollout(script_args, training_args, model_path, dataset, reward_funcs, tokenizer, tools)
    summary = RunSummaryCallback(
        reward_key="rewards/accuracy_reward",
        step_time_key="perf/step_s",
        series={"turns per episode": "rollout/turns_mean"} if tools else None,
        heldout_note=f"{decoding}, {len(heldout)} prompts" if heldout else "",
    )
    trainer = RLLossAsyncGRPOTrainer(
        model=model_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[summary, MetricsPlotCallback()] if script_args.plot else [summary],
        rollout_worker=worker,
        weight_transfer=transfer,
    )

    # Stage 4: train, evaluate, save, summarize
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if heldout:
        heldout_after(trainer, model_path, tokenizer, heldout, evaluations, tools, script_args, summary)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        curves = os.path.join(training_args.output_dir, "training_curves.png") if script_args.plot else None
        print(summary.summary(training_args.output_dir, curves), flush=True)
        summary.write(os.path.join(training_args.output_dir, "run_summary.json"), training_args.output_dir, curves)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    try:
        args = parse_args(types=(AsyncScriptArguments, RLLossAsyncGRPOConfig, AsyncModelArguments))
    except ValueError as err:  # bad input: a clear message, not a stack trace
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main(*args)
