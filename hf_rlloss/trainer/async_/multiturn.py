"""Multi-turn rollouts in the asynchronous trainer's rollout workers: TRL's `tools` and `environment_factory`.

The conversation loop is TRL's own: the workers run `GRPOTrainer._tool_call_loop` (the synchronous trainer's loop,
TRL 1.16) on a small host object whose `_generate_single_turn` is the worker's sampler. A multi-turn sample is
therefore built exactly as `GRPOTrainer`, and so `RLLossGRPOTrainer`, builds it:

* the prompt is rendered with the tools' schemas (an environment's public methods are its tools) by the chat template,
  replaced by TRL's prefix-preserving training template when it is not prefix-preserving;
* each turn's tokens are appended to the previous ones (no re-tokenization of the conversation), a tool's or an
  environment's reply rendered by the template between the turns (`_get_tool_suffix_ids`);
* `tool_mask` marks the model's tokens 1 and the replies 0; the replies carry no behaviour log-prob (0.0, masked);
* a reply that would push the completion past `max_completion_length`, or the sequence past the context, is not
  appended and the conversation ends there.

What the workers add to TRL's loop:

* **One policy version per sample.** Every turn of a batch is sampled before the worker loads new weights (weights
  are loaded between batches only), so a sample's tokens all come from the version it is tagged with, and the rollout
  IS weight of each model token is taken against that policy.
* **Named rollout errors** (`RolloutError`): a tool that raises (`ToolRaisedError`), a tool that does not return
  within `tool_timeout_s` (`ToolTimeoutError`), a reply that does not fit the context (`ContextOverflowError`), and a
  tool call that does not parse or names no tool (`MalformedToolCallError`). `on_rollout_error` says what happens to
  a sample that met one: `"feed_back"` (TRL's behaviour: the error text is the tool's reply, the conversation goes
  on), `"drop"` (its whole group is dropped: a group's advantages are normalized together), or `"raise"` (the worker
  stops with the error, which the trainer raises). Every error and every dropped group is counted in a metric
  (`rollout/errors/<kind>_total`, `rollout/dropped_groups/<kind>_total`); nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import math
import pickle
import threading
import types
from collections.abc import Callable
from typing import Any

from trl import GRPOTrainer
from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)

__all__ = [
    "ON_ROLLOUT_ERROR",
    "AgentSpec",
    "ContextOverflowError",
    "Episode",
    "MalformedToolCallError",
    "MultiTurnRollouts",
    "NonFiniteRewardError",
    "RolloutError",
    "ToolRaisedError",
    "ToolTimeoutError",
]

ON_ROLLOUT_ERROR = ("feed_back", "drop", "raise")
# a worker's sampler: one completion per prompt (ids up to and including the EOS) and its log-probs; the int counts the
# calls of a batch
Generate = Callable[[list[list[int]], int], tuple[list[list[int]], list[list[float]]]]


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


class NonFiniteRewardError(RolloutError):
    """An environment's `get_reward` returned NaN or ±inf, or a reward function ±inf (a reward function's NaN, or
    `None`, is TRL's "skipped")."""

    kind = "nonfinite_reward"


ERROR_KINDS = tuple(cls.kind for cls in (ToolRaisedError, ToolTimeoutError, ContextOverflowError,
                                         MalformedToolCallError, NonFiniteRewardError))  # fmt: skip


