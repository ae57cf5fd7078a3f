"""sp_batch: the SP micro-batch keeps the label shard and the input shard aligned; pooling over the group fills
ragged batches with the right values; the shuffle is the same on every rank of the group."""

import pytest
import torch
from _dist import run_distributed

from hf_rlloss.parallel.sequence import build_sp_mesh, sp_split
from hf_rlloss.trainer.sp_batch import SPMicroBatch, pool_fill_value, pool_over_group, shared_permutation

PAD, IGNORE = 0, -100


class _Mesh:
    """The two things `sp_split` and `sp_shard_inputs` read from an SP mesh: its size and this rank's index."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def _ragged_batch():
    """Three sequences of different prompt and completion lengths (one completion empty after masking)."""
    prompt_ids = torch.tensor([[PAD, 11, 12], [21, 22, 23], [PAD, PAD, 31]])
    completion_ids = torch.tensor([[13, 14, 15, PAD], [24, PAD, PAD, PAD], [32, 33, 34, 35]])
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": (prompt_ids != PAD).long(),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


@pytest.mark.parametrize("size", [2, 3])
def test_label_shard_lines_up_with_input_shard(size):
    """On every rank, a valid label at shard position i is the packed token after the input at i (the next token of
    the same sequence), both for the labels of the log-prob pass (`shard`) and for those `build` cuts from the
    packed loss data; the input shards put together give the packed row."""
    batch = _ragged_batch()
    labels = batch["completion_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)
    data = {"shifted_labels": labels, "advantages": torch.tensor([1.0, -1.0, 0.5])}
    shards = []
    for rank in range(size):
        mesh = _Mesh(size, rank)
        micro_batch = SPMicroBatch.from_batch(batch, mesh, PAD).with_loss_data(data, tuple(labels.shape), IGNORE)
        full = micro_batch.packed.input_ids[0]
        local = micro_batch.input_ids.shape[1]
        assert local == -(-micro_batch.length // size)  # ceil(L / size)
        shard_labels = micro_batch.shard(batch["completion_ids"], IGNORE)[0]
        from_loss_data = sp_split(micro_batch.loss_data["shifted_labels"], mesh, 1, IGNORE)[0]
        assert shard_labels.shape == from_loss_data.shape == (local,)
        for i in range(local):
            position = rank * local + i
            if from_loss_data[i] != IGNORE:
                assert from_loss_data[i] == shard_labels[i] == full[position + 1]
                assert micro_batch.position_ids[0, i] + 1 == micro_batch.packed.position_ids[0, position + 1]
        shards.append(micro_batch.input_ids[0])
        assert micro_batch.loss_data["num_tokens"].tolist() == [5, 4, 5]
        assert torch.equal(micro_batch.loss_data["advantages"], data["advantages"])  # per sequence: kept
    joined = torch.cat(shards)
    assert torch.equal(joined[: micro_batch.length], full) and (joined[micro_batch.length :] == PAD).all()
    # every valid label (3 + 1 + 4 completion tokens, none first in its sequence) appears once over the shards
    counted = sum(
        (sp_split(micro_batch.loss_data["shifted_labels"], _Mesh(size, r), 1, IGNORE) != IGNORE).sum()
        for r in range(size)
    )
    assert counted == 8


def test_gather_inverts_shard_on_one_rank():
    batch = _ragged_batch()
    micro_batch = SPMicroBatch.from_batch(batch, _Mesh(1, 0), PAD)
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1
    local = micro_batch.shard(values, 0.0)[..., None]
    assert torch.equal(micro_batch.gather(local, (3, 4))[..., 0], values * batch["completion_mask"])


def test_loss_data_of_another_shape_is_refused():
    batch = _ragged_batch()
    micro_batch = SPMicroBatch.from_batch(batch, _Mesh(2, 0), PAD)
    with pytest.raises(ValueError, match=r"loss data 'extra' has shape \(3, 2\); expected the completions' shape"):
        micro_batch.with_loss_data({"extra": torch.zeros(3, 2)}, (3, 4), IGNORE)


def test_pool_fill_values():
    assert pool_fill_value("prompt_ids", 7) == pool_fill_value("completion_ids", 7) == 7
    assert pool_fill_value("tool_mask", 7) == pool_fill_value("importance_sampling_ratio", 7) == 1
    assert pool_fill_value("completion_mask", 7) == pool_fill_value("old_per_token_logps", 7) == 0


def _pool_worker(rank, world_size):
    mesh = build_sp_mesh(2)
    width = 2 + rank  # ragged: rank 1's prompts and completions are one longer
    batch = {
        "prompt_ids": torch.full((1, width), 10 + rank),
        "completion_ids": torch.full((1, width), 20 + rank),
        "tool_mask": torch.full((1, width), 0),
        "importance_sampling_ratio": torch.full((1, width), 0.5),
        "advantages": torch.tensor([float(rank)]),
        "num_items_in_batch": torch.tensor(3),
        "unused": None,
    }
    pooled = pool_over_group(batch, mesh, pad_token_id=PAD)
    assert pooled["prompt_ids"].tolist() == [[PAD, 10, 10], [11, 11, 11]]  # prompts filled on the left
    assert pooled["completion_ids"].tolist() == [[20, 20, PAD], [21, 21, 21]]  # the rest on the right
    assert pooled["tool_mask"].tolist() == [[0, 0, 1], [0, 0, 0]]
    assert pooled["importance_sampling_ratio"].tolist() == [[0.5, 0.5, 1.0], [0.5, 0.5, 0.5]]
    assert pooled["advantages"].tolist() == [0.0, 1.0]
    assert pooled["num_items_in_batch"].item() == 3 and pooled["unused"] is None
    torch.manual_seed(rank)  # different generators: only the broadcast makes the permutations equal
    permutation = shared_permutation(16, mesh, torch.device("cpu"))
    gathered = [torch.empty_like(permutation) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, permutation)
    assert torch.equal(gathered[0], gathered[1]) and sorted(permutation.tolist()) == list(range(16))
    with pytest.raises(ValueError, match=r"cannot pool batch\['names'\] \(list\)"):
        pool_over_group({**batch, "names": ["a"]}, mesh, pad_token_id=PAD)


@pytest.mark.distributed
def test_pool_over_group_fills_ragged_batches():
    run_distributed(_pool_worker, 2, timeout=300)
