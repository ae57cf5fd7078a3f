"""Held-out evaluation in the recipes: TRL's evaluation loop decoding greedily, and one-turn completions of a
list of problems (`evaluate_completions`, the asynchronous recipe's).

`RLLossGRPOTrainer.evaluate` generates one batch of completions for the eval dataset and logs its rewards
(`eval_rewards/<function>/mean`, `eval_reward`). With sampling at the training temperature and one completion per
prompt, the held-out accuracy of 64 prompts would move by several points from run to run; greedy decoding gives the
policy's most likely answer, a stable measure of what it learned.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)

# GenerationConfig attributes that only matter when sampling (unset while decoding greedily)
_SAMPLING_SETTINGS = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None, "min_p": None}


@contextlib.contextmanager
def greedy_decoding(trainer: Any) -> Iterator[None]:
    """The trainer's HF generation decoding greedily inside the block, restored after: TRL passes its
    `generation_config` to `generate` and, to override the model's own generation config, its `generation_kwargs`;
    both are changed. Greedy tokens are not draws from a distribution, so they have no rollout log-probs: the
    evaluation loss is computed without rollout importance sampling (`rl_loss.rollout_is` metrics only)."""
    loss_config = getattr(trainer, "rl_loss_config", None)
    if loss_config is not None and loss_config.rollout_is.enabled:
        trainer.rl_loss_config = loss_config.model_copy(update={"rollout_is": type(loss_config.rollout_is)()})
    config, kwargs = trainer.generation_config, getattr(trainer, "generation_kwargs", None)
    saved_config = {name: getattr(config, name, None) for name in _SAMPLING_SETTINGS}
    saved_kwargs = dict(kwargs) if isinstance(kwargs, dict) else None
    for name, value in _SAMPLING_SETTINGS.items():
        setattr(config, name, value)
        if saved_kwargs is not None and name in kwargs:
            kwargs[name] = value
    try:
        yield
    finally:
        if loss_config is not None:
            trainer.rl_loss_config = loss_config
        for name, value in saved_config.items():
            setattr(config, name, value)
        if saved_kwargs is not None:
            kwargs.clear()
            kwargs.update(saved_kwargs)


def evaluate_greedily(trainer: Any) -> bool:
    """Make `trainer.evaluate` (the evaluations of `eval_strategy`, `eval_on_start` and explicit calls) decode
    greedily with HF generate; returns whether it does. vLLM takes its sampling settings from the trainer's
    arguments, not from a `generation_config` (TRL builds none then): its evaluation stays sampled at the training
    temperature, `False` is returned and a warning says so."""
    if getattr(trainer, "use_vllm", False) or getattr(trainer, "generation_config", None) is None:
        why = "the trainer has no generation_config"
        if getattr(trainer, "use_vllm", False):
            why = "vLLM takes its sampling settings from the trainer's arguments"
        logger.warning(f"held-out evaluation samples as training does instead of decoding greedily: {why}")
        return False
    evaluate = trainer.evaluate

    @functools.wraps(evaluate)
    def greedy(*args, **kwargs):
        with greedy_decoding(trainer):
            return evaluate(*args, **kwargs)

    trainer.evaluate = greedy
    return True


class EvaluateAtTheEnd(TrainerCallback):
    """Evaluate after the last optimizer step, inside training.

    An `evaluate()` called after `train()` returns runs once the trackers have been closed in `on_train_end`, and
    TRL's generation profiling then logs to a finished run (trackio raises "Call trackio.init() before
    trackio.log()"). Asking for the evaluation through the control flow keeps it inside the run.
    """

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            control.should_evaluate = True
        return control


def evaluate_completions(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict],
    max_completion_length: int,
    temperature: float | None = None,
    samples_per_item: int = 1,
    seed: int = 0,
    batch_size: int = 64,
) -> dict[str, Any]:
    """One-turn completions of `rows` (a chat `prompt` and an `answer` each) with HF `generate`, scored by
    `accuracy_reward`: greedy (`temperature=None`), or `samples_per_item` samples per row at `temperature` under
    `seed`. The prompts are rendered as TRL renders them (the chat template with the generation prompt). Returns the
    accuracy and, per item, the fraction of its completions answered correctly (`correct`, in the order of `rows`):
    the same record as `evaluate_with_tools`, with one turn and no tool calls."""
    import torch

    from hf_rlloss.recipe_support.rewards import accuracy_reward
    from hf_rlloss.trainer.common.sampling import generate_and_cut

    eos = [tokenizer.eos_token_id]
    sampling = {"do_sample": False} if temperature is None else {"do_sample": True, "temperature": temperature}
    model.eval()
    correct = []
    per_batch = max(1, batch_size // samples_per_item)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, len(rows), per_batch):
            chunk = list(rows[start : start + per_batch])
            prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
                       for r in chunk for _ in range(samples_per_item)]  # fmt: skip
            prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
            ids = generate_and_cut(model, prompts, tokenizer.pad_token_id, eos, fork_rng=False,
                                   max_new_tokens=max_completion_length, top_p=1.0, top_k=0, **sampling)  # fmt: skip
            texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
            rewards = accuracy_reward(texts, [r["answer"] for r in chunk for _ in range(samples_per_item)])
            for i in range(len(chunk)):
                correct.append(sum(rewards[i * samples_per_item : (i + 1) * samples_per_item]) / samples_per_item)
    return {
        "accuracy": sum(correct) / max(len(correct), 1),
        "turns_mean": 1.0,
        "tool_calls_mean": 0.0,
        "n": len(correct),
        "decoding": "greedy" if temperature is None else f"sampled, T={temperature:g}, {samples_per_item} per item",
        "correct": correct,
    }
