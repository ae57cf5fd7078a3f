"""Tool calling in the recipes: the tools a YAML names, a ChatML template that renders tool conversations, the short
warm-up that teaches a small model the call format, and a held-out evaluation that runs the conversations.

A model whose own chat template renders tools (Qwen2.5/3, Llama 3.1+, ...) keeps it. SmolLM2's template is ChatML
without tools: `with_tool_template` gives such a tokenizer `CHATML_TOOL_TEMPLATE` (the tools' JSON schemas in a
system turn, Qwen's `<tool_call>` blocks, a tool's reply in a user turn) and TRL's parser of those blocks.

SmolLM2-135M-Instruct writes no parseable call with that template, sampled or greedy, with or without worked
examples in the prompt, so no reward ever reaches a tool conversation. `warm_up_tool_calls` fine-tunes it on a few
worked conversations (call, reply, answer) first; a handful of steps teaches the format without teaching the task:
after it the model calls the tool but copies the tool's result into its answer only some of the time, which is what
GRPO then learns.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from trl.chat_template_utils import qwen3_template, supports_tool_calling

from hf_rlloss.recipe_support.rewards import accuracy_reward
from hf_rlloss.trainer.async_.rollout.tool_calling import AgentSpec, MultiTurnRollouts, prepare_tokenizer
from hf_rlloss.trainer.common.sampling import generate_and_cut

__all__ = [
    "CHATML_TOOL_TEMPLATE",
    "TOOLS",
    "add",
    "addition_conversations",
    "evaluate_with_tools",
    "get_tools",
    "warm_up_tool_calls",
    "with_tool_template",
    "worked_conversation",
]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


TOOLS: dict[str, Callable] = {"add": add}

# ChatML (SmolLM2's turn markers) with tools: prefix-preserving (a turn's tokens never change when turns are appended),
# the assistant's turns inside `{% generation %}` so that `return_assistant_tokens_mask` finds them
CHATML_TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou can call tools. To call one, reply with <tool_call>\n"
    '{"name": <name>, "arguments": <arguments>}\n</tool_call>\nTools:'
    "{% for t in tools %}{{ '\\n' }}{{ t.function | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def get_tools(names: Sequence[str]) -> list[Callable]:
    """The tools named `names`; an unknown name is an error listing the valid ones."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; valid: {sorted(TOOLS)}")
    return [TOOLS[n] for n in names]


def with_tool_template(tokenizer: Any) -> Any:
    """The tokenizer, able to render and parse tool calls: its own template when that renders tools (with TRL's
    response parser), else `CHATML_TOOL_TEMPLATE` for a ChatML tokenizer; any other tokenizer is refused."""
    if not supports_tool_calling(tokenizer):
        if "<|im_start|>" not in tokenizer.get_vocab():
            raise ValueError(
                "tools: the tokenizer's chat template cannot render tool calls and it is not a ChatML tokenizer "
                "(no <|im_start|> token): give it a chat template that renders tools"
            )
        tokenizer.chat_template = CHATML_TOOL_TEMPLATE
        tokenizer.response_template = qwen3_template  # TRL's parser of `<tool_call>` blocks
    return prepare_tokenizer(tokenizer)


def worked_conversation(prompt: list[dict], tool: Callable, arguments: dict[str, Any]) -> list[dict]:
    """`prompt`, then the assistant's call of `tool` with `arguments`, its reply, and the reply as the answer."""
    result = str(tool(**arguments))
    call = {"type": "function", "function": {"name": tool.__name__, "arguments": arguments}}
    return [
        *prompt,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": tool.__name__, "content": result},
        {"role": "assistant", "content": result},
    ]


def addition_conversations(rows: Sequence[dict]) -> list[list[dict]]:
    """Worked conversations with `add` for `builtin:arithmetic` rows of additions (``What is a + b?``)."""
    conversations = []
    for row in rows:
        found = re.search(r"(-?\d+) \+ (-?\d+)", row["prompt"][-1]["content"])
        if found is None:
            raise ValueError(f"tool warm-up: not an addition problem: {row['prompt'][-1]['content']!r}")
        conversations.append(worked_conversation(row["prompt"], add, {"a": int(found[1]), "b": int(found[2])}))
    return conversations


