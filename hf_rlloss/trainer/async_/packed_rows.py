"""The packed row of the asynchronous trainer: what TRL's collator sends for a micro-batch, and what the loss reads.

TRL's `DataCollatorForRollout` packs a micro-batch's samples into prefix-trie rows (`TreeRow.pack`): the forwarded
tokens, the tree attention's layout, and per loss term the packed position whose hidden state predicts it
(`token_index`). `VersionedCollator` also sends what the trainer measures and counts: each row's sample count, each
sample's policy version, the prompt groups of the micro-batch and, under MoE routing replay, the sampled routes.
`packed_row` reads one rank's slice of that batch into a `PackedRow`; `keep_samples` takes samples' loss terms out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout

from .routing_replay import collate_routes

__all__ = ["PackedRow", "VersionedCollator", "keep_samples", "packed_row"]


@dataclass
class PackedRow:
    """One rank's packed row of a micro-batch, its inter-rank padding stripped (as TRL's `compute_loss` strips it).

    `N` forwarded tokens, `M` trained tokens (loss terms), `S` samples.
    """

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    tree_kwargs: dict[str, Any]  # TRL's tree_* layout keywords for the attention
    token_index: torch.Tensor  # (M,) packed position whose hidden state predicts each target
    labels: torch.Tensor  # (M,) the target tokens
    behavior_logprobs: torch.Tensor  # (M,) the sampler's log-probs of the targets
    advantages: torch.Tensor  # (M,)
    num_tokens: torch.Tensor  # (S,) trained tokens of each sample (the loss terms are grouped by sample)
    sample_versions: torch.Tensor | None = None  # (S,) the policy version that sampled each sample
    routed_experts: torch.Tensor | None = None  # (N, L, k) MoE routes replayed per packed position (routing_replay)


def keep_samples(row: PackedRow, keep: torch.Tensor) -> PackedRow:
    """`row` with the loss terms of the samples where `keep` `(S,)` is False taken out (their tokens are still
    forwarded, as context of the samples sharing a prefix with them, but trained on by no loss term)."""
    if bool(keep.all()):
        return row
    terms = torch.repeat_interleave(keep, row.num_tokens)  # (M,) the loss terms are grouped by sample, in order
    return dataclasses.replace(
        row,
        token_index=row.token_index[terms],
        labels=row.labels[terms],
        behavior_logprobs=row.behavior_logprobs[terms],
        advantages=row.advantages[terms],
        num_tokens=row.num_tokens[keep],
        sample_versions=None if row.sample_versions is None else row.sample_versions[keep],
    )


def packed_row(inputs: dict[str, torch.Tensor]) -> PackedRow:
    """The `PackedRow` of a rank's slice of a batch from TRL's `DataCollatorForRollout` (see its `TreeRow.pack`)."""
    mask = inputs["attention_mask"].bool()
    selected = inputs["token_index"] >= 0
    token_index = inputs["token_index"][selected]
    segment_id = inputs["segment_id"][selected]
    tree_kwargs = {
        key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
    }
    tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    # TRL's collator does not send the samples of a row; `VersionedCollator` does (an empty row has none)
    if "num_samples" in inputs:
        samples = int(inputs["num_samples"][0])
    else:
        samples = int(segment_id.max()) + 1 if segment_id.numel() else 0
    versions = inputs["sample_versions"][0, :samples] if "sample_versions" in inputs else None
    routes = inputs["routed_experts"][mask] if "routed_experts" in inputs else None  # (N, L, k)
    return PackedRow(
        input_ids=inputs["input_ids"][mask].unsqueeze(0),
        position_ids=inputs["position_ids"][mask].unsqueeze(0),
        tree_kwargs=tree_kwargs,
        token_index=token_index,
        labels=inputs["shift_labels"][mask][token_index],
        behavior_logprobs=inputs["old_log_probs"][selected].float(),
        advantages=inputs["advantages"][selected].float(),
        num_tokens=torch.bincount(segment_id, minlength=samples),
        sample_versions=versions,
        routed_experts=routes,
    )


@dataclass
class VersionedCollator(DataCollatorForRollout):
    """TRL's collator, also sending each row's sample count (`num_samples`), the policy version of each of its
    samples (`sample_versions`, padded with -1): the trainer measures their lag when it trains them, and on every row
    the group ids of the whole micro-batch (`micro_batch_groups`, padded with -1): every rank counts the prompts
    trained (the rollout state of a checkpoint)."""

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        batch = super().torch_call(examples)
        (rows,) = examples
        batch["num_samples"] = torch.tensor([len(row.samples) for row in rows])
        width = max(1, max(len(row.samples) for row in rows))
        versions = torch.full((len(rows), width), -1, dtype=torch.long)
        for r, row in enumerate(rows):
            for i, sample in enumerate(row.samples):
                versions[r, i] = int(sample.get("model_version", -1))
        batch["sample_versions"] = versions
        groups = sorted({int(sample["group_id"]) for row in rows for sample in row.samples})
        batch["micro_batch_groups"] = torch.tensor([groups or [-1]] * len(rows), dtype=torch.long)
        mask = batch["attention_mask"].bool()
        ids = [batch["input_ids"][r][mask[r]] for r in range(len(rows))]
        routes = collate_routes(rows, ids, mask.shape[1], self.metrics)  # MoE routing replay: (R, N, L, k)
        if routes is not None:
            batch["routed_experts"] = routes
        return batch
