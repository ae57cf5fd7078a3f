"""sp_batch: the SP micro-batch reads each loss term from the hidden state of the position before it, on every rank
and in both packed layouts; pooling over the group fills ragged batches with the right values; the shuffle is the
same on every rank of the group."""

import pytest
import torch
from _dist import FakeSPMesh, run_distributed

from hf_rlloss.parallel.sequence import build_sp_mesh, sp_split
from hf_rlloss.trainer.common import sp_batch
from hf_rlloss.trainer.common.packing import LAYOUT_BUILDERS
from hf_rlloss.trainer.common.sp_batch import SPMicroBatch, pool_fill_value, pool_over_group, shared_permutation

PAD, IGNORE = 0, -100


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


def _micro_batch(batch, mode, mesh):
    layout = LAYOUT_BUILDERS[mode](
        batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"]
    )
    return SPMicroBatch.from_layout(layout, mesh, PAD)


@pytest.mark.parametrize("mode", ["shared_prefix", "padding_free"])
@pytest.mark.parametrize("size", [2, 3])
def test_terms_line_up_with_their_hidden_states(monkeypatch, mode, size):
    """On every rank, the hidden state `term_hidden` picks for a term is the one at the packed position holding the
    token before it in its own sequence (at the position before it), for the labels of the log-prob pass (`shard`)
    and for those `build` cuts from the term loss data; the input shards put together give the packed row."""
    batch = _ragged_batch()
    labels = batch["completion_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)
    data = {"shifted_labels": labels, "advantages": torch.tensor([1.0, -1.0, 0.5])}
    full = _micro_batch(batch, mode, FakeSPMesh(1, 0))
    row, positions = full.layout.input_ids[0], full.layout.position_ids[0]
    # each position's "hidden state": its token and its position, so a term can be traced to where it is read
    hidden = torch.stack([row, positions], dim=-1).float().unsqueeze(0)  # (1, N, 2)
    padded = torch.nn.functional.pad(hidden, (0, 0, 0, (-len(row)) % size))
    # the gather of every rank's shard (what the collective returns), so one process can play every rank
    monkeypatch.setattr(sp_batch, "sp_all_gather", lambda local, mesh, dim: padded[0])
    shards, terms = [], 0
    for rank in range(size):
        mesh = FakeSPMesh(size, rank)
        micro_batch = _micro_batch(batch, mode, mesh).with_loss_data(data, tuple(labels.shape), IGNORE)
        local = micro_batch.input_ids.shape[1]
        assert local == -(-micro_batch.length // size)  # ceil(N / size)
        shard_labels = micro_batch.shard(labels, IGNORE)[0]
        from_loss_data = sp_split(micro_batch.loss_data["shifted_labels"], mesh, 1, IGNORE)[0]
        assert torch.equal(shard_labels, from_loss_data)
        read = micro_batch.term_hidden(padded[:, rank * local : (rank + 1) * local])[0]  # (M_local, 2)
        assert read.shape[0] == shard_labels.shape[0]
        for k in range(read.shape[0]):
            if shard_labels[k] == IGNORE:
                continue
            b, c = (t[rank * read.shape[0] + k] for t in micro_batch.terms)
            sequence = torch.cat([batch["prompt_ids"][b][batch["prompt_mask"][b].bool()], batch["completion_ids"][b]])
            depth = int(batch["prompt_mask"][b].sum()) + c  # the term's position in its own row
            assert shard_labels[k] == sequence[depth]
            assert read[k].tolist() == [sequence[depth - 1], depth - 1]
            terms += 1
        shards.append(micro_batch.input_ids[0])
        assert micro_batch.loss_data["num_tokens"].tolist() == [3, 1, 4]
        assert torch.equal(micro_batch.loss_data["advantages"], data["advantages"])  # per sequence: kept
    assert terms == 8  # every completion token (3 + 1 + 4) is read once over the ranks
    joined = torch.cat(shards)
    assert torch.equal(joined[: full.length], row) and (joined[full.length :] == PAD).all()


def test_shared_prefix_forwards_each_prompt_once():
    """Two completions of one prompt that start alike: the prompt is forwarded once, and both first completion tokens
    are read from its last position (TRL's trie forks one token before the sequences differ: at 20)."""
    prompt = torch.tensor([[11, 12, 13], [11, 12, 13]])
    completion = torch.tensor([[20, 21], [20, 22]])
    batch = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
             "completion_mask": torch.ones_like(completion)}  # fmt: skip
    shared, free = (_micro_batch(batch, mode, FakeSPMesh(1, 0)) for mode in ("shared_prefix", "padding_free"))
    assert free.length == 10 and shared.length == 3 + 2 + 2  # 11 12 13, then 20 21 | 20 22
    assert shared.term_positions[0] == shared.term_positions[2]  # 13 predicts 20 for both rows


def test_gather_inverts_shard_on_one_rank():
    batch = _ragged_batch()
    micro_batch = _micro_batch(batch, "shared_prefix", FakeSPMesh(1, 0))
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1
    local = micro_batch.shard(values, 0.0)[..., None]
    assert torch.equal(micro_batch.gather(local, (3, 4))[..., 0], values * batch["completion_mask"])


def test_loss_data_of_another_shape_is_refused():
    batch = _ragged_batch()
    micro_batch = _micro_batch(batch, "padding_free", FakeSPMesh(2, 0))
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
