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


def all_gather_1d(local: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 1-D `local` tensors of every rank of `group`, concatenated in rank order (ranks may hold different
    lengths); `local` itself when not distributed."""
    local = local.detach().flatten()
    if not is_distributed() or world_size(group) <= 1:
        return local
    count = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
    counts = [torch.zeros_like(count) for _ in range(world_size(group))]
    dist.all_gather(counts, count, group=group)
    padded = local.new_zeros(max(int(c) for c in counts))
    padded[: local.numel()] = local
    parts = [torch.zeros_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[: int(c)] for part, c in zip(parts, counts)])
