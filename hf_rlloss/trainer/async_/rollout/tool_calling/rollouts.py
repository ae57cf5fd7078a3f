"""Multi-turn rollouts in the asynchronous trainer's rollout workers: TRL's `tools` and `environment_factory`.

The conversation loop is TRL's own: the workers run `GRPOTrainer._tool_call_loop` (the synchronous trainer's loop, TRL
1.16) on a `ToolLoopHost` (`rollout/tool_calling/trl_loop.py`) whose `_generate_single_turn` is the worker's sampler. A
multi-turn sample is therefore built exactly as `GRPOTrainer`, and so `RLLossGRPOTrainer`, builds it:

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
* **Named rollout errors** (`RolloutError`, `tool_calling/episodes.py`): a tool that raises (`ToolRaisedError`), a tool
  that does not return within `tool_timeout_s` (`ToolTimeoutError`), a reply that does not fit the context
  (`ContextOverflowError`), a tool call that does not parse or names no tool (`MalformedToolCallError`), and a turn
  cut by the completion budget in the middle of a tool call (`BudgetCutError`; a rollout error only under
  `on_budget_cut="rollout_error"`).
  `on_rollout_error` says what happens to a sample that met one: `"feed_back"` (TRL's behaviour: the error text is
  the tool's reply, the conversation goes on), `"drop"` (its whole group is dropped: a group's advantages are
  normalized together), or `"raise"` (the worker stops with the error, which the trainer raises). Every error and
  every dropped group is counted in a metric (`rollout/errors/<kind>_total`, `rollout/dropped_groups/<kind>_total`);
  nothing is dropped silently. The policy is `episodes.RolloutErrorPolicy`, applied by the workers' group scoring
  (`rollout/scoring.py`).
* **Tool calls side by side, each stoppable** (`rollout/tool_calling/runner.py`): a turn's tool calls run concurrently,
  a tool in a small process of its own that is killed when it does not return in time, an environment's method in a
  thread (with a bound on threads left hanging); every call that ends ticks the worker's heartbeat.
* **Each turn asks for the budget that remains**: the sampler is given, per conversation, `max_completion_length`
  minus the completion's tokens so far (the replies included).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)

from .episodes import (
    BudgetCutError,
    ContextOverflowError,
    Episode,
    MalformedToolCallError,
    RolloutError,
    RolloutErrorPolicy,
    ToolRaisedError,
    ToolTimeoutError,
)
from .runner import HungToolCallsError, ToolRunner, in_main_module
from .trl_loop import ModelContext, ToolLoopHost

__all__ = ["AgentSpec", "MultiTurnRollouts", "prepare_tokenizer"]

# a worker's sampler: one completion per prompt (ids up to and including the EOS) and its log-probs; the int counts the
# calls of a batch, the list is each prompt's completion budget (the tokens it may still sample)
Generate = Callable[[list[list[int]], int, list[int]], tuple[list[list[int]], list[list[float]]]]


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
        on_budget_cut (`str`, *optional*, defaults to `"keep"`): a turn cut by the completion budget in the middle of
            a tool call (`BudgetCutError`, always counted): `"keep"` trains it as a truncated completion,
            `"rollout_error"` makes it a rollout error that follows `on_rollout_error`.
        tool_processes (`int`, *optional*, defaults to `4`): processes the tools run in (concurrent tool calls; a
            call that does not return in time is stopped with its process); `0`: threads of the rollout process.
        max_hung_tool_threads (`int`, *optional*, defaults to `16`): calls run in threads (an environment's methods,
            tools under `tool_processes=0` or defined in the main script) that timed out and still run, beyond which
            the worker stops with `HungToolCallsError`.

    Example:

    ```python
    >>> from hf_rlloss.trainer.async_.rollout.tool_calling import AgentSpec
    >>> from hf_rlloss.recipe_support.tools import TOOLS
    >>> AgentSpec(tools=list(TOOLS.values()), tool_timeout_s=10, on_rollout_error="drop").tool_processes
    4
    ```
    """

    tools: list[Callable] = dataclasses.field(default_factory=list)
    environment_factory: Any = None
    max_iterations: int | None = None
    tool_timeout_s: float = 60.0
    on_rollout_error: str = "feed_back"
    on_budget_cut: str = "keep"
    tool_processes: int = 4
    max_hung_tool_threads: int = 16

    def __post_init__(self) -> None:
        RolloutErrorPolicy(self.on_rollout_error, self.on_budget_cut)  # refuses a value it does not allow
        for name, least in (("tool_processes", 0), ("max_hung_tool_threads", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}")
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
    def policy(self) -> RolloutErrorPolicy:
        """What becomes of a group whose episodes met a rollout error (applied by the worker's group scoring)."""
        return RolloutErrorPolicy(self.on_rollout_error, self.on_budget_cut)

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None


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
    """A tool as TRL's loop calls it: the call is collected from the batch's `ToolRunner` (started with its turn's
    others, `_ToolBatch`), for at most `tool_timeout_s`; its errors are recorded on the episode's list.

    On an exception the original is re-raised, so that TRL's loop feeds back exactly what `GRPOTrainer` would."""

    def __init__(self, tool: Callable, errors: list[RolloutError], batch: _ToolBatch, sample: int):
        self.tool, self.errors, self.batch, self.sample = tool, errors, batch, sample
        self.__name__ = tool.__name__
        self.__qualname__ = getattr(tool, "__qualname__", tool.__name__)  # Python's `**` error names the tool by it
        environment = getattr(tool, "__self__", None)
        self.lane = environment if inspect.ismethod(tool) else None  # an environment's calls: in order, in a thread
        self.thread = self.lane is not None or in_main_module(tool)

    def submit(self, arguments: Mapping[str, Any]):
        return self.batch.runner.submit(self.tool, dict(arguments), self.lane, thread=self.thread)

    def __call__(self, **arguments: Any) -> Any:
        try:
            outcome = self.batch.runner.result(self.batch.take(self, arguments))
        except HungToolCallsError as error:  # TRL's loop feeds back every Exception: the batch raises it after
            self.batch.fatal = self.batch.fatal or error
            raise
        if outcome[0] == "timeout":
            error = ToolTimeoutError(f"tool {self.__name__!r} {outcome[1]}")
            self.errors.append(error)
            raise error
        if outcome[0] == "raised":
            cause = outcome[1]
            error = ToolRaisedError(f"tool {self.__name__!r} raised {type(cause).__name__}: {cause} (arguments "
                                    f"{arguments!r})")  # fmt: skip
            error.__cause__ = cause
            self.errors.append(error)
            raise cause
        return outcome[1]


class _ToolBatch:
    """The tool calls of one batch: at the first call TRL's loop makes in a turn, every call of that turn (the last
    assistant message of each conversation, not seen before) is submitted to the runner, so that they run side by side
    while TRL's loop collects them one after another."""

    def __init__(self, runner: ToolRunner, completions: list[list[dict]], tool_dicts: list[dict[str, _Guarded]]):
        self.runner, self.completions, self.tool_dicts = runner, completions, tool_dicts
        self.seen: set[tuple[int, int]] = set()
        self.queued: dict[int, list[Any]] = {}
        self.fatal: HungToolCallsError | None = None  # raised by `rollout` once TRL's loop returns

    def submit_turn(self) -> None:
        for j, messages in enumerate(self.completions):
            message = messages[-1] if messages else {}
            if message.get("role") != "assistant" or (j, len(messages)) in self.seen:
                continue
            self.seen.add((j, len(messages)))
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                tool = self.tool_dicts[j].get(function.get("name"))
                if call.get("type") == "function" and tool is not None and isinstance(function.get("arguments"),
                                                                                       Mapping):  # fmt: skip
                    self.queued.setdefault(j, []).append(tool.submit(function["arguments"]))

    def take(self, tool: _Guarded, arguments: dict[str, Any]):
        """The submitted call of `tool` with `arguments` in its conversation (submitted now if none is)."""
        self.submit_turn()
        queued = self.queued.get(tool.sample, [])
        for k, call in enumerate(queued):
            if call.function is tool.tool and call.arguments == arguments:
                return queued.pop(k)
        return tool.submit(arguments)


class MultiTurnRollouts:
    """TRL's tool-calling loop around a worker's sampler (see the module docstring).

    Args:
        spec (`AgentSpec`): the tools, environments and error policy.
        tokenizer: the tokenizer, prepared by `prepare_tokenizer`.
        chat_template_kwargs (`dict`): as TRL's `chat_template_kwargs`.
        max_completion_length (`int`): the completion budget over all turns (replies included), as in TRL.
        max_model_len (`int`): the model's context.
        tick (`Callable`, *optional*): called whenever a tool call ends (the worker's heartbeat).
    """

    def __init__(self, spec: AgentSpec, tokenizer: Any, chat_template_kwargs: dict[str, Any],
                 max_completion_length: int, max_model_len: int, tick: Callable[[], None] | None = None):  # fmt: skip
        self.spec, self.tok = spec, tokenizer
        self.runner = ToolRunner(spec.tool_timeout_s, spec.tool_processes, spec.max_hung_tool_threads, tick,
                                 preload=spec.tools)  # fmt: skip
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
        self.host = ToolLoopHost(
            processing_class=tokenizer,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
            max_completion_length=max_completion_length,
            max_tool_calling_iterations=math.inf if spec.max_iterations is None else spec.max_iterations,
            model=ModelContext(max_position_embeddings=max_model_len),
            tools=self.all_tools(),
            environment_factories=self.factories,
            _env_tools=self.env_tools,
        )

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
        """`num_generations` conversations per row, consecutive. `generate(prompt_ids, call, budgets)` samples one
        completion per prompt (ids up to and including the EOS, and their log-probs), at most `budgets[i]` tokens for
        prompt `i` (the completion budget its conversation has left); `call` counts the calls of this batch."""
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
        completion_ids, logprobs = generate(prompt_ids, next(calls), [self.max_completion_length] * len(prompt_ids))
        completions = [
            [parse_response(self.tok, ids, prefix=prompt_ids[i], tools=self._tools_of(names[i]))]
            for i, ids in enumerate(completion_ids)
        ]
        errors: list[list[RolloutError]] = [[] for _ in prompts]
        batch = _ToolBatch(self.runner, completions, [])
        for i, environment in enumerate(environments):
            tools = list(self.spec.tools) + ([] if environment is None else _method_tools(environment))
            batch.tool_dicts.append({t.__name__: _Guarded(t, errors[i], batch, i) for t in tools})
        host = self.host
        host._batch_environments = names
        host._sync_tool_dicts, host._async_tool_dicts = batch.tool_dicts, [{} for _ in prompts]

        def next_turn(ids, images, fields, num_generations, **_):
            return generate(ids, next(calls), self._budgets(ids, prompt_ids, completion_ids))

        host._generate_single_turn = next_turn
        try:
            result = host.run(copy.deepcopy(prompts), prompt_ids, completion_ids, completions, logprobs)
        finally:
            self.runner.abandon()
            self._retire_hung(names, environments)
        if batch.fatal is not None:
            raise batch.fatal
        tool_dicts = batch.tool_dicts
        if any(result.tool_images):
            raise ValueError("a tool replied with images: the asynchronous rollout workers are text-only")
        episodes = []
        for i, prompt in enumerate(prompts):
            episode = Episode(prompt, prompt_ids[i], result.completion_ids[i], result.tool_mask[i], result.logprobs[i],
                              result.completions[i], environments[i], errors=errors[i])  # fmt: skip
            self._audit(episode, tool_dicts[i])
            episodes.append(episode)
        return episodes

    def _budgets(self, ids: list[list[int]], prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list:
        """The completion budget left to each conversation TRL's loop continues (`ids`: its prompt, completion so far
        and the replies): `max_completion_length` minus the completion's tokens (at least 1: TRL's loop cuts what
        exceeds)."""
        budgets = []
        for sequence in ids:
            prompt = max(
                (p for p, c in zip(prompt_ids, completion_ids, strict=True)
                 if sequence[: len(p) + len(c)] == p + c),
                key=len, default=[],
            )  # fmt: skip
            budgets.append(max(1, self.max_completion_length - (len(sequence) - len(prompt))))
        return budgets

    def _retire_hung(self, names: list[Any], environments: list[Any]) -> None:
        """Replace in the pool, by a new one from its factory, an environment whose call timed out and still runs
        (its thread cannot be stopped; the runner counts it against `max_hung_tool_threads`)."""
        for name, environment in zip(names, environments, strict=True):
            if environment is not None and self.runner.is_hung(environment):
                pool = self.pool[name]
                pool[next(k for k, e in enumerate(pool) if e is environment)] = self.factories[name]()

    def close(self) -> None:
        """Stop the tool processes."""
        self.runner.close()

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
                episode.errors.append(self._unparsed_call(episode, k == len(messages) - 1, content))
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

    def _unparsed_call(self, episode: Episode, last: bool, content: str) -> RolloutError:
        """A tool call that does not parse: cut by the budget (`BudgetCutError`) when it is the conversation's last
        turn and the completion, or the sequence, is at its bound; else malformed."""
        used = len(episode.completion_ids)
        context = self.host.model.config.max_position_embeddings
        if last and (used >= self.max_completion_length or len(episode.prompt_ids) + used >= context):
            return BudgetCutError(
                f"the completion budget ran out in the middle of a tool call ({used} completion tokens, "
                f"max_completion_length={self.max_completion_length}, context {context}): {content[-200:]!r}; "
                f"on_budget_cut={self.spec.on_budget_cut!r} ('keep': trained as a truncated completion, "
                "'rollout_error': follows on_rollout_error)"
            )
        return MalformedToolCallError(f"the model's tool call did not parse: {content[:200]!r}")
