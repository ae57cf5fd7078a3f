"""Ulysses attention: sp=2 (and dp=2×sp=2) forward/backward equal the single-process full-sequence model."""

import pytest
import torch
from _dist import run_distributed
from _models import tiny_qwen2

from hf_rlloss.parallel import (
    build_sp_mesh,
    register_ulysses_attention,
    sp_gather,
    sp_shard_inputs,
    ulysses_sequence_parallel,
)

DOCS = [5, 8]  # a packed row of two sequences, 13 tokens: odd, so the last shard is padded


def _inputs(vocab=64):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (1, sum(DOCS)), generator=g)
    positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    weights = torch.randn(1, sum(DOCS), vocab, generator=g)
    return ids, positions, weights


def _reference(kv_heads):
    """Each packed sequence run on its own with SDPA: logits, and grads of a fixed linear function of them."""
    model = tiny_qwen2(kv_heads=kv_heads)
    ids, positions, weights = _inputs()
    logits = torch.cat(
        [model(input_ids=chunk, use_cache=False).logits for chunk in torch.split(ids, DOCS, dim=1)], dim=1
    )
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _ulysses_worker(rank, world_size, sp, kv_heads, out_dir):
    name = register_ulysses_attention()
    mesh = build_sp_mesh(sp)
    model = tiny_qwen2(kv_heads=kv_heads, attn=name)
    ids, positions, weights = _inputs()
    local_ids, local_pos = sp_shard_inputs(ids, positions, mesh)
    with ulysses_sequence_parallel(mesh):
        logits = model(input_ids=local_ids, position_ids=local_pos, use_cache=False).logits
    local_w = torch.nn.functional.pad(weights, (0, 0, 0, (-ids.shape[1]) % sp))
    local_w = local_w.chunk(sp, dim=1)[mesh.get_local_rank()]
    (logits * local_w).sum().backward()  # padded positions have zero weight
    grads = {}
    for n, p in model.named_parameters():
        torch.distributed.all_reduce(p.grad)  # sum over SP shards (and identical DP replicas)
        grads[n] = p.grad / (world_size // sp)
    full = sp_gather(logits.detach(), mesh, dim=1)[:, : ids.shape[1]]
    # outside the context manager the same model runs plain SDPA on local inputs
    plain = model(input_ids=ids[:, :5], use_cache=False).logits.detach()
    if rank == 0:
        torch.save((full, grads, plain), f"{out_dir}/out.pt")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size,sp,kv_heads", [(2, 2, 1), (2, 2, 2), (4, 2, 2)], ids=["sp2-mqa", "sp2-gqa", "dp2xsp2"]
)
def test_ulysses_equals_full_sequence(tmp_path, world_size, sp, kv_heads):
    run_distributed(_ulysses_worker, world_size, sp, kv_heads, str(tmp_path), timeout=240)
    logits, grads, plain = torch.load(tmp_path / "out.pt")
    ref_logits, ref_grads = _reference(kv_heads)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, ref_logits[:, :5], atol=1e-5, rtol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


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
