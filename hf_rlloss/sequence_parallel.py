"""Sequence-parallel (SP) helpers: split a tensor's sequence dimension over the ranks of an SP group.

A sequence of length ``L`` is padded to a multiple of the SP size ``P`` with a field-specific padding value, and rank
``r`` of the group keeps the contiguous shard ``[r * L_p / P, (r + 1) * L_p / P)`` of the padded length ``L_p``. The
padding value matters: labels are padded with ``ignore_idx`` so padded positions never count as tokens, IS weights
with ``1.0``, log-probs and advantages with ``0.0``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh


def sp_size(sp_mesh: DeviceMesh | None) -> int:
    return 1 if sp_mesh is None else sp_mesh.size()


def sp_rank(sp_mesh: DeviceMesh | None) -> int:
    return 0 if sp_mesh is None else sp_mesh.get_local_rank()


def sp_group(sp_mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    return None if sp_mesh is None else sp_mesh.get_group()


def pad_to_multiple(tensor: torch.Tensor, multiple: int, dim: int, padding_value: float) -> torch.Tensor:
    """Right-pad ``tensor`` along ``dim`` with ``padding_value`` so that its length is a multiple of ``multiple``."""
    remainder = tensor.shape[dim] % multiple
    if remainder == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, multiple - remainder]
    return F.pad(tensor, pad, value=padding_value)


def sp_split(
    tensor: torch.Tensor, sp_mesh: DeviceMesh | None, split_dim: int = 1, padding_value: float = 0.0
) -> torch.Tensor:
    """This rank's shard of ``tensor`` along ``split_dim``, after padding it to a multiple of the SP size.

    Args:
        tensor (`torch.Tensor`): the full (global) tensor, identical on every rank of the SP group.
        sp_mesh (`DeviceMesh` or `None`): the 1-D SP mesh; `None` or size 1 returns `tensor` unchanged.
        split_dim (`int`, *optional*, defaults to `1`): the sequence dimension.
        padding_value (`float`, *optional*, defaults to `0.0`): value of the padded positions.
    """
    size = sp_size(sp_mesh)
    if size == 1:
        return tensor
    padded = pad_to_multiple(tensor, size, split_dim, padding_value)
    shard = padded.shape[split_dim] // size
    return padded.narrow(split_dim, sp_rank(sp_mesh) * shard, shard).contiguous()


def sp_gather(tensor: torch.Tensor, sp_mesh: DeviceMesh | None, dim: int = 1) -> torch.Tensor:
    """Concatenate the shards of the SP group along ``dim`` in rank order (not autograd-aware).

    The result keeps the padding added by :func:`sp_split`; trim it with ``[..., :L]`` when the true length matters.
    """
    size = sp_size(sp_mesh)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor, group=sp_group(sp_mesh))
    return torch.cat(shards, dim=dim)
