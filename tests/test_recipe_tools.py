"""Tool calling in the recipes (`hf_rlloss/recipe_support/tools.py`): the ChatML tool template, the warm-up's loss on
the assistant's tokens only, the held-out evaluation of conversations, and the async recipe's validation."""

import math
import random
import sys
import types
from pathlib import Path

import pytest
import torch
from _full_matrix import slow_launch
from _tools import check_calculator_run, run_calculator_recipe, tool_model, tool_tokenizer
from _trainer_utils import make_tokenizer
from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

from hf_rlloss.recipe_support.tasks import PROMPT, arithmetic_dataset, arithmetic_splits
from hf_rlloss.recipe_support.tools import (
    CHATML_TOOL_TEMPLATE,
    add,
    addition_conversations,
    evaluate_with_tools,
    get_tools,
    warm_up_tool_calls,
    with_tool_template,
    worked_conversation,
)
from hf_rlloss.trainer.async_.rollout import AgentSpec

ROOT = Path(__file__).resolve().parents[1]


def chatml_tokenizer():
    """A byte tokenizer with ChatML's markers and a chat template that renders no tools (as SmolLM2's)."""
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    return tok


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": PROMPT.format(question=f"{a} + {b}")}]


def test_a_chatml_tokenizer_without_tools_gets_the_tool_template():
    tok = chatml_tokenizer()
    assert not supports_tool_calling(tok)
    tok = with_tool_template(tok)
    assert tok.chat_template == CHATML_TOOL_TEMPLATE
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 120, "b": 345}}\n</tool_call><|im_end|>'
    parsed = tok.parse_response(tok(call, add_special_tokens=False)["input_ids"], prefix=[])
    assert parsed["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 120, "b": 345}}


def test_a_tokenizer_that_renders_tools_keeps_its_template_and_others_are_refused():
    tok = tool_tokenizer()
    template = tok.chat_template
    assert with_tool_template(tok).chat_template == template
    with pytest.raises(ValueError, match="not a ChatML tokenizer"):
        with_tool_template(make_tokenizer())


def test_get_tools_names_the_valid_ones():
    assert get_tools(["add"]) == [add]
    with pytest.raises(ValueError, match=r"unknown tool\(s\) \['mul'\]; valid: \['add'\]"):
        get_tools(["mul"])


def test_worked_conversation_marks_the_assistant_turns_only():
    tok = with_tool_template(chatml_tokenizer())
    conversation = worked_conversation(question(120, 345), add, {"a": 120, "b": 345})
    encoded = tok.apply_chat_template(conversation, tools=[add], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)  # fmt: skip
    trained = tok.decode([t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"]) if m])
    assert trained == ('<tool_call>\n{"name": "add", "arguments": {"a": 120, "b": 345}}\n</tool_call><|im_end|>'
                       "465<|im_end|>")  # fmt: skip
    text = tok.decode(encoded["input_ids"])
    assert "<tool_response>\n465\n</tool_response>" in text  # the reply is in the sequence, untrained


def _assistant_labels(tok, conversation) -> tuple[list[int], list[int]]:
    """The conversation's ids and its labels built independently of the template's generation markers: each
    assistant turn spans from the end of the prefix rendered with a generation prompt to the end of the prefix
    that contains the turn (its `<|im_end|>` included, the newline after it not)."""
    ids = tok.apply_chat_template(conversation, tools=[add], tokenize=True, return_dict=False)
    labels = [-100] * len(ids)
    for k, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        start = len(tok.apply_chat_template(conversation[:k], tools=[add], add_generation_prompt=True,
                                            tokenize=True, return_dict=False))  # fmt: skip
        end = len(tok.apply_chat_template(conversation[: k + 1], tools=[add], tokenize=True, return_dict=False)) - 1
        labels[start:end] = ids[start:end]
    return ids, labels


def test_warm_up_loss_is_the_cross_entropy_of_the_assistant_tokens():
    tok = with_tool_template(chatml_tokenizer())
    rows = [{"prompt": question(a, b), "answer": a + b} for a, b in [(101, 202), (350, 649), (999, 100)]]
    conversations = addition_conversations(rows)
    model = tool_model(tok, seed=0)
    expected_model = tool_model(tok, seed=0)
    losses = warm_up_tool_calls(model, tok, conversations, [add], steps=1, batch_size=3, learning_rate=1e-3)
    total, count = 0.0, 0
    with torch.no_grad():
        for conversation in conversations:
            ids, labels = _assistant_labels(tok, conversation)
            logits = expected_model(input_ids=torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            keep = target != -100
            total += torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum").item()
            count += int(keep.sum())
    assert losses[0] == pytest.approx(total / count, rel=1e-5)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), expected_model.parameters()))
    with pytest.raises(ValueError, match="need 6 conversations, got 3"):
        warm_up_tool_calls(model, tok, conversations, [add], steps=2, batch_size=3)


def test_addition_conversations_refuse_other_problems():
    with pytest.raises(ValueError, match="not an addition problem"):
        addition_conversations([{"prompt": [{"role": "user", "content": "What is 3 * 4?"}], "answer": 12}])


class ScriptedCalculator(torch.nn.Module):
    """A model whose `generate` calls `add` on the question's operands, then answers with the tool's result, except
    for the questions in `wrong` (answered with the result + 1)."""

    device = torch.device("cpu")  # as a transformers model's

    def __init__(self, tok, wrong: set[int]):
        super().__init__()
        self.tok, self.wrong = tok, wrong
        self.config = types.SimpleNamespace(max_position_embeddings=4096)
        self.calls = []

    def generate(self, input_ids, attention_mask, **kwargs):
        self.calls.append(kwargs)
        out = []
        for row, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tok.decode([t for t, m in zip(row, mask) if m])
            a, b = map(int, text.rsplit("What is ", 1)[1].split("?")[0].split(" + "))
            if text.rstrip().endswith("</tool_response><|im_end|>\n<|im_start|>assistant"):
                reply = f"{a + b + (1 if a in self.wrong else 0)}<|im_end|>"
            else:
                reply = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>'
            out.append(row + self.tok(reply, add_special_tokens=False)["input_ids"])
        width = max(map(len, out))
        return torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in out])