def warm_up_tool_calls(
    model: torch.nn.Module,
    tokenizer: Any,
    conversations: Sequence[list[dict]],
    tools: list[Callable],
    steps: int,
    batch_size: int = 8,
    learning_rate: float = 5e-5,
) -> list[float]:
    """Fine-tune `model` for `steps` AdamW steps on `conversations` (`batch_size` each, in order) with the loss on the
    assistant's tokens only (the template's `{% generation %}` blocks); returns the losses.

    TRL's `SFTTrainer(assistant_only_loss=True)` computes the same loss; these few steps run in the recipe's process
    before the GRPO trainer is built, so a second trainer (and a second `Accelerator`) is not set up for them."""
    if steps * batch_size > len(conversations):
        raise ValueError(f"tool warm-up: {steps} steps of {batch_size} need {steps * batch_size} conversations, "
                         f"got {len(conversations)}")  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    losses = []
    for step in range(steps):
        batch = conversations[step * batch_size : (step + 1) * batch_size]
        encoded = [
            tokenizer.apply_chat_template(c, tools=tools, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            for c in batch
        ]  # fmt: skip
        width = max(len(e["input_ids"]) for e in encoded)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, e in enumerate(encoded):
            n = len(e["input_ids"])
            ids[i, :n] = torch.tensor(e["input_ids"])
            attention[i, :n] = 1
            trained = torch.tensor(e["assistant_masks"], dtype=torch.bool)
            labels[i, :n] = torch.where(trained, ids[i, :n], -100)
        if not (labels != -100).any():
            raise ValueError("tool warm-up: no assistant token to train on (the chat template marks none)")
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def evaluate_with_tools(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[dict],
    spec: AgentSpec,
    max_completion_length: int,
    temperature: float | None = None,
    samples_per_item: int = 1,
    seed: int = 0,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Conversations (TRL's tool-calling loop, `MultiTurnRollouts`) on `rows` (a `prompt` and an `answer` each),
    scored by `accuracy_reward`: greedy (`temperature=None`), or `samples_per_item` samples per row at `temperature`
    under `seed`. Returns the accuracy, the mean turns and tool calls per conversation, and per item the fraction of
    its conversations answered correctly (`correct`, in the order of `rows`)."""
    loop = MultiTurnRollouts(spec, tokenizer, {}, max_completion_length, model.config.max_position_embeddings)
    eos = tokenizer.eos_token_id
    sampling = {"do_sample": False} if temperature is None else {"do_sample": True, "temperature": temperature}

    def generate(prompt_ids: list[list[int]], call: int, budgets: list[int]) -> tuple[list, list]:
        # one random stream over the evaluation (seeded once below): the calls do not fork the RNG
        completions = generate_and_cut(model, prompt_ids, tokenizer.pad_token_id, [eos], fork_rng=False,
                                       max_new_tokens=max(budgets), top_p=1.0, top_k=0, **sampling)  # fmt: skip
        return completions, [[math.nan] * len(c) for c in completions]

    model.eval()
    correct, turns, calls = [], [], []
    per_batch = max(1, batch_size // samples_per_item)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(rows), per_batch):
            chunk = list(rows[start : start + per_batch])
            episodes = loop.rollout(chunk, samples_per_item, generate)
            answers = [r["answer"] for r in chunk for _ in range(samples_per_item)]
            rewards = accuracy_reward([e.messages for e in episodes], answers)
            for i in range(len(chunk)):
                correct.append(sum(rewards[i * samples_per_item : (i + 1) * samples_per_item]) / samples_per_item)
            turns += [e.turns for e in episodes]
            calls += [e.tool_calls for e in episodes]
    n = max(len(correct), 1)
    return {
        "accuracy": sum(correct) / n,
        "turns_mean": sum(turns) / max(len(turns), 1),
        "tool_calls_mean": sum(calls) / max(len(calls), 1),
        "n": len(correct),
        "decoding": "greedy" if temperature is None else f"sampled, T={temperature:g}, {samples_per_item} per item",
        "correct": correct,
    }
