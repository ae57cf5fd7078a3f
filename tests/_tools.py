"""Tool-calling pieces shared by the tool tests (`test_tool_rollouts.py`, `test_multiturn.py`): a byte tokenizer with
Qwen's turn markers and a compact Qwen-style tool template (prefix-preserving), TRL's Qwen3 response parser, a tiny
Qwen2, a `multiply` tool and environment, a reward, and scripted generation (`ScriptedToolRollout`); the overrides
that shrink the agentic demo's recipe to a smoke run, and what such a run must leave (`check_calculator_run`)."""

from __future__ import annotations

import json
import math
import re

import torch
from _tool_functions import multiply  # noqa: F401  (run in a tool process: a light module)
from _trainer_utils import make_tokenizer
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl.chat_template_utils import qwen3_template

from hf_rlloss.trainer.async_.rollout import HFGenerateLoop

PAIRS = [(3, 4), (6, 7), (2, 9), (5, 8)]
# Qwen's turn markers and tool blocks, without Qwen3's long tool-use system prompt
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class MultiplyEnvironment:
    """An `environment_factory` environment: `reset` gets the example, `multiply` is its tool."""

    def reset(self, **example):
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a * b


def tool_tokenizer():
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = qwen3_template  # TRL's parser of Qwen's `<tool_call>` blocks
    return tok


def tool_model(tok, seed: int = 0) -> Qwen2ForCausalLM:
    """A tiny Qwen2 with room for the prompt, the tool call, its result and the answer."""
    torch.manual_seed(seed)
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        **ids,
    )
    model = Qwen2ForCausalLM(config)
    for key, value in ids.items():
        setattr(model.generation_config, key, value)
    return model


def dataset() -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {a} times {b}?"}] for a, b in PAIRS * 4],
            "product": [a * b for a, b in PAIRS * 4],
        }
    )


def product_rows(pairs) -> list[dict]:
    """Chat rows asking for `a` times `b`, with their `product` column."""
    return [{"prompt": [{"role": "user", "content": f"What is {a} times {b}?"}], "product": a * b} for a, b in pairs]


def reward_correct(completions, product, **kwargs):
    """1 for the right product in the last message, minus a little per character (so rewards differ)."""
    return [
        float(str(p) in c[-1]["content"]) - 0.01 * sum(len(m.get("content") or "") for m in c)
        for c, p in zip(completions, product)
    ]


class ScriptedToolRollout:
    """Stand-in for `GRPOTrainer._generate_single_turn`: a function of the prompt (and its place in the group). With
    `logprobs`, also deterministic "sampler" log-probs near the tiny model's (about log 1/259)."""

    def __init__(self, tok, logprobs: bool = False):
        self.tok, self.logprobs = tok, logprobs

    def reply(self, text: str, last_user: str, j: int) -> str:
        """The model's turn: the tool's result after a tool reply; else a `multiply` call (even `j`, the prompt's
        occurrence in the call) or a wrong answer (odd `j`)."""
        if "<tool_response>" in last_user:  # after the tool: answer with its result
            result = re.search(r"<tool_response>\s*(.*?)\s*</tool_response>", last_user, re.S).group(1)
            return f"It is {result}."
        a, b = map(int, re.findall(r"(\d+) times (\d+)", text)[-1])
        if j % 2 == 0:
            return f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
        return f"It is {a + b + 1}."  # the same in every odd place: a process generating part of a batch agrees

    def __call__(self, prompt_ids, images=None, multimodal_fields=None, num_generations=1, has_tool_images=False):
        completions, occurrence = [], {}
        for ids in prompt_ids:
            text = self.tok.decode(ids)
            last_user = text.rsplit("<|im_start|>user", 1)[-1]
            j = occurrence[text] = occurrence.get(text, -1) + 1
            completions.append(
                self.tok(self.reply(text, last_user, j) + "<|im_end|>", add_special_tokens=False)["input_ids"]
            )
        if not self.logprobs:
            return completions, None
        return completions, [[-5.56 + 0.25 * math.sin(t + 3 * k) for k, t in enumerate(c)] for c in completions]


class ScriptedWorkerLoop(HFGenerateLoop):
    """The CPU rollout worker's loop with `ScriptedToolRollout` (with log-probs) as its sampler; set as the worker's
    `_settings.loop_class`, it runs in the spawned process."""

    def _generate_ids(self, prompt_ids, seed, budgets=None):
        return ScriptedToolRollout(self.s.tokenizer, logprobs=True)(prompt_ids)


TINY_CALCULATOR = [
    "--model_name_or_path", "builtin:tiny-random", "--max_steps", "2", "--tool_warmup_steps", "2",
    "--heldout_size", "4", "--heldout_samples", "2", "--dataset_size", "32", "--per_device_train_batch_size", "4",
    "--num_generations", "2", "--max_completion_length", "48", "--bf16", "false", "--queue_maxsize", "4",
]  # fmt: skip


def check_calculator_run(out, stdout: str) -> None:
    """What a run of the agentic demo must leave: the summary line with turns and held-out accuracy, per-item
    held-out results before the warm-up, at step 0 and at the end, and the multi-turn metrics."""
    (line,) = [line for line in stdout.splitlines() if line.startswith("run summary:")]
    pattern = (r"turns per episode \d\.\d\d \(first \d steps\) -> \d\.\d\d \(last \d steps\); held-out accuracy "
               r"\(sampled, 2 per prompt, 4 prompts\) \d\.\d\d \(step 0\) -> \d\.\d\d \(step 2\); .*held-out accuracy "
               r"before the tool warm-up \d\.\d\d")  # fmt: skip
    assert re.search(pattern, line), line
    heldout = json.loads((out / "heldout.json").read_text())
    assert sorted(heldout) == ["step_0", "step_2", "untrained"]
    for result in heldout.values():
        assert len(result["items"]) == 4 and len(result["sampled"]["correct"]) == 4
        assert len(result["greedy"]["correct"]) == 4 and result["accuracy"] == result["sampled"]["accuracy"]
    assert (out / "tool_warmup" / "model.safetensors").exists()
    logs = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    steps = [r for r in logs if "rewards/accuracy_reward" in r]
    # the rollout process's metrics reach the log of the step that drains them
    assert len(steps) == 2 and any("rollout/turns_mean" in r and "tools/call_frequency" in r for r in steps)


def run_calculator_recipe(root, out, *args: str, timeout: float = 480):
    """The agentic demo's recipe, shrunk by `TINY_CALCULATOR` (and `args`), launched with one process into `out`;
    fails with the launch's stderr unless it exits 0, and returns its `CompletedProcess` (stdout captured)."""
    import _launch

    cmd = _launch.accelerate_launch(
        root / "accelerate_configs/single_process.yaml",
        root / "recipes/grpo_async.py",
        *["--config", str(root / "recipes/smollm2_135m/calculator/config_async.yaml"), "--output_dir", str(out)],
        *TINY_CALCULATOR,
        *args,
    )
    result = _launch.run(cmd, timeout=timeout, cwd=root, env={"HF_RLLOSS_CACHE": str(out) + "-cache"}, stdout=True)
    assert result.returncode == 0, result.stderr[-6000:]
    return result
