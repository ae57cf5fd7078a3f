"""Shared-prompt generation: HF `generate` prefills each distinct prompt of a batch once for all of its rows.

TRL repeats every prompt `num_generations` times before HF `generate`, so the prefill would run G times over the same
tokens. `sharing_prompts` wraps `generate` on the model instance for one call: the distinct prompts (rows equal in
tokens and mask) run their prefill once, all but the last prompt token, into a `DynamicCache`; the cache's rows are
copied to the batch's rows, the full-attention layers into buffers of the call's whole length that decoding writes
into (`preallocated_cache.PreallocatedLayer`: no per-step copy of the cache), the others by `Cache.reorder_cache`
(the row selection beam search uses, e.g. sliding-window layers); `generate` then gets the
whole left-padded batch with that cache, skips the cached positions and runs the last prompt token of every row, so
the first sampled token's logits, the logits processors (the log-prob recorder, penalties, warpers), sampling and
stopping are those of an ordinary call. The prefill mirrors `generate`'s own first forward: the positions counted
from the first real token, the mask dropped when there is no padding, the logits of the last position only.

What cannot share falls back to the ordinary call, said once in the log: encoder-decoder models, models without a
`DynamicCache`, a cache implementation or cache of the caller's, beam search and other non-sampling modes,
`num_return_sequences > 1`, extra model inputs (VLM pixels, token types), prompts of one token, a call made with
positional arguments. A batch whose rows are all distinct (tool-call turns, one generation per prompt) has nothing
to share and runs unchanged, silently. The synchronous trainer and the CPU rollout worker also set sharing aside
under `routing_replay="rollout"` (the routes are recorded row by row), said once when they are built.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import logging

from .preallocated_cache import preallocate_cache
from .transformers_compat import CACHE_ARGUMENT

logger = logging.get_logger(__name__)

__all__ = ["distinct_rows", "prefill_distinct_prompts", "shared_prompt_generation", "sharing_prompts", "unshareable"]

# Generation modes whose rows are decoded independently from one cache row each (beam search re-ranks rows).
SHAREABLE_MODES = (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH)


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first row of each distinct prompt `(U,)` and, for every row, the index of its prompt among them `(B,)`.

    Rows are the same prompt when their tokens and their mask agree (the same padding too).
    """
    rows = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)  # (B, 2L)
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)  # (B,) in 0..U-1, sorted order
    first = torch.full((int(inverse.max()) + 1,), rows.size(0), dtype=torch.long, device=rows.device)
    first = first.scatter_reduce(0, inverse, torch.arange(rows.size(0), device=rows.device), "amin")  # (U,)
    order = torch.argsort(first)  # distinct prompts in order of first appearance
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return first[order], rank[inverse]


def unshareable(lm: nn.Module, config: GenerationConfig, model_kwargs: dict[str, Any]) -> str | None:
    """Why this `generate` call cannot share its prompts' prefill (a short reason), or `None` when it can.

    Args:
        lm (`nn.Module`): the causal LM whose `generate` runs.
        config (`GenerationConfig`): the call's generation settings (the model's, updated with the call's).
        model_kwargs (`dict`): the call's keyword arguments that are not generation settings.
    """
    if lm.config.is_encoder_decoder:
        return "encoder-decoder model"
    if not lm._supports_default_dynamic_cache():
        return f"{type(lm).__name__} does not use a DynamicCache"
    if config.use_cache is False:
        return "use_cache=False"
    if config.cache_implementation is not None:
        return f"cache_implementation={config.cache_implementation!r}"
    if config.get_generation_mode() not in SHAREABLE_MODES:
        return f"generation mode {config.get_generation_mode().value!r}"
    if (config.num_return_sequences or 1) > 1:
        return "num_return_sequences > 1"
    extra = sorted(k for k, v in model_kwargs.items() if k not in ("input_ids", "attention_mask") and v is not None)
    if extra:
        return f"inputs other than input_ids and attention_mask ({', '.join(extra)})"
    return None


