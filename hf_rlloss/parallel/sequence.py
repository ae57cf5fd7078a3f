"""Sequence-parallel (SP) helpers: split a tensor's sequence dimension over the ranks of an SP group.

A sequence of length ``L`` is padded to a multiple of the SP size ``P`` with a field-specific padding value, and rank
``r`` of the group keeps the contiguous shard ``[r * L_p / P, (r + 1) * L_p / P)`` of the padded length ``L_p``. The
padding value matters: labels are padded with ``ignore_idx`` so padded positions never count as tokens, IS weights
with ``1.0``, log-probs and advantages with ``0.0``.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh


def sp_world_size(sp_mesh: DeviceMesh | None) -> int:
    """The number of ranks of the SP group (1 without SP); `RLLossGRPOConfig.sp_size` is the value it builds from."""
    return 1 if sp_mesh is None else sp_mesh.size()


# The former name of `sp_world_size`, still imported by context.py and rollout_is.py.


def sp_rank(sp_mesh: DeviceMesh | None) -> int:
    return 0 if sp_mesh is None else sp_mesh.get_local_rank()


def sp_group(sp_mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    return None if sp_mesh is None else sp_mesh.get_group()


def on_first_sp_rank(value: torch.Tensor, sp_mesh: DeviceMesh | None) -> torch.Tensor:
    """`value` on the SP group's first rank, zeros elsewhere: a per-sequence count (or sum) that every rank of the
    group holds in full is then counted once when it is summed over the group (or the world)."""
    return value if sp_rank(sp_mesh) == 0 else torch.zeros_like(value)


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
    size = sp_world_size(sp_mesh)
    if size == 1:
        return tensor
    padded = pad_to_multiple(tensor, size, split_dim, padding_value)
    shard = padded.shape[split_dim] // size
    return padded.narrow(split_dim, sp_rank(sp_mesh) * shard, shard).contiguous()


def sp_gather(tensor: torch.Tensor, sp_mesh: DeviceMesh | None, dim: int = 1) -> torch.Tensor:
    """Concatenate the shards of the SP group along ``dim`` in rank order (not autograd-aware).

    The result keeps the padding added by :func:`sp_split`; trim it with ``[..., :L]`` when the true length matters.
    """
    size = sp_world_size(sp_mesh)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor, group=sp_group(sp_mesh))
    return torch.cat(shards, dim=dim)


def sp_all_gather(tensor: torch.Tensor, sp_mesh: DeviceMesh | None, dim: int = 0) -> torch.Tensor:
    """:func:`sp_gather` with autograd: the backward hands each rank the gradient of its own shard, summed over the
    ranks that used it (a reduce-scatter). Functional collectives, which work on gloo subgroups."""
    if sp_world_size(sp_mesh) == 1:
        return tensor
    import torch.distributed._functional_collectives as funcol

    moved = tensor.movedim(dim, 0).contiguous()  # funcol gathers along dim 0
    gathered = funcol.all_gather_single_autograd(moved, 0, sp_group(sp_mesh))
    return funcol.wait_tensor(gathered).movedim(0, dim)


# ------------------------------------------------------------------------------------------------- the SP mesh


def build_sp_mesh(group_size: int, device_type: str = "cpu") -> DeviceMesh | None:
    """The `sp` dimension of a `(dp, sp)` device mesh over all processes; consecutive ranks form an SP group.

    Args:
        group_size (`int`): ranks per SP group (`RLLossGRPOConfig.sp_size`); 1 returns `None` (no SP).
        device_type (`str`, *optional*, defaults to `"cpu"`): the mesh's device type (`"cuda"` with NCCL).

    Returns:
        `DeviceMesh` or `None`: the 1-D SP mesh of this rank; its parent mesh's `"dp"` dimension is the
        data-parallel group (ranks holding different data).
    """
    if group_size < 1:
        raise ValueError(f"sp_size={group_size} must be >= 1")
    if group_size == 1:
        return None
    if not dist.is_initialized():
        raise ValueError(f"sp_size={group_size} needs torch.distributed to be initialized (launch with accelerate)")
    world = dist.get_world_size()  # that group_size divides it is checked by RLLossGRPOConfig (its one check)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // group_size, group_size), mesh_dim_names=("dp", "sp"))
    atexit.unregister(destroy_process_groups)  # once, however many meshes are built
    atexit.register(destroy_process_groups)
    return mesh["sp"]


def destroy_process_groups() -> None:
    """Destroy every process group (the mesh's SP/DP groups with the default one) if any is still alive.

    Registered with `atexit` by `build_sp_mesh`: a rank that leaves the interpreter with live gloo subgroups can abort
    in their destructors ("terminate called without an active exception", SIGABRT) after training has finished,
    which fails the whole launch. CI hit it twice on a rank done before the other (a 2-process SP recipe run, and a
    test script). No barrier: at exit a rank must not wait for peers that may have crashed.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def sp_shard_inputs(
    input_ids: torch.Tensor, position_ids: torch.Tensor, sp_mesh: DeviceMesh | None, pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of `(input_ids, position_ids)` `(B, L)`, padded at the end to a multiple of the SP size.

    Padded positions continue the last position (`last + 1, …`), so they never look like the start of a new packed
    sequence; under causal attention they cannot affect any real token, and their labels are `ignore_idx`.
    """
    size = sp_world_size(sp_mesh)
    if size == 1:
        return input_ids, position_ids
    pad = (-input_ids.shape[1]) % size
    if pad:
        steps = torch.arange(1, pad + 1, device=position_ids.device).expand(position_ids.shape[0], pad)
        position_ids = torch.cat([position_ids, position_ids[:, -1:] + steps], dim=1)
    return sp_split(input_ids, sp_mesh, 1, pad_token_id), sp_split(position_ids, sp_mesh, 1, 0)
