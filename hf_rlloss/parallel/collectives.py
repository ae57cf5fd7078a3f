"""Thin wrappers over ``torch.distributed`` that degrade to no-ops in a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` (returned for chaining); identity when not distributed."""
    if is_distributed() and world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor
