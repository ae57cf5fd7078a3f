"""One sampled conversation (`Episode`) and the named rollout errors it can meet (`RolloutError` and its kinds):
what the multi-turn loop (`async_/multiturn.py`) produces and the group scoring (`async_/scoring.py`) reads.

`on_rollout_error`, the policy that says what becomes of a sample that met one, is `scoring.RolloutErrorPolicy`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "ERROR_KINDS",
    "BudgetCutError",
    "ContextOverflowError",
    "Episode",
    "MalformedToolCallError",
    "NonFiniteRewardError",
    "RolloutError",
    "ToolRaisedError",
    "ToolTimeoutError",
]


class RolloutError(RuntimeError):
    """A multi-turn rollout met bad input; `kind` names it in the metrics."""

    kind = "rollout_error"


class ToolRaisedError(RolloutError):
    """A tool (or an environment's method) raised; the original exception is chained."""

    kind = "tool_raised"


class ToolTimeoutError(RolloutError):
    """A tool did not return within `tool_timeout_s`."""

    kind = "tool_timeout"


class ContextOverflowError(RolloutError):
    """A tool's or environment's reply would push the completion past `max_completion_length`, or the sequence past
    the model's context."""

    kind = "context_overflow"


class MalformedToolCallError(RolloutError):
    """The model wrote a tool call that does not parse, names no tool it was given, or whose arguments are not an
    object."""

    kind = "malformed_tool_call"


class BudgetCutError(RolloutError):
    """The completion budget (`max_completion_length`, or the model's context) ran out in the middle of a tool call
    the model was writing. Always counted; a rollout error that follows `on_rollout_error` only under
    `on_budget_cut="rollout_error"` (by default the sample is trained as TRL trains a truncated completion)."""

    kind = "budget_cut"


class NonFiniteRewardError(RolloutError):
    """An environment's `get_reward` returned NaN or ±inf, or a reward function ±inf (a reward function's NaN, or
    `None`, is TRL's "skipped")."""

    kind = "nonfinite_reward"


ERROR_KINDS = tuple(cls.kind for cls in (ToolRaisedError, ToolTimeoutError, ContextOverflowError,
                                         MalformedToolCallError, BudgetCutError, NonFiniteRewardError))  # fmt: skip


@dataclasses.dataclass
class Episode:
    """One sampled conversation: the prompt (messages, an environment's observation included) and its ids, the
    completion's ids (the model's turns and the replies between them), `mask` (1: a model token, 0: a reply token),
    the behaviour log-probs (0.0 at reply tokens), the completion as messages, its environment, and its errors."""

    prompt: Any
    prompt_ids: list[int]
    completion_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    messages: list[dict[str, Any]]
    environment: Any = None
    tool_calls: int = 0
    errors: list[RolloutError] = dataclasses.field(default_factory=list)
    loop_exhausted: bool = False
    unknown_tool_calls: int = 0

    @property
    def tool_failures(self) -> int:
        """Tool calls that failed, as TRL counts them: the tool raised (or timed out), or no tool has the name."""
        return self.unknown_tool_calls + sum(isinstance(e, (ToolRaisedError, ToolTimeoutError)) for e in self.errors)

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m.get("role") == "assistant")
