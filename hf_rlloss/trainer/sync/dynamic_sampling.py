"""Dynamic sampling (DAPO): train only on groups whose rewards differ; refill the generation batch from more prompts.

A GRPO group whose `G` rewards are all equal has zero advantage everywhere: it adds no policy gradient, only KL and
compute. With `RLLossGRPOConfig.dynamic_sampling`, the trainer scores a generation batch, keeps the groups with
signal (`groups_with_signal`), and while fewer than a full generation batch's worth of groups are kept it generates
another round from fresh prompts (`RefillPrompts`), up to `dynamic_sampling_max_rounds` rounds. It then trains on the
first `target` kept groups in generation order (`select_groups`), spread evenly over the data-parallel replicas
(`replica_rows`, `gather_rows`) and the step's micro-batches (`balanced_sizes`, `split_rows`). The loss layer
normalizes over the tokens (sequences) of all micro-batches and ranks of the optimizer step, so a short step is
normalized exactly over what it trains on.

Every decision is a function of the rewards of the whole generation batch, which TRL gathers on every rank for the
advantage, so every rank agrees on which groups are kept; the number of micro-batches is TRL's
`steps_per_generation` on every rank. See docs/dynamic_sampling.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from trl.trainer.utils import RepeatSampler

from ..common.sp_batch import pad_rows_to_length, shared_permutation

__all__ = [
    "DynamicSampling",
    "RefillPrompts",
    "balanced_sizes",
    "concat_rows",
    "gather_rows",
    "groups_with_signal",
    "replica_rows",
    "select_groups",
    "split_rows",
    "take_rows",
]


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """`(N / G,)` bool: which groups of `group_size` consecutive completions have rewards that differ.

    Args:
        rewards (`torch.Tensor`): `(N,)` the summed (weighted) reward of each completion of the generation batch, in
            TRL's order (the `G` completions of a prompt consecutive); NaN for an unscorable completion.
        group_size (`int`): `G`, TRL's `num_generations`.

    A group is without signal when the standard deviation of its scorable rewards is 0 by TRL's test (`isclose`,
    which logs it as `frac_reward_zero_std`), or undefined (fewer than two scorable completions).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)  # (N/G, G)
    scorable = ~torch.isnan(grouped)
    count = scorable.sum(dim=1)
    mean = torch.where(scorable, grouped, 0.0).sum(dim=1) / count.clamp(min=1)
    spread = torch.where(scorable, (grouped - mean[:, None]) ** 2, 0.0).sum(dim=1)
    std = torch.sqrt(spread / (count - 1).clamp(min=1))
    return (count >= 2) & ~torch.isclose(std, torch.zeros_like(std))


def select_groups(has_signal: torch.Tensor, target: int) -> torch.Tensor:
    """`(R, n)` bool: the first `target` groups with signal, in generation order (round by round, group by group).

    Args:
        has_signal (`torch.Tensor`): `(R, n)` bool, `groups_with_signal` of each of the `R` rounds' `n` groups.
        target (`int`): how many groups a full generation batch holds (`generation_batch_size / G`).
    """
    flat = has_signal.reshape(-1)
    rank_among_kept = flat.long().cumsum(0)  # 1 for the first group with signal, 2 for the second, ...
    return (flat & (rank_among_kept <= target)).view_as(has_signal)


def balanced_sizes(total: int, parts: int) -> list[int]:
    """`total` items split into `parts` consecutive parts whose sizes differ by at most one (larger ones first)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def replica_rows(groups: torch.Tensor, group_size: int, replica: int, num_replicas: int) -> torch.Tensor:
    """`(N / num_replicas,)` bool: which rows of a replica's share of a round are in the `groups` `(n,)` kept.

    The generation batch of `N = n × G` completions is laid out as TRL's sampler and `accelerate` shard it: replica
    `d` (an SP group, or a rank without SP) holds rows `[d × N / D, (d + 1) × N / D)`; a group may span replicas.
    """
    rows = groups.repeat_interleave(group_size)  # (N,)
    share = rows.numel() // num_replicas
    return rows[replica * share : (replica + 1) * share]


def take_rows(batch: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """The rows `index` (bool mask or indices) of every per-row tensor of a TRL batch; other values kept."""
    return {k: v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


def concat_rows(batches: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """TRL batches (the same keys) stacked along the rows; per-row tensors are first brought to the longest length
    (prompts padded on the left, the rest on the right, see `sp_batch.pad_rows_to_length`); other values are the
    first batch's."""
    out = dict(batches[0])
    for key, value in batches[0].items():
        if not (isinstance(value, torch.Tensor) and value.dim() > 0):
            continue
        values = [batch[key] for batch in batches]
        if value.dim() > 1:
            length = max(v.shape[1] for v in values)
            values = [pad_rows_to_length(key, v, length, pad_token_id) for v in values]
        out[key] = torch.cat(values, dim=0)
    return out


