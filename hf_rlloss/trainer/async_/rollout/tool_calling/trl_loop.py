"""TRL's tool-calling loop run outside `GRPOTrainer`: the host it runs on, and its result by name.

The rollout workers run TRL's own loop, `GRPOTrainer._tool_call_loop` (with `_get_tool_suffix_ids`), so that a
multi-turn sample is built exactly as the synchronous trainer builds it (`rollout/tool_calling/rollouts.py`). Those are
methods of `GRPOTrainer` and read what they need from `self`: `ToolLoopHost` is the object they run on, with every
attribute they read declared (`tests/test_trl_tool_loop.py` reads the attributes from TRL's source and fails naming any
the host lacks, so that a TRL change fails at test time rather than in a spawned worker).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from trl import GRPOTrainer

__all__ = ["ModelContext", "ToolLoopHost", "ToolLoopResult"]


class ToolLoopResult(NamedTuple):
    """What `GRPOTrainer._tool_call_loop` returns, by name (TRL returns the 7 as a tuple, in this order)."""

    tool_mask: list[list[int]]  # 1: a model token, 0: a tool's or environment's reply
    completions: list[list[dict[str, Any]]]  # each conversation's completion as messages
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    tool_call_count: int
    tool_failure_count: int
    tool_images: list[list[Any]]


@dataclasses.dataclass
class ModelContext:
    """The model as the loop reads it: `model.config.max_position_embeddings`, its context."""

    max_position_embeddings: int

    @property
    def config(self) -> ModelContext:
        return self


@dataclasses.dataclass
class ToolLoopHost:
    """The `self` of TRL's `GRPOTrainer._tool_call_loop` and `_get_tool_suffix_ids`, outside a trainer.

    Args:
        processing_class: the tokenizer (also the loop's `_tokenizer`: text only).
        chat_template (`str`, *optional*): the template the replies are rendered with (TRL's prefix-preserving
            training template when the tokenizer's is not); `None`: the tokenizer's.
        chat_template_kwargs (`dict`): as TRL's `chat_template_kwargs`.
        max_completion_length (`int`): the completion budget over all turns, replies included.
        max_tool_calling_iterations (`float`): the turns with tool calls at most (`math.inf`: until the budget).
        model (`ModelContext`): the model's context length, as `model.config.max_position_embeddings`.
        tools (`list[Callable]`): every tool (the tools, then the environments' methods), for parsing replies.
        environment_factories (`dict`, *optional*): the environments' factories by name, or `None`.
        env_tools (`dict`): each environment name's tools.

    Set per batch by `MultiTurnRollouts.rollout`: `_batch_environments` (each conversation's environment name),
    `_sync_tool_dicts` (each conversation's tools by name), `_async_tool_dicts` (none: empty dicts) and
    `_generate_single_turn` (the worker's sampler).

    Example:

    ```python
    >>> import math
    >>> from transformers import AutoTokenizer
    >>> from hf_rlloss.trainer.async_.rollout.tool_calling import ModelContext, ToolLoopHost
    >>> tok = AutoTokenizer.from_pretrained("Qwen/Qwen3-0.6B")  # doctest: +SKIP
    >>> host = ToolLoopHost(tok, None, {}, 64, math.inf, ModelContext(4096), [], None, {})  # doctest: +SKIP
    >>> host.run(prompts, prompt_ids, completion_ids, completions, logprobs).tool_mask  # doctest: +SKIP
    ```
    """

    processing_class: Any
    chat_template: str | None
    chat_template_kwargs: dict[str, Any]
    max_completion_length: int
    max_tool_calling_iterations: float
    model: ModelContext
    tools: list[Callable]
    environment_factories: dict[Any, Callable] | None
    _env_tools: dict[Any, list[Callable]]
    # set per batch (`MultiTurnRollouts.rollout`)
    _batch_environments: list[Any] = dataclasses.field(default_factory=list)
    _sync_tool_dicts: list[dict[str, Callable]] = dataclasses.field(default_factory=list)
    _async_tool_dicts: list[dict[str, Callable]] = dataclasses.field(default_factory=list)
    _generate_single_turn: Callable | None = None
    # the paths the workers never take: a vision-language model, vLLM in the trainer's process, async tools
    _is_vlm: bool = False
    use_vllm: bool = False
    vllm_mode: str | None = None
    vllm_generation: Any = None
    async_loop: Any = None

    @property
    def _tokenizer(self) -> Any:
        return self.processing_class

    def _get_tool_suffix_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """TRL's: the token ids of the replies, rendered by the chat template between two turns."""
        return GRPOTrainer._get_tool_suffix_ids(self, tool_messages)

    def run(self, prompts, prompt_ids, completion_ids, completions, logprobs) -> ToolLoopResult:
        """TRL's loop on the batch's first turns (text only: no images, no multimodal fields)."""
        return ToolLoopResult(
            *GRPOTrainer._tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, None, {})
        )
