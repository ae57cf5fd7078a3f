"""Reward functions for verifiable math answers, in TRL's reward-function signature, selectable by name.

TRL calls ``fn(prompts=..., completions=..., completion_ids=..., **dataset_columns) -> list[float | None]``; the
dataset's ``answer`` column arrives as the ``answer`` keyword.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: a list of messages
        return " ".join(m.get("content") or "" for m in completion if m.get("role") == "assistant")
    return completion


def last_number(text: str) -> float | None:
    """The last number in `text` (commas as thousands separators allowed), or `None`."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number of the completion equals the answer, else 0.0 (lenient: any surrounding text)."""
    rewards = []
    for completion, expected in zip(completions, answer):
        value = last_number(_text(completion))
        rewards.append(1.0 if value is not None and abs(value - float(expected)) < 1e-6 else 0.0)
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion is just a number (as the demo prompt asks), 0.5 when it contains one, else 0.0."""
    rewards = []
    for completion in completions:
        text = _text(completion).strip()
        if _NUMBER.fullmatch(text):
            rewards.append(1.0)
        else:
            rewards.append(0.5 if _NUMBER.search(text) else 0.0)
    return rewards


REWARD_FUNCS: dict[str, Callable] = {"accuracy": accuracy_reward, "format": format_reward}


def get_reward_funcs(names: list[str]) -> list[Callable]:
    """The reward functions named `names`; an unknown name is an error listing the valid ones."""
    unknown = [n for n in names if n not in REWARD_FUNCS]
    if unknown:
        raise ValueError(f"unknown reward function(s) {unknown}; valid: {sorted(REWARD_FUNCS)}")
    return [REWARD_FUNCS[n] for n in names]