def prefill_distinct_prompts(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    first: torch.Tensor,
    inverse: torch.Tensor,
    capacity: int | None = None,
) -> DynamicCache:
    """The KV cache of every row's prompt but its last token, computed once per distinct prompt.

    Args:
        lm (`nn.Module`): the causal LM.
        input_ids (`torch.Tensor` of shape `(B, L)`): the left-padded prompts.
        attention_mask (`torch.Tensor` of shape `(B, L)`): their mask.
        first (`torch.Tensor` of shape `(U,)`): a row of each distinct prompt (`distinct_rows`).
        inverse (`torch.Tensor` of shape `(B,)`): each row's distinct prompt.
        capacity (`int`, *optional*): positions the call will hold (prompt and completion). When given, the
            full-attention layers are copied into buffers of that many positions that decoding writes into
            (`preallocate_cache`); otherwise every layer stays a `DynamicLayer`.

    Returns:
        `DynamicCache` of `B` rows and `L - 1` positions, row `b` the prefill of prompt `inverse[b]`.
    """
    ids = input_ids[first, :-1]  # (U, L-1)
    mask = attention_mask[first, :-1]  # (U, L-1)
    # generate's positions: counted from the first real token, 0 on padding
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache = DynamicCache(config=lm.config.get_text_config(decoder=True))
    kwargs = {"use_cache": True}
    if "logits_to_keep" in inspect.signature(lm.forward).parameters:
        kwargs["logits_to_keep"] = 1  # as generate: the logits of the last position only (here unused)
    inputs = lm.prepare_inputs_for_generation(
        ids,
        **{CACHE_ARGUMENT: cache},
        # generate drops a mask without padding (SDPA's causal path); the mask of the whole batch decides it
        attention_mask=None if bool(attention_mask.all()) else mask,
        position_ids=position_ids,
        is_first_iteration=True,
        **kwargs,
    )
    lm(**inputs, return_dict=True)
    rows = inverse.to(input_ids.device)
    if capacity is None:
        cache.reorder_cache(rows)  # (U, …) -> (B, …): one copy per row, as an ordinary call holds
        return cache
    return preallocate_cache(cache, rows, capacity)


def _unshareable_call(args: tuple[Any, ...], input_ids: torch.Tensor | None) -> str | None:
    """Why the prompts of a `generate` call cannot even be compared (a short reason), or `None`."""
    if args:  # generate(inputs, generation_config, ...) positionally: not how TRL or the worker call it
        return "generate called with positional arguments"
    if input_ids is None or input_ids.dim() != 2:
        return "no (batch, length) input_ids"
    return None


def _say_unshared(reason: str) -> None:
    """Log, once per reason, that a `generate` call runs without sharing its prompts' prefill."""
    logger.warning_once(f"shared-prompt generation is off for this model and these settings: {reason}")


def _shared_generate(lm: nn.Module, generate: Callable[..., Any], preallocate: bool, *args: Any, **kwargs: Any) -> Any:
    """`generate(*args, **kwargs)` with the distinct prompts' prefill shared, or as called when it cannot be."""
    input_ids = kwargs.get("input_ids", kwargs.get("inputs"))
    reason = _unshareable_call(args, input_ids)
    if reason is not None:
        _say_unshared(reason)
        return generate(*args, **kwargs)
    # the settings generate will use: the call's over the model's over transformers' defaults
    rest = {k: v for k, v in kwargs.items() if k not in ("generation_config", "inputs")}
    config, model_kwargs = lm._prepare_generation_config(kwargs.get("generation_config"), **rest)
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    first, inverse = distinct_rows(input_ids, attention_mask)
    if first.numel() == input_ids.size(0):
        return generate(*args, **kwargs)  # every prompt distinct: nothing to share
    reason = unshareable(lm, config, model_kwargs)
    if reason is None and input_ids.size(1) < 2:
        reason = "every prompt is one token long (the prefill before the last prompt token is empty)"
    if reason is not None:
        _say_unshared(reason)
        return generate(*args, **kwargs)
    inputs = {k: v for k, v in kwargs.items() if k != "inputs"}
    inputs["input_ids"] = input_ids
    inputs["attention_mask"] = attention_mask
    # the positions the call will hold: generate's max_length is the prompt plus max_new_tokens when that is set
    capacity = input_ids.size(1) + config.max_new_tokens if config.max_new_tokens is not None else config.max_length
    inputs[CACHE_ARGUMENT] = prefill_distinct_prompts(
        lm, input_ids, attention_mask, first, inverse, capacity if preallocate else None
    )
    return generate(**inputs)


@contextlib.contextmanager
def sharing_prompts(lm: nn.Module, enabled: bool = True, preallocate: bool = True) -> Iterator[None]:
    """Inside the block, every `lm.generate` call prefills each distinct prompt of its batch once.

    `generate` is wrapped on the instance (other models are untouched; a PEFT model's `generate` reaches it through
    its base model) and restored on exit, including an instance attribute that was already there.

    Args:
        lm (`nn.Module`): the causal LM (the base model of a PEFT model).
        enabled (`bool`, *optional*, defaults to `True`): `False` leaves `generate` as it is.
        preallocate (`bool`, *optional*, defaults to `True`): decode into buffers of the call's length
            (`preallocated_cache.PreallocatedLayer`) instead of `DynamicLayer`'s concatenation; the results are the
            same, `False` is there to measure the difference.
    """
    if not enabled:
        yield
        return
    shadowed = vars(lm).get("generate")
    lm.generate = functools.partial(_shared_generate, lm, lm.generate, preallocate)
    try:
        yield
    finally:
        if shadowed is None:
            del lm.generate
        else:
            lm.generate = shadowed


def shared_prompt_generation(call: Callable[..., Any], lm: nn.Module, enabled: bool) -> Callable[..., Any]:
    """`call` (e.g. TRL's `_generate_single_turn`) running with `lm`'s prompts shared (`sharing_prompts`)."""

    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        with sharing_prompts(lm, enabled):
            return call(*args, **kwargs)

    return run