@dataclasses.dataclass
class AgentSpec:
    """What a worker needs to run multi-turn rollouts (picklable: module-level functions and classes).

    Args:
        tools (`list[Callable]`): TRL tools (type-annotated functions with a Google-style docstring).
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*): TRL's `environment_factory`: builds an
            environment with `reset(**row)` (its return, when not `None`, is appended to the prompt's last message),
            public methods (its tools) and optionally `get_reward()` (an extra reward column named after its class).
            A dict selects the factory by each row's `environment` field.
        max_iterations (`int`, *optional*): TRL's `max_tool_calling_iterations`; `None`: until the completion budget.
        tool_timeout_s (`float`, *optional*, defaults to `60`): how long one tool call may run.
        on_rollout_error (`str`, *optional*, defaults to `"feed_back"`): one of `ON_ROLLOUT_ERROR`.
    """

    tools: list[Callable] = dataclasses.field(default_factory=list)
    environment_factory: Any = None
    max_iterations: int | None = None
    tool_timeout_s: float = 60.0
    on_rollout_error: str = "feed_back"

    def __post_init__(self) -> None:
        if self.on_rollout_error not in ON_ROLLOUT_ERROR:
            raise ValueError(f"on_rollout_error={self.on_rollout_error!r}: allowed values are {ON_ROLLOUT_ERROR}")
        if not (isinstance(self.tool_timeout_s, (int, float)) and self.tool_timeout_s > 0):
            raise ValueError(f"tool_timeout_s={self.tool_timeout_s!r} must be a number of seconds > 0")
        if self.max_iterations is not None and (not isinstance(self.max_iterations, int) or self.max_iterations < 0):
            raise ValueError(f"max_tool_calling_iterations={self.max_iterations!r} must be None or an integer >= 0")
        self.tools = list(self.tools or [])
        for tool in self.tools:
            if not callable(tool) or not hasattr(tool, "__name__"):
                raise TypeError(f"tools: {tool!r} is not a named function")
        for name, obj in [(getattr(t, "__name__", repr(t)), t) for t in self.tools] + [
            ("environment_factory", self.environment_factory)
        ]:
            try:
                pickle.dumps(obj)
            except Exception as error:
                raise TypeError(
                    f"{name} is sent to the rollout process and must be picklable (a module-level function or class, "
                    f"not a lambda or a closure): {type(error).__name__}: {error}"
                ) from error

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None


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


def prepare_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer with a response parser for tool calls (TRL's `add_response_schema`, for the chat templates TRL
    knows) unless it has one; a template that cannot render a tool conversation is refused."""
    if not supports_tool_calling(tokenizer):
        raise ValueError(
            "tools/environment_factory: the tokenizer's chat template cannot render a tool-calling conversation "
            "(user -> assistant with tool_calls -> tool); give the tokenizer a template that can"
        )
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        tokenizer = add_response_schema(tokenizer)
    return tokenizer


def _method_tools(environment: Any) -> list[Callable]:
    """An environment's tools: its public methods other than `reset` and `get_reward` (TRL's rule)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def _tool_call_marker(tokenizer: Any) -> str | None:
    """The text that opens a tool call in the tokenizer's response template (`<tool_call>` for Qwen), if it says."""
    template = getattr(tokenizer, "response_template", None)
    if isinstance(template, dict):
        return (template.get("fields", {}).get("tool_calls") or {}).get("open")
    return None


class _Guarded:
    """A tool run in a thread of its own, for at most `timeout_s`; its errors are recorded on the episode's list.

    On an exception the original is re-raised, so that TRL's loop feeds back exactly what `GRPOTrainer` would."""

    def __init__(self, tool: Callable, errors: list[RolloutError], timeout_s: float):
        self.tool, self.errors, self.timeout_s = tool, errors, timeout_s
        self.__name__ = tool.__name__
        self.__qualname__ = getattr(tool, "__qualname__", tool.__name__)  # Python's `**` error names the tool by it

    def __call__(self, **arguments: Any) -> Any:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                result = self.tool(**arguments)
                box["result"] = asyncio.run(result) if inspect.isawaitable(result) else result
            except BaseException as error:  # noqa: BLE001 - reported to the caller
                box["error"] = error

        thread = threading.Thread(target=target, daemon=True, name=f"tool-{self.__name__}")
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            error = ToolTimeoutError(
                f"tool {self.__name__!r} did not return within tool_timeout_s={self.timeout_s:g}s"
            )
            self.errors.append(error)
            raise error
        if "error" in box:
            cause = box["error"]
            error = ToolRaisedError(f"tool {self.__name__!r} raised {type(cause).__name__}: {cause} (arguments "
                                    f"{arguments!r})")  # fmt: skip
            error.__cause__ = cause
            self.errors.append(error)
            raise cause
        return box["result"]


