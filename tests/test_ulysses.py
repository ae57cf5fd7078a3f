"""Ulysses attention: sp=2 (and dp=2×sp=2) forward/backward equal the single-process model run on each sequence in its
own row, for a padding-free packed row (sequences found from the positions) and for a prefix-sharing tree row (TRL's
`TreeRow` layout passed as `tree_*` keyword arguments, as the trainer's `shared_prefix` packing does)."""

import pytest
import torch
from _dist import run_distributed
from _full_matrix import SLOW_LAUNCH
from _models import tiny_qwen2
from trl.experimental.async_grpo.packing import TreeRow

from hf_rlloss.parallel import (
    build_sp_mesh,
    register_ulysses_attention,
    sp_gather,
    sp_shard_inputs,
    ulysses_sequence_parallel,
)

VOCAB = 64
DOCS = [5, 8]  # a packed row of two sequences, 13 tokens: odd, so the last shard is padded
# A tree row: two prompts of different lengths; three completions of the first (two share their first token, so the
# trie forks inside the completion), two of the second. 27 unique tokens of 40 (odd: the last shard is padded).
TREE = [
    ([5, 6, 7, 8, 9, 10], [[20, 21, 22], [20, 23], [24, 25, 26, 27, 28]]),
    ([11, 12, 13], [[30, 31], [32, 33, 34, 35]]),
]


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (1, sum(DOCS)), generator=g)
    positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    weights = torch.randn(1, sum(DOCS), VOCAB, generator=g)
    return ids, positions, weights


def _tree_samples() -> list[torch.Tensor]:
    return [torch.tensor(prompt + completion) for prompt, completions in TREE for completion in completions]


def _tree_row() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """TRL's packed tree row of `TREE` (every token after a sample's first is a loss term) and `(M, V)` weights of
    the terms, in TreeRow's order (sample by sample, token by token)."""
    row = TreeRow()
    for group, ids in enumerate(_tree_samples()):
        mask = torch.ones_like(ids)
        mask[0] = 0
        row.add({"input_ids": ids, "completion_mask": mask, "old_log_probs": torch.zeros(len(ids)), "advantage": 0.0,
                 "group_id": group})  # fmt: skip
    packed = row.pack()
    weights = torch.randn(len(packed["token_index"]), VOCAB, generator=torch.Generator().manual_seed(2))
    return packed, weights


def _tree_kwargs(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: packed[k] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}


def _own_rows(model, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """`(len, V)` logits of each sequence run in its own row (plain SDPA)."""
    return [model(input_ids=ids.unsqueeze(0), use_cache=False).logits[0] for ids in sequences]


def _reference(kv_heads, layout):
    """Each sequence run in its own row with SDPA: logits (per position of the packed row, or per tree loss term),
    and the gradients of a fixed linear function of them."""
    model = tiny_qwen2(kv_heads=kv_heads)
    if layout == "packed":
        ids, _, weights = _inputs()
        logits = torch.cat(_own_rows(model, list(torch.split(ids[0], DOCS))), dim=0).unsqueeze(0)
    else:
        _, weights = _tree_row()
        # a term predicts token p of its sample from position p - 1
        logits = torch.cat([rows[:-1] for rows in _own_rows(model, _tree_samples())])
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _sp_forward(model, mesh, ids, positions, weights, **tree):
    """Full-row logits `(1, L, V)` of this SP group and the backward of `(logits * weights).sum()` (local shards)."""
    sp = mesh.size()
    local_ids, local_pos = sp_shard_inputs(ids, positions, mesh)
    with ulysses_sequence_parallel(mesh):
        logits = model(input_ids=local_ids, position_ids=local_pos, use_cache=False, **tree).logits
    local_w = torch.nn.functional.pad(weights, (0, 0, 0, (-ids.shape[1]) % sp))
    local_w = local_w.chunk(sp, dim=1)[mesh.get_local_rank()]
    (logits * local_w).sum().backward()  # padded positions have zero weight
    return sp_gather(logits.detach(), mesh, dim=1)[:, : ids.shape[1]]


def _summed_grads(model, world_size, sp):
    grads = {}
    for n, p in model.named_parameters():
        torch.distributed.all_reduce(p.grad)  # sum over SP shards (and identical DP replicas)
        grads[n] = p.grad / (world_size // sp)
        p.grad = None
    return grads


def _ulysses_worker(rank, world_size, sp, kv_heads, out_dir):
    name = register_ulysses_attention()
    mesh = build_sp_mesh(sp)
    model = tiny_qwen2(kv_heads=kv_heads, attn=name)
    out = {}
    # padding-free: sequences found from the global positions
    ids, positions, weights = _inputs()
    out["packed"] = (_sp_forward(model, mesh, ids, positions, weights), _summed_grads(model, world_size, sp))
    # prefix-sharing tree row: the whole row's layout on every rank; a term's weight goes to the position it reads
    packed, term_weights = _tree_row()
    position_weights = torch.zeros(len(packed["input_ids"]), VOCAB).index_add_(0, packed["token_index"], term_weights)
    logits = _sp_forward(
        model, mesh, packed["input_ids"][None], packed["position_ids"][None], position_weights[None],
        **_tree_kwargs(packed),
    )  # fmt: skip
    out["tree"] = (logits[0, packed["token_index"]], _summed_grads(model, world_size, sp))
    # outside the context manager the same model runs plain SDPA on local inputs
    out["plain"] = model(input_ids=ids[:, :5], use_cache=False).logits.detach()
    if rank == 0:
        torch.save(out, f"{out_dir}/out.pt")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size,sp,kv_heads",
    [(2, 2, 1), (2, 2, 2), pytest.param(4, 2, 2, marks=SLOW_LAUNCH)],
    ids=["sp2-mqa", "sp2-gqa", "dp2xsp2"],
)
def test_ulysses_equals_full_sequence(tmp_path, world_size, sp, kv_heads):
    run_distributed(_ulysses_worker, world_size, sp, kv_heads, str(tmp_path), timeout=240)
    out = torch.load(tmp_path / "out.pt")
    for layout in ("packed", "tree"):
        logits, grads = out[layout]
        ref_logits, ref_grads = _reference(kv_heads, layout)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5, msg=layout)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=f"{layout}: {name}")
        if layout == "packed":
            torch.testing.assert_close(out["plain"], ref_logits[:, :5], atol=1e-5, rtol=1e-5)


def test_build_sp_mesh_validates_size():
    with pytest.raises(ValueError, match="sp_size=0 must be >= 1"):
        build_sp_mesh(0)
    assert build_sp_mesh(1) is None
    with pytest.raises(ValueError, match="needs torch.distributed"):
        build_sp_mesh(2)


def _bad_heads_worker(rank, world_size, out_dir):
    name = register_ulysses_attention()
    mesh = build_sp_mesh(2)
    model = tiny_qwen2(heads=3, kv_heads=1, attn=name, hidden_size=30)
    with ulysses_sequence_parallel(mesh), pytest.raises(ValueError, match=r"heads \(3\) to be divisible by sp_size"):
        model(input_ids=torch.ones(1, 2, dtype=torch.long), position_ids=torch.arange(2)[None] + 2 * rank)


@pytest.mark.distributed
def test_heads_not_divisible_is_a_clear_error(tmp_path):
    run_distributed(_bad_heads_worker, 2, str(tmp_path), timeout=120)
