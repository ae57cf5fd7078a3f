"""The parallelism layer: process groups, the `(dp, sp)` mesh, sequence-parallel split/gather, Ulysses attention.

The lowest of the three layers (parallel ← loss ← trainer): it imports neither the loss layer nor TRL, only torch
and, for the attention registration, transformers' `AttentionInterface`. The SP micro-batches of the trainer
(`hf_rlloss.trainer.common.sp_batch`) are not here although they are about sequence parallelism: they shard the
trainer's packed rows (`hf_rlloss.trainer.common.packing`, TRL's `TreeRow`) and the loss data of TRL's batches, so
they sit above it.

- `collectives`: `torch.distributed` wrappers that are no-ops in one process.
- `sequence`: the SP mesh and its groups, and the split/gather of a sequence dimension over an SP group.
- `ulysses`: the Ulysses attention registered with transformers, and the check that a model can use it.
- `tree_attention`: exact attention over a packed row of prefix-sharing sequences (TRL's `TreeRow` layout), SDPA
  per segment, registered with transformers.
"""

from .collectives import all_reduce, is_distributed, rank, world_size
from .sequence import (
    build_sp_mesh,
    destroy_process_groups,
    on_first_sp_rank,
    pad_to_multiple,
    sp_all_gather,
    sp_gather,
    sp_group,
    sp_rank,
    sp_shard_inputs,
    sp_split,
    sp_world_size,
)
from .tree_attention import TREE_SDPA_ATTENTION, register_tree_attention, tree_attention_forward
from .ulysses import (
    SP_WRAPPABLE_ATTENTION,
    ULYSSES_ATTENTION,
    register_ulysses_attention,
    ulysses_attention_forward,
    ulysses_sequence_parallel,
    use_ulysses_attention,
)

__all__ = [
    "SP_WRAPPABLE_ATTENTION",
    "TREE_SDPA_ATTENTION",
    "ULYSSES_ATTENTION",
    "all_reduce",
    "build_sp_mesh",
    "destroy_process_groups",
    "is_distributed",
    "on_first_sp_rank",
    "pad_to_multiple",
    "rank",
    "register_tree_attention",
    "register_ulysses_attention",
    "sp_all_gather",
    "sp_gather",
    "sp_group",
    "sp_rank",
    "sp_shard_inputs",
    "sp_split",
    "sp_world_size",
    "tree_attention_forward",
    "ulysses_attention_forward",
    "ulysses_sequence_parallel",
    "use_ulysses_attention",
    "world_size",
]
