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

import logging
import os
import sys
from dataclasses import dataclass, field

import torch
from accelerate import PartialState
from grpo import GRPOScriptArguments, load_data, parse_args, setup_logging
from transformers import AutoTokenizer, set_seed

from hf_rlloss import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
from hf_rlloss.recipe_support.assets import resolve_model
from hf_rlloss.recipe_support.callbacks import MetricsPlotCallback, RunSummaryCallback
from hf_rlloss.recipe_support.rewards import get_reward_funcs

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
    """

    vllm: bool = field(default=False, metadata={"help": "use TRL's vLLM worker and NCCL weight transfer"})
    rollout_threads: int = field(default=1, metadata={"help": "torch threads of the HF-generate process"})
    weight_lag: int = field(default=0, metadata={"help": "apply the weights this many versions late"})
    record_rollout_logprobs: bool = field(default=True, metadata={"help": "record the sampled tokens' log-probs"})
    fixed_lag: int | None = field(default=None, metadata={"help": "sample each batch from a fixed policy version"})


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


def build_rollout(script_args, training_args, model_path, dataset, reward_funcs, tokenizer):
    """The rollout worker and weight transfer: `None, None` for TRL's vLLM worker, else the CPU pair."""
    if script_args.vllm:
        return None, None
    from hf_rlloss.trainer.async_.cpu_rollout import HFGenerateRolloutWorker, QueueWeightTransfer

    worker = HFGenerateRolloutWorker(
        model_path, dataset, reward_funcs, tokenizer, training_args,
        record_logprobs=script_args.record_rollout_logprobs, weight_lag=script_args.weight_lag,
        fixed_lag=script_args.fixed_lag, threads=script_args.rollout_threads,
    )  # fmt: skip
    return worker, QueueWeightTransfer(worker)


def main(
    script_args: AsyncScriptArguments, training_args: RLLossAsyncGRPOConfig, model_args: AsyncModelArguments
) -> None:
    # Stage 0: validate what can be validated before anything heavy is loaded
    reward_funcs = get_reward_funcs(script_args.reward_funcs)
    set_seed(training_args.seed)
    state = PartialState()
    if training_args.use_cpu:  # the trainer's share of the cores; the rollout process has rollout_threads
        torch.set_num_threads(script_args.cpu_threads or 1)

    # Stage 1: logging
    setup_logging(training_args, logger)

    # Stage 2: data, model path, tokenizer (TRL's async trainer loads the model from its path itself)
    dataset = load_data(script_args, training_args.seed)[script_args.dataset_train_split]
    with state.main_process_first():
        model_path = resolve_model(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # Stage 3: rollout side and trainer
    worker, transfer = build_rollout(script_args, training_args, model_path, dataset, reward_funcs, tokenizer)
    summary = RunSummaryCallback(reward_key="rewards/accuracy_reward", step_time_key="perf/step_s")
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

    # Stage 4: train, save, summarize
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        curves = os.path.join(training_args.output_dir, "training_curves.png") if script_args.plot else None
        print(summary.summary(training_args.output_dir, curves), flush=True)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    try:
        args = parse_args(types=(AsyncScriptArguments, RLLossAsyncGRPOConfig, AsyncModelArguments))
    except ValueError as err:  # bad input: a clear message, not a stack trace
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main(*args)
