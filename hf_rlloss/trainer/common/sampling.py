"""HF `generate` on prompts of different lengths: left-pad, generate, and cut each completion after its first EOS."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def cut_at_eos(ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """The completion up to and including its first EOS (the padding after it dropped)."""
    for t, token in enumerate(ids):
        if token in eos_ids:
            return list(ids[: t + 1])
    return list(ids)


def generate_and_cut(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    eos_ids: Sequence[int],
    seed: int | None = None,
    *,
    fork_rng: bool = True,
    **generate_kwargs: Any,
) -> list[list[int]]:
    """One completion per prompt: the prompts left-padded into one `model.generate` call, each completion cut after
    its first EOS (included, as TRL keeps it).

    Args:
        model: a transformers model with `generate`.
        prompt_ids (`Sequence[Sequence[int]]`): the token ids of each prompt.
        pad_token_id (`int`): the id left-padding the prompts.
        eos_ids (`Sequence[int]`): the ids that end a completion.
        seed (`int`, *optional*): sample under `torch.manual_seed(seed)`, the caller's RNG state restored after.
        fork_rng (`bool`, *optional*, defaults to `True`): restore the caller's RNG state after sampling; `False`
            (with no `seed`): sample from the caller's RNG and leave it advanced, so that successive calls continue
            one random stream.
        **generate_kwargs: passed to `generate` (`do_sample`, `temperature`, `max_new_tokens`, …).
    """
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.tensor([[pad_token_id] * (width - len(ids)) + list(ids) for ids in prompt_ids])  # (B, width)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])  # (B, width)
    if not fork_rng and seed is not None:
        raise ValueError(f"generate_and_cut: seed={seed} with fork_rng=False; a seed is set in a forked RNG only")
    with torch.random.fork_rng(devices=[], enabled=fork_rng):
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=mask.to(model.device),
            pad_token_id=pad_token_id,
            eos_token_id=list(eos_ids),
            **generate_kwargs,
        )
    return [cut_at_eos(ids, eos_ids) for ids in out[:, width:].tolist()]