def split_rows(batch: dict[str, Any], sizes: list[int]) -> list[dict[str, Any]]:
    """The batch cut into consecutive micro-batches of `sizes` rows (TRL's `split_tensor_dict` needs equal parts)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [take_rows(batch, slice(start, start + size)) for start, size in zip(starts, sizes)]


def gather_rows(batch: dict[str, Any], pad_token_id: int) -> list[dict[str, Any]]:
    """Every rank's batch (collective over the world): per-row tensors of any row count and length, in rank order.

    gloo and NCCL gather equal shapes: rows and lengths are padded to the world's largest, then cut back.
    """
    keys = sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
    device = batch[keys[0]].device
    world = dist.get_world_size()
    lengths = [batch[k].shape[1] if batch[k].dim() > 1 else 0 for k in keys]
    sizes = torch.tensor([batch[keys[0]].shape[0], *lengths], device=device)
    all_sizes = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes)  # (1 + keys,) per rank: its rows, then each key's length
    all_sizes = torch.stack(all_sizes).cpu()  # (world, 1 + keys)
    rows, lengths = all_sizes[:, 0].tolist(), all_sizes[:, 1:].max(dim=0).values.tolist()
    out = [dict(batch) for _ in range(world)]
    for key, length in zip(keys, lengths):
        value = batch[key]
        if value.dim() > 1:
            value = pad_rows_to_length(key, value, length, pad_token_id)
        filler = value.new_zeros((max(rows) - value.shape[0], *value.shape[1:]))
        value = torch.cat([value, filler]).contiguous()
        shards = [torch.empty_like(value) for _ in range(world)]
        dist.all_gather(shards, value)
        for r in range(world):
            out[r][key] = shards[r][: rows[r]]
    return out


class RefillPrompts:
    """This rank's share of fresh generation batches of prompts, drawn for the extra rounds of dynamic sampling.

    The same `RepeatSampler` as TRL's training sampler (each prompt repeated `G` times, `target` prompts per
    generation batch), but with `repeat_count=1` and its own seed, so it does not disturb the trainer's dataloader
    (whose batches, each repeated `steps_per_generation × num_iterations` times, are fetched ahead of an optimizer
    step and count its epochs). Every rank builds the same sampler, so all agree on each batch; rank `r` of `W`
    takes rows `[r × N / W, (r + 1) × N / W)`, as `accelerate` shards the trainer's batches. An endless stream: each
    pass over the dataset is a new permutation.

    Args:
        dataset (`Sequence`): the training dataset (map-style: indexable, with a length).
        group_size (`int`): `G`, TRL's `num_generations`.
        target (`int`): prompts per generation batch (`generation_batch_size / G`).
        rank (`int`), world_size (`int`): this process and the number of processes.
        shuffle (`bool`): TRL's `shuffle_dataset`.
        seed (`int`): the training seed; the stream uses `seed + 1` so that it differs from the trainer's order.
    """

    def __init__(self, dataset, group_size: int, target: int, rank: int, world_size: int, shuffle: bool, seed: int):
        if len(dataset) < target:
            raise ValueError(
                f"dynamic_sampling draws generation batches of {target} prompts, but the training dataset has only "
                f"{len(dataset)}"
            )
        self.dataset = dataset
        self.sampler = RepeatSampler(
            data_source=dataset, mini_repeat_count=group_size, batch_size=target, shuffle=shuffle, seed=seed + 1
        )
        self.batch_rows = group_size * target
        self.rank, self.world_size = rank, world_size
        self._indices: Iterator[int] = iter(())

    def _next_index(self) -> int:
        try:
            return next(self._indices)
        except StopIteration:  # the end of a pass: the next one is a new permutation
            self._indices = iter(self.sampler)
            return next(self._indices)

    def __iter__(self) -> RefillPrompts:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        indices = [self._next_index() for _ in range(self.batch_rows)]  # the whole generation batch, every rank
        share = self.batch_rows // self.world_size
        return [self.dataset[i] for i in indices[self.rank * share : (self.rank + 1) * share]]


class DynamicSampling:
    """`RLLossGRPOTrainer`'s dynamic sampling: the generation rounds, the groups kept, and the step's micro-batches.

    A mixin of `GRPOTrainer` (it uses TRL's `_generate_and_score_completions`, `_step`, `_buffered_inputs`,
    `_metrics`);
    `RLLossGRPOTrainer._prepare_inputs` calls `_dynamic_sampling_inputs` in training when `args.dynamic_sampling`.
    """

    def _setup_dynamic_sampling(self) -> None:
        """Check that dynamic sampling can run here (at construction, not at the first step)."""
        self._refill_prompts: RefillPrompts | None = None
        self._ds_rewards_per_func: torch.Tensor | None = None
        self._ds_prompts_consumed = 0
        if not self.args.dynamic_sampling:
            return
        dataset = self.train_dataset
        if dataset is not None and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(
                "dynamic_sampling=True draws extra prompts by index: train_dataset must be a map-style dataset "
                f"(got {type(dataset).__name__}); set dynamic_sampling=False for an iterable dataset"
            )
        if self._is_vlm:
            raise ValueError(
                "dynamic_sampling=True is not supported for vision-language models: their batches carry per-image "
                "values that are not rows of completions"
            )

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL override: keep the rewards of the whole generation batch (TRL gathers them on every rank for the
        # advantage); dynamic sampling decides from them which groups have signal.
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._ds_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generation_batch_rewards(self) -> torch.Tensor:
        """`(N,)` the summed weighted reward of each completion of the last generation batch scored (all ranks'), NaN
        where every reward function returned None, as TRL's advantage sees them."""
        per_func = self._ds_rewards_per_func  # (N, reward functions)
        rewards = (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
        return rewards.masked_fill(torch.isnan(per_func).all(dim=1), float("nan"))

    def _dynamic_sampling_inputs(self, generation_batch: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's `_prepare_inputs` (training) under dynamic sampling: at a generation step, the rounds and the kept
        groups shuffled and cut into `steps_per_generation` micro-batches (sizes differ by at most one row when the
        batch is short); otherwise the buffered micro-batch of this step."""
        spg = self.args.steps_per_generation
        if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = self._dynamic_sampling_batch(generation_batch)
            rows = batch["prompt_ids"].shape[0]
            device = batch["prompt_ids"].device
            if self.sp_mesh is None:
                permutation = torch.randperm(rows).to(device)  # as TRL's shuffle_sequence_dict
            else:  # every rank of an SP group holds the same batch and must cut the same micro-batches
                permutation = shared_permutation(rows, self.sp_mesh, device)
            self._buffered_inputs = split_rows(take_rows(batch, permutation), balanced_sizes(rows, spg))
        return self._buffered_inputs[self._step % spg]

    def _dynamic_sampling_batch(self, generation_batch: list[dict[str, Any]]) -> dict[str, Any]:
        """This replica's share of the groups kept over up to `dynamic_sampling_max_rounds` rounds (collective).

        Under SP a replica is an SP group: `_generate_and_score_completions` returns the group's pooled batch.
        """
        args, pad = self.args, self._tokenizer.pad_token_id
        group_size, world, sp = self.num_generations, self.accelerator.num_processes, args.sp_size
        target = args.generation_batch_size // group_size  # groups (prompts) of a full generation batch
        replicas, replica = world // sp, self.accelerator.process_index // sp
        if self._refill_prompts is None:
            self._refill_prompts = RefillPrompts(
                self.train_dataset, group_size, target, self.accelerator.process_index, world, self.shuffle_dataset,
                args.seed,
            )  # fmt: skip
        rounds, signal = [], []
        inputs = generation_batch
        while True:
            rounds.append(self._generate_and_score_completions(inputs))
            signal.append(groups_with_signal(self._generation_batch_rewards(), group_size))
            if int(torch.stack(signal).sum()) >= target or len(rounds) == args.dynamic_sampling_max_rounds:
                break
            inputs = next(self._refill_prompts)
        selected = select_groups(torch.stack(signal), target)  # (rounds, target), the same on every rank
        kept = int(selected.sum())
        # A short batch must still give every micro-batch of every replica a row; else (no group with signal, in
        # practice) the step trains on the last round as it is: no policy gradient, only the KL term.
        starved = kept * group_size < replicas * args.steps_per_generation
        if starved:
            batch = rounds[-1]
        else:
            mine = [
                take_rows(batch, replica_rows(groups, group_size, replica, replicas).to(batch["prompt_ids"].device))
                for batch, groups in zip(rounds, selected)
            ]
            batch = concat_rows(mine, pad)
            if replicas > 1:  # spread the kept rows evenly: one copy per replica (SP ranks hold the same batch)
                pooled = concat_rows(gather_rows(batch, pad)[::sp], pad)
                sizes = balanced_sizes(kept * group_size, replicas)
                start = sum(sizes[:replica])
                batch = take_rows(pooled, slice(start, start + sizes[replica]))
        self._ds_prompts_consumed += len(rounds) * target
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/rounds"].append(len(rounds))
        metrics["dynamic_sampling/groups_generated"].append(len(rounds) * target)
        metrics["dynamic_sampling/groups_kept"].append(kept)
        metrics["dynamic_sampling/prompts_consumed"].append(self._ds_prompts_consumed)
        metrics["dynamic_sampling/starved"].append(float(starved))
        return batch