class MultiTurnRollouts:
    """TRL's tool-calling loop around a worker's sampler (see the module docstring).

    Args:
        spec (`AgentSpec`): the tools, environments and error policy.
        tokenizer: the tokenizer, prepared by `prepare_tokenizer`.
        chat_template_kwargs (`dict`): as TRL's `chat_template_kwargs`.
        max_completion_length (`int`): the completion budget over all turns (replies included), as in TRL.
        max_model_len (`int`): the model's context.
    """

    def __init__(self, spec: AgentSpec, tokenizer: Any, chat_template_kwargs: dict[str, Any],
                 max_completion_length: int, max_model_len: int):  # fmt: skip
        self.spec, self.tok = spec, tokenizer
        self.multi_environment = isinstance(spec.environment_factory, dict)
        if spec.environment_factory is None:
            self.factories = None
        elif self.multi_environment:
            self.factories = dict(spec.environment_factory)
        else:
            self.factories = {None: spec.environment_factory}
        self.env_tools: dict[Any, list[Callable]] = {}
        self.pool: dict[Any, list[Any]] = {}
        self.reward_types: list[type] = []  # environments whose get_reward is a reward column
        if self.factories is not None:
            for name, factory in self.factories.items():
                instance = factory()
                if not callable(getattr(instance, "reset", None)):
                    raise ValueError(
                        f"environment_factory{'' if name is None else f'[{name!r}]'} built a "
                        f"{type(instance).__name__} without a callable reset: TRL's environments define reset(**row)"
                    )
                self.env_tools[name] = spec.tools + _method_tools(instance)
                self.pool[name] = [instance]
                if callable(getattr(instance, "get_reward", None)) and type(instance) not in self.reward_types:
                    self.reward_types.append(type(instance))
        self.chat_template = (
            None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)
        )
        self.chat_template_kwargs = dict(chat_template_kwargs)
        self.max_completion_length = max_completion_length
        self.marker = _tool_call_marker(tokenizer)
        self.host = types.SimpleNamespace(
            max_tool_calling_iterations=math.inf if spec.max_iterations is None else spec.max_iterations,
            processing_class=tokenizer,
            _tokenizer=tokenizer,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
            _is_vlm=False,
            use_vllm=False,
            model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=max_model_len)),
            max_completion_length=max_completion_length,
            tools=self.all_tools(),
            environment_factories=self.factories,
            _env_tools=self.env_tools,
        )
        self.host._get_tool_suffix_ids = types.MethodType(GRPOTrainer._get_tool_suffix_ids, self.host)

    def all_tools(self) -> list[Callable]:
        tools = list(self.spec.tools)
        for methods in self.env_tools.values():
            tools += [m for m in methods if m.__name__ not in {t.__name__ for t in tools}]
        return tools

    def reward_columns(self) -> list[str]:
        """The names of the environments' reward columns (their classes'), after the reward functions'."""
        return [t.__name__ for t in self.reward_types]

    def _tools_of(self, name: Any) -> list[Callable]:
        return self.env_tools[name] if self.factories is not None else self.spec.tools

    def rollout(self, rows: list[dict[str, Any]], num_generations: int, generate: Generate) -> list[Episode]:
        """`num_generations` conversations per row, consecutive. `generate(prompt_ids, call)` samples one completion
        per prompt (ids up to and including the EOS, and their log-probs); `call` counts the calls of this batch."""
        names, environments, prompts = [], [], []
        cursor: dict[Any, int] = {}
        for row in rows:
            name = row.get("environment") if self.multi_environment else None
            if self.multi_environment and name not in self.factories:
                raise ValueError(f"a row has environment={name!r}, not among environment_factory's "
                                 f"{list(self.factories)}")  # fmt: skip
            for _ in range(num_generations):
                environment = None
                if self.factories is not None:
                    pool, index = self.pool[name], cursor.get(name, 0)
                    if index == len(pool):
                        pool.append(self.factories[name]())
                    cursor[name] = index + 1
                    environment = pool[index]
                prompt = copy.deepcopy(row.get("prompt", [{"role": "user", "content": ""}]))
                if environment is not None:
                    kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi_environment else row
                    observation = environment.reset(**kwargs)
                    if observation is not None:
                        prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
                names.append(name)
                environments.append(environment)
                prompts.append(prompt)
        prompt_ids = [
            self.tok.apply_chat_template(prompt, tools=self._tools_of(name) or None, chat_template=self.chat_template,
                                         add_generation_prompt=True, tokenize=True, return_dict=False,
                                         **self.chat_template_kwargs)
            for prompt, name in zip(prompts, names, strict=True)
        ]  # fmt: skip
        calls = iter(range(1 << 30))
        completion_ids, logprobs = generate(prompt_ids, next(calls))
        completions = [
            [parse_response(self.tok, ids, prefix=prompt_ids[i], tools=self._tools_of(names[i]))]
            for i, ids in enumerate(completion_ids)
        ]
        errors: list[list[RolloutError]] = [[] for _ in prompts]
        tool_dicts = []
        for i, environment in enumerate(environments):
            tools = list(self.spec.tools) + ([] if environment is None else _method_tools(environment))
            tool_dicts.append({t.__name__: _Guarded(t, errors[i], self.spec.tool_timeout_s) for t in tools})
        host = self.host
        host._batch_environments = names
        host._sync_tool_dicts, host._async_tool_dicts = tool_dicts, [{} for _ in prompts]
        host._generate_single_turn = lambda ids, images, fields, num_generations, **_: generate(ids, next(calls))
        tool_mask, completions, completion_ids, logprobs, _, _, images = GRPOTrainer._tool_call_loop(
            host, copy.deepcopy(prompts), prompt_ids, completion_ids, completions, logprobs, None, {}
        )
        if any(images):
            raise ValueError("a tool replied with images: the asynchronous rollout workers are text-only")
        episodes = []
        for i, prompt in enumerate(prompts):
            episode = Episode(prompt, prompt_ids[i], completion_ids[i], tool_mask[i], logprobs[i], completions[i],
                              environments[i], errors=errors[i])  # fmt: skip
            self._audit(episode, tool_dicts[i])
            episodes.append(episode)
        return episodes

    def _audit(self, episode: Episode, tools: dict[str, Any]) -> None:
        """Count the episode's tool calls; name what TRL's loop passes over without a word: calls that do not parse or
        name no tool, and a reply left out because it did not fit."""
        messages = episode.messages
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            calls = message.get("tool_calls") or []
            episode.tool_calls += len(calls)
            content = message.get("content") or ""
            if not calls and self.marker and self.marker in content:
                episode.errors.append(MalformedToolCallError(
                    f"the model's tool call did not parse: {content[:200]!r}"))  # fmt: skip
            for call in calls:
                function = call.get("function") or {}
                if call.get("type") != "function" or function.get("name") not in tools:
                    episode.unknown_tool_calls += 1
                    episode.errors.append(
                        MalformedToolCallError(
                            f"the model called {function.get('name')!r}, not one of the tools {sorted(tools)}"
                        )
                    )
                elif not isinstance(function.get("arguments"), dict):  # TRL's `**arguments` failed: fed back, named
                    episode.unknown_tool_calls += 1
                    episode.errors.append(
                        MalformedToolCallError(
                            f"the model called {function.get('name')!r} with arguments "
                            f"{function.get('arguments')!r}: not an object"
                        )
                    )
            answered = k + 1 < len(messages) and messages[k + 1].get("role") == "tool"
            if calls and not answered:  # the loop ended on a call: out of iterations, or its reply did not fit
                rounds = sum(1 for m in messages[:k] if m.get("role") == "assistant" and m.get("tool_calls"))
                if rounds < self.host.max_tool_calling_iterations:
                    episode.errors.append(ContextOverflowError(
                        f"the reply to {[c.get('function', {}).get('name') for c in calls]} would exceed "
                        f"max_completion_length={self.max_completion_length} or the model's context "
                        f"({self.host.model.config.max_position_embeddings} tokens): the conversation ends "
                        "before it"))  # fmt: skip
                else:
                    episode.loop_exhausted = True
