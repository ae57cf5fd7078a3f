"""Vision-language models: the multimodal fields of TRL's batches, as the trainer's backbone forward takes them.

TRL's `GRPOTrainer` builds the multimodal inputs of a VLM (its processor's `pixel_values`, `image_grid_thw`,
`token_type_ids`, ..., extended over the completions) and feeds them, with the prompt and completion ids, to the
model's forward. `RLLossGRPOTrainer` runs the same forward one level down, on the model's backbone (e.g.
`Gemma3Model`, `Qwen2VLModel`: vision tower, projector and language model, without the LM head), and applies the LM
head in its chunked loss. This module says which fields go to that forward, and cuts them by rows for the no-grad
passes that score a generation batch a few rows at a time.

TRL also suppresses a VLM's image token in generation (`suppress_tokens`: a sampled image token would not match the
image features). That cuts the support of the sampling distribution, as top-k does; the rollout log-probs recorded
from HF `generate` treat it as such (`detach_token_suppression`, `token_suppression_replay`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
)
from trl import GRPOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid


def _trl_multimodal_fields() -> tuple[str, ...]:
    """The multimodal keys of TRL's batches: the keyword arguments of `GRPOTrainer._get_per_token_logps_and_entropies`
    after `compute_aux_loss` (`pixel_values`, `image_grid_thw`, `num_images`, `token_type_ids`, ...). Read from TRL's
    signature so that a key TRL adds is passed through too."""
    names = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    return tuple(names[names.index("compute_aux_loss") + 1 :])


MULTIMODAL_FIELDS = _trl_multimodal_fields()

SP_REFUSAL = (
    "sequence parallelism (sp_size > 1) does not support vision-language models: their forward puts the vision "
    "tower's features into the image-token positions of the whole sequence (and Qwen-VL-style models compute M-RoPE "
    "positions from the whole sequence), while an SP rank holds only a shard of a packed row; use sp_size=1"
)


def multimodal_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The multimodal fields a TRL batch holds (empty for a text model's batch).

    Tensors are model inputs; lists (`num_images`, `num_tiles`: images or tiles per row) say which of their rows
    belong to which sequence.
    """
    return {key: batch[key] for key in MULTIMODAL_FIELDS if batch.get(key) is not None}


def multimodal_rows(fields: dict[str, Any], rows: slice, num_rows: int) -> dict[str, Any]:
    """The fields of the sequences `rows` of a batch of `num_rows` sequences.

    Image tensors hold one entry per image, patch or tile rather than per sequence: TRL's own
    `split_pixel_values_by_grid` cuts them into one item per sequence (as its `_prepare_inputs` does to split a
    generation batch into micro-batches), the rows are selected, and `unsplit_pixel_values_by_grid` joins them again.

    Args:
        fields (`dict[str, Any]`): the batch's multimodal fields (`multimodal_inputs`).
        rows (`slice`): the sequences to keep.
        num_rows (`int`): the batch's number of sequences.

    Returns:
        `dict[str, Any]`: the same keys, for the sequences `rows` only (`fields` itself when `rows` covers the batch).
    """
    if not fields or (rows.start in (0, None) and rows.stop is not None and rows.stop >= num_rows):
        return fields
    out = {}
    for key, value in split_pixel_values_by_grid(fields).items():
        if len(value) != num_rows:
            raise ValueError(
                f"multimodal field {key!r} has {len(value)} entries after splitting by sequence, expected one per "
                f"sequence ({num_rows}); TRL's split_pixel_values_by_grid does not know this model's layout"
            )
        out[key] = value[rows]
    return unsplit_pixel_values_by_grid(out)


def backbone_inputs(backbone: nn.Module, fields: dict[str, Any] | None) -> tuple[dict[str, torch.Tensor], bool]:
    """The multimodal keyword arguments of `backbone`'s forward, and whether the trainer's own `(B, L)` positions
    apply.

    Every tensor field goes to the forward as TRL passes it to the model's; the row counts (lists) do not. A backbone
    that computes multi-dimensional rotary positions from the image grid (M-RoPE: Qwen2-VL, Qwen2.5-VL, GLM-4V, ...,
    which have `get_rope_index`) is given no positions when a grid is present: it derives them from the ids, the grid
    and the attention mask (left padding included), as its `generate` does. Other VLMs (LLaVA, Gemma 3, ...) number
    their positions like a text model, so the trainer's positions (counted from the first real token) apply.

    Args:
        backbone (`nn.Module`): the model's backbone (`base_model`), whose forward gets the fields.
        fields (`dict[str, Any]`, *optional*): the rows' multimodal fields; `None` or empty for a text model.

    Returns:
        `tuple[dict[str, torch.Tensor], bool]`: the keyword arguments, and `True` unless the backbone computes its
        positions itself.
    """
    kwargs = {key: value for key, value in (fields or {}).items() if isinstance(value, torch.Tensor)}
    has_grid = "image_grid_thw" in kwargs or "video_grid_thw" in kwargs
    return kwargs, not (has_grid and hasattr(backbone, "get_rope_index"))


# Processors that may sit between a token suppression and the truncating warpers: each sets logits to -inf or divides
# them by a positive constant, so each commutes with setting other logits to -inf.
_COMMUTES_WITH_SUPPRESSION = (
    TemperatureLogitsWarper,
    SuppressTokensLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
)


def detach_token_suppression(processors: LogitsProcessorList, cut: int) -> list[LogitsProcessor]:
    """Take the token suppressions (`SuppressTokensLogitsProcessor`: TRL's suppressed image token) out of the
    processors before index `cut` (the first truncating warper, or the end) and return them, to be put back at the
    cut, after the temperature; the list is changed in place.

    The sampling distribution is unchanged (the processors moved over commute with the suppression), and the
    distribution just before the cut is the full-vocabulary one, after the temperature, that the trainer's log-probs
    describe: the recorder reads the token's log-prob there and reports the suppressed mass as truncated, not as a
    rollout/trainer mismatch. Nothing is moved when another kind of processor sits in between.

    Args:
        processors (`LogitsProcessorList`): HF generate's processors, changed in place.
        cut (`int`): the index of the first truncating warper, or `len(processors)`.

    Returns:
        `list[LogitsProcessor]`: the suppressions taken out (empty when none is, or none can be moved).
    """
    first = next((i for i, p in enumerate(processors[:cut]) if isinstance(p, SuppressTokensLogitsProcessor)), None)
    if first is None or not all(isinstance(p, _COMMUTES_WITH_SUPPRESSION) for p in processors[first:cut]):
        return []
    suppressions = [p for p in processors[first:cut] if isinstance(p, SuppressTokensLogitsProcessor)]
    for processor in suppressions:
        processors.remove(processor)
    return suppressions


def token_suppression_replay(generation_config: Any) -> list[LogitsProcessor]:
    """The generation config's token suppression, to replay on the trainer's distribution with the truncating warpers
    (`rollout_logprobs_support="sampled"`), first as in generation after `detach_token_suppression`."""
    tokens = getattr(generation_config, "suppress_tokens", None)
    return [SuppressTokensLogitsProcessor(tokens)] if tokens else []
