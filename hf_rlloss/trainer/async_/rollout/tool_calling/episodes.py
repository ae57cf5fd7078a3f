"""One sampled conversation (`Episode`), the named rollout errors it can meet (`RolloutError` and its kinds), and
the policy that says what becomes of a group whose episodes met one (`RolloutErrorPolicy`: `on_rollout_error`,
`on_budget_cut`): what the tool-calling loop (`rollout/tool_calling/`) produces and the group scoring
(`rollout/scoring.py`) reads and applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ERROR_KINDS",
    "ON_BUDGET_CUT",
    "ON_ROLLOUT_ERROR",
    "BudgetCutError",
    "ContextOverflowError",
    "Episode",
    "MalformedToolCallError",
    "NonFiniteRewardError",
    "RolloutError",
    "RolloutErrorPolicy",
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


ON_ROLLOUT_ERROR = ("feed_back", "drop", "raise")
ON_BUDGET_CUT = ("keep", "rollout_error")


@dataclasses.dataclass(frozen=True)
class RolloutErrorPolicy:
    """What becomes of a group whose episodes met a `RolloutError`, validated at construction.

    Args:
        on_rollout_error (`str`, *optional*, defaults to `"feed_back"`): one of `ON_ROLLOUT_ERROR`: `"feed_back"`
            (TRL's behaviour: the group is trained), `"drop"` (the group is dropped) or `"raise"` (the worker stops
            with the error).
        on_budget_cut (`str`, *optional*, defaults to `"keep"`): one of `ON_BUDGET_CUT`: whether a turn cut by the
            completion budget in the middle of a tool call (`BudgetCutError`) is trained as a truncated completion
            (`"keep"`) or follows `on_rollout_error` (`"rollout_error"`).

    Example:

    ```python
    >>> from hf_rlloss.trainer.async_.rollout.tool_calling.episodes import BudgetCutError, ToolRaisedError
    >>> policy = RolloutErrorPolicy("drop")
    >>> policy.dropped_kinds([BudgetCutError("cut"), ToolRaisedError("raised")])
    ['tool_raised']
    ```
    """

    on_rollout_error: str = "feed_back"
    on_budget_cut: str = "keep"

    def __post_init__(self) -> None:
        if self.on_rollout_error not in ON_ROLLOUT_ERROR:
            raise ValueError(f"on_rollout_error={self.on_rollout_error!r}: allowed values are {ON_ROLLOUT_ERROR}")
        if self.on_budget_cut not in ON_BUDGET_CUT:
            raise ValueError(f"on_budget_cut={self.on_budget_cut!r}: allowed values are {ON_BUDGET_CUT}")

    def follows(self, error: RolloutError) -> bool:
        """Whether a counted rollout error follows `on_rollout_error`: all but a budget cut under
        `on_budget_cut="keep"`."""
        return not (isinstance(error, BudgetCutError) and self.on_budget_cut == "keep")

    def dropped_kinds(self, errors: Sequence[RolloutError]) -> list[str]:
        """The kinds of `errors` (one group's) that drop the group, sorted; empty when it is trained. Under
        `"raise"` the first error that follows the policy is raised."""
        followed = [e for e in errors if self.follows(e)]
        if followed and self.on_rollout_error == "raise":
            raise followed[0]
        return sorted({e.kind for e in followed}) if self.on_rollout_error == "drop" else []


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
