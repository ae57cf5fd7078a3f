"""Sequence parallelism in the synchronous trainer: the SP group's data and its packed micro-batches.

Under `sp_size > 1` the policy runs Ulysses attention over an SP group of ranks (`_setup_sequence_parallel`). Each
rank loads its `1/sp_size` share of the group's generation batch (`get_train_dataloader`), generates and scores it;
the group then pools the scored batch, shuffles it alike on every rank and splits it into micro-batches
(`_sp_buffered_inputs`, with `common/sp_batch.py`'s `pool_over_group` and `shared_permutation`), and each micro-batch
is packed into one row whose shard this rank forwards (`_sp_pack_batch`, `SPMicroBatch`). The backward, and the
recomputation of gradient checkpointing in it, runs the SP attention too (`training_step`). `SequenceParallelBatches`
is mixed into `RLLossGRPOTrainer`; the design is in docs/design.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from trl.trainer.utils import split_tensor_dict

from ...parallel.sequence import build_sp_mesh
from ...parallel.ulysses import ulysses_sequence_parallel, use_ulysses_attention
from ..common.lm_head import causal_lm
from ..common.sp_batch import SPMicroBatch, shared_permutation

__all__ = ["SequenceParallelBatches"]


class SequenceParallelBatches:
    """The SP setup, data loading and micro-batches of `RLLossGRPOTrainer` (a `GRPOTrainer` mixin)."""

    def _setup_sequence_parallel(self, unwrapped: nn.Module) -> None:
        """The policy on the Ulysses attention and `self.sp_mesh` (processes % sp_size: `RLLossGRPOConfig`'s check)."""
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        if parallelism is not None and (
            getattr(parallelism, "sp_enabled", False) or getattr(parallelism, "cp_enabled", False)
        ):
            raise ValueError(
                "sp_size > 1 is RLLossGRPOTrainer's own Ulysses sequence parallelism: do not also enable Accelerate's "
                "ParallelismConfig sp_size/cp_size (DeepSpeed ALST / context parallelism)"
            )
        use_ulysses_attention(causal_lm(unwrapped), self.args.sp_size, "the policy", self.args.disable_dropout)
        self.sp_mesh = build_sp_mesh(self.args.sp_size, device_type=self.accelerator.device.type)

    # TRL override points

    def get_train_dataloader(self):
        # TRL override: under SP each rank loads its 1/sp_size share of its SP group's generation batch.
        get_dataloader, shadowed = self._get_dataloader, vars(self).get("_get_dataloader")

        def share(**kwargs):
            return get_dataloader(**{**kwargs, "batch_size": kwargs["batch_size"] // self.args.sp_size})

        self._get_dataloader = share
        try:
            return super().get_train_dataloader()
        finally:
            if shadowed is None:
                del self._get_dataloader
            else:
                self._get_dataloader = shadowed

    def get_total_train_batch_size(self, args) -> int:
        # TRL override: sequences per optimizer step (logged, throughput); an SP group is one data-parallel replica.
        return super().get_total_train_batch_size(args) // getattr(args, "sp_size", 1)

    def training_step(self, model, inputs, num_items_in_batch=None):
        # TRL override: under SP the backward, and the recomputation of gradient checkpointing in it, must run the
        # Ulysses attention too; generation and scoring (in `_prepare_inputs`) leave the SP context.
        if self.sp_mesh is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with ulysses_sequence_parallel(self.sp_mesh):
            return super().training_step(model, inputs, num_items_in_batch)

    def _sp_buffered_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's `_prepare_inputs` (training) for an SP group: generate, pool, shuffle alike on the group, split."""
        spg = self.args.steps_per_generation
        if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)  # the SP group's pooled batch
            permutation = shared_permutation(batch["prompt_ids"].shape[0], self.sp_mesh, batch["prompt_ids"].device)
            batch = {k: v[permutation] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
            self._buffered_inputs = split_tensor_dict(batch, spg)
        return self._buffered_inputs[self._step % spg]

    def _sp_pack_batch(self, inputs: dict[str, Any]) -> SPMicroBatch:
        """This rank's view of a micro-batch packed into one row (see `SPMicroBatch`)."""
        return SPMicroBatch.from_layout(self._sp_layout(inputs), self.sp_mesh, self._tokenizer.pad_token_id)
