"""Held-out evaluation of the recipes: the arithmetic task's held-out split, greedy evaluation, the summary line."""

from __future__ import annotations

import re

import pytest
import torch
from _trainer_utils import BASE_ARGS, make_model, make_tokenizer
from datasets import Dataset
from transformers import GenerationConfig

from hf_rlloss.recipe_support.callbacks import RunSummaryCallback, plot_curves
from hf_rlloss.recipe_support.heldout import evaluate_greedily, greedy_decoding
from hf_rlloss.recipe_support.tasks import arithmetic_dataset, arithmetic_splits, operand_pair
from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer

torch.set_num_threads(1)


def _pairs(dataset) -> set[tuple[int, int]]:
    out = set()
    for row in dataset:
        a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", row["prompt"][0]["content"]).groups())
        assert a + b == row["answer"]
        out.add(operand_pair(a, b))
    return out


def test_heldout_operand_pairs_never_occur_in_training():
    splits = arithmetic_splits(512, 64, seed=42, max_operand=20)
    assert len(splits["train"]) == 512 and len(splits["test"]) == 64
    heldout = _pairs(splits["test"])
    assert len(heldout) == 64  # one problem per distinct pair
    assert not heldout & _pairs(splits["train"])  # in either order: the pairs are unordered
    again = arithmetic_splits(512, 64, seed=42, max_operand=20)
    assert (
        again["test"]["prompt"] == splits["test"]["prompt"] and again["train"]["answer"] == splits["train"]["answer"]
    )


def test_no_heldout_keeps_the_training_draws():
    assert arithmetic_splits(64, 0, seed=3)["train"]["prompt"] == arithmetic_dataset(64, seed=3)["prompt"]


def test_heldout_size_is_validated():
    with pytest.raises(ValueError, match=r"heldout_size=28 must be in \[0, 27\].*55 operand pairs"):
        arithmetic_splits(64, 28, max_operand=9)


def test_greedy_decoding_is_restored():
    class Trainer:
        generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=5)
        generation_kwargs = {"do_sample": True, "temperature": 0.7, "max_new_tokens": 3}

    trainer = Trainer()
    with greedy_decoding(trainer):
        assert trainer.generation_config.do_sample is False and trainer.generation_config.temperature is None
        assert trainer.generation_kwargs == {"do_sample": False, "temperature": None, "max_new_tokens": 3}
    assert trainer.generation_config.do_sample is True and trainer.generation_config.top_k == 5
    assert trainer.generation_kwargs == {"do_sample": True, "temperature": 0.7, "max_new_tokens": 3}


def test_greedy_evaluation_gives_the_same_completions_twice(tmp_path):
    """A tiny random model samples near-uniformly over 259 tokens: two sampled evaluations would differ."""
    tok = make_tokenizer()
    args = RLLossGRPOConfig(
        output_dir=str(tmp_path), **{**BASE_ARGS, "per_device_eval_batch_size": 4}, num_generations_eval=1
    )
    prompts = Dataset.from_dict({"prompt": [f"Q{i}: 1+{i} =" for i in range(4)]})

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = RLLossGRPOTrainer(
        make_model(tok), [reward], args=args, train_dataset=prompts, eval_dataset=prompts, processing_class=tok
    )
    evaluate_greedily(trainer)
    completions = []
    for _ in range(2):
        trainer._logs["completion"].clear()
        trainer.evaluate()
        completions.append(list(trainer._logs["completion"]))
    assert len(completions[0]) == 4 and completions[0] == completions[1]
    assert trainer.generation_config.do_sample is True  # training still samples


def test_summary_and_curves_show_heldout_accuracy_before_and_after(tmp_path):
    class State:
        global_step = 0

    summary, state = RunSummaryCallback(k=1, heldout_note="greedy, 8 prompts"), State()
    history = []
    for step, log in [
        (0, {"eval_rewards/accuracy_reward/mean": 0.125, "eval_loss": 0.0}),
        (1, {"step_time": 1.0, "rewards/accuracy_reward/mean": 0.25}),
        (2, {"step_time": 1.0, "rewards/accuracy_reward/mean": 0.5}),
        (2, {"eval_rewards/accuracy_reward/mean": 0.625, "eval_loss": 0.0}),
    ]:
        state.global_step = step
        summary.on_log(None, state, None, logs=log)
        history.append({"step": step, **log})
    assert "held-out accuracy (greedy, 8 prompts) 0.12 (step 0) -> 0.62 (step 2)" in summary.summary("out")
    assert plot_curves(history, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_vllm_evaluation_stays_sampled(caplog):
    class VLLMTrainer:  # TRL builds no generation_config under vLLM
        use_vllm = True

        def evaluate(self):
            return "sampled"

    trainer = VLLMTrainer()
    with caplog.at_level("WARNING"):
        assert evaluate_greedily(trainer) is False and trainer.evaluate() == "sampled"
    assert "held-out evaluation samples as training does instead of decoding greedily: vLLM takes" in caplog.text