@pytest.mark.parametrize("samples", [None, 2])
def test_evaluate_with_tools_scores_each_item(samples):
    tok = with_tool_template(chatml_tokenizer())
    rows = [{"prompt": question(a, b), "answer": a + b} for a, b in [(101, 202), (350, 649), (999, 100)]]
    model = ScriptedCalculator(tok, wrong={350})
    kwargs = {} if samples is None else {"temperature": 1.0, "samples_per_item": samples}
    result = evaluate_with_tools(model, tok, rows, AgentSpec(tools=[add], max_iterations=2), 256, batch_size=4,
                                 **kwargs)  # fmt: skip
    assert result["correct"] == [1.0, 0.0, 1.0]
    assert result["accuracy"] == pytest.approx(2 / 3)
    assert result["turns_mean"] == 2.0 and result["tool_calls_mean"] == 1.0 and result["n"] == 3
    assert all(c["do_sample"] is (samples is not None) for c in model.calls)


def test_min_operand_bounds_the_draws_and_zero_keeps_the_original_draws():
    rng = random.Random(5)
    original = []
    while len(original) < 16:  # the draw of arithmetic_dataset with operands from 0
        a, b, _ = rng.randint(0, 20), rng.randint(0, 20), rng.choice("+")
        original.append(a + b)
    assert arithmetic_dataset(16, seed=5)["answer"] == original
    splits = arithmetic_splits(64, 16, seed=0, min_operand=100, max_operand=999)
    pairs = {}
    for split in ("train", "test"):
        pairs[split] = set()
        for row in splits[split]:
            a, b = map(int, row["prompt"][0]["content"].split("What is ")[1].split("?")[0].split(" + "))
            assert 100 <= a <= 999 and 100 <= b <= 999 and a + b == row["answer"]
            pairs[split].add((min(a, b), max(a, b)))
    assert not pairs["train"] & pairs["test"]
    with pytest.raises(ValueError, match="min_operand=30, max_operand=20"):
        arithmetic_splits(8, 2, min_operand=30, max_operand=20)


def test_async_recipe_refuses_tool_options_it_cannot_honour():
    sys.path.insert(0, str(ROOT / "recipes"))
    import grpo_async

    with pytest.raises(ValueError, match="tools with vllm=true"):
        grpo_async.AsyncScriptArguments(tools=["add"], vllm=True)
    with pytest.raises(ValueError, match="choose one"):
        grpo_async.AsyncScriptArguments(vllm=True, vllm_engine=True)
    with pytest.raises(ValueError, match="tool_warmup_steps=3"):
        grpo_async.AsyncScriptArguments(tool_warmup_steps=3)
    assert math.isclose(grpo_async.AsyncScriptArguments(tools=["add"]).tool_warmup_learning_rate, 5e-5)


@slow_launch  # about a minute and a half on 2 cores: run by .ci/run, outside the default suite
def test_the_agentic_demo_recipe_runs_end_to_end(tmp_path):
    out = tmp_path / "out"
    result = run_calculator_recipe(ROOT, out)
    check_calculator_run(out, result.stdout)
