"""Tree attention (`hf_rlloss.parallel.tree_attention`): a packed row of prefix-sharing sequences gives every token
exactly the logits (and gradients) it has in its own unpacked row, and no token sees another sequence."""

from __future__ import annotations

import pytest
import torch
from trl.experimental.async_grpo.packing import TreeRow

from hf_rlloss.parallel import tree_attention as ta
from tests._models import tiny_qwen2

# Two prompts of different lengths, with completions of different lengths; the second prompt's completions share a
# first token, so the trie forks inside the completion too.
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]
COMPLETIONS = [[[20, 21, 22], [23, 24], [25, 26, 27, 28, 29]], [[30, 31], [30, 32, 33, 34]]]


def _samples():
    samples = []
    for group, (prompt, completions) in enumerate(zip(PROMPTS, COMPLETIONS)):
        for completion in completions:
            ids = torch.tensor(prompt + completion)
            mask = torch.tensor([0] * len(prompt) + [1] * len(completion))
            samples.append(
                {"input_ids": ids, "completion_mask": mask, "old_log_probs": torch.zeros(len(ids)), "advantage": 0.0,
                 "group_id": group}
            )  # fmt: skip
    return samples


def _packed(samples):
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return row.pack()


def _tree_kwargs(packed):
    return {
        "tree_kv_index": packed["tree_kv_index"],
        "tree_cu_seqlens_q": packed["tree_cu_seqlens_q"],
        "tree_cu_seqlens_k": packed["tree_cu_seqlens_k"],
        "tree_max_seqlen_q": int(packed["tree_max_seqlens"][0]),
        "tree_max_seqlen_k": int(packed["tree_max_seqlens"][1]),
    }


def _per_token_logprobs(logits, targets):
    return torch.log_softmax(logits.double(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _reference(model, samples):
    """Each sample's completion-token log-probs from its own unpacked row, with plain SDPA."""
    model.set_attn_implementation("sdpa")
    out = []
    for sample in samples:
        ids = sample["input_ids"].unsqueeze(0)
        logits = model(input_ids=ids).logits[0, :-1]
        mask = sample["completion_mask"][1:].bool()
        out.append(_per_token_logprobs(logits[mask], ids[0, 1:][mask]))
    return torch.cat(out)


def _tree(model, packed):
    model.set_attn_implementation(ta.register_tree_attention())
    logits = model(
        input_ids=packed["input_ids"].unsqueeze(0), position_ids=packed["position_ids"].unsqueeze(0),
        **_tree_kwargs(packed),
    ).logits[0]  # fmt: skip
    targets = torch.cat([s["input_ids"][1:][s["completion_mask"][1:].bool()] for s in _samples()])
    return _per_token_logprobs(logits[packed["token_index"]], targets)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_packed_tree_equals_each_row_in_value_and_gradient(kv_heads):
    samples = _samples()
    packed = _packed(samples)
    forwarded, raw = len(packed["input_ids"]), sum(len(s["input_ids"]) for s in samples)
    assert forwarded < raw  # prompts (and the shared completion token) are forwarded once
    reference_model, tree_model = tiny_qwen2(kv_heads=kv_heads), tiny_qwen2(kv_heads=kv_heads)
    reference, tree = _reference(reference_model, samples), _tree(tree_model, packed)
    torch.testing.assert_close(tree, reference, rtol=0, atol=1e-6)
    # Weighted sums so every token's gradient counts differently: a shared prompt's gradient is the sum over its rows.
    weights = torch.linspace(0.5, 2.0, reference.numel(), dtype=torch.float64)
    (reference * weights).sum().backward()
    (tree * weights).sum().backward()
    for (name, p), q in zip(reference_model.named_parameters(), tree_model.parameters()):
        # float32 sums in another order (a shared prompt's gradient is summed once, not row by row): 1e-6 of the scale
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6 * p.grad.abs().max().item(), msg=name)


def test_a_completion_that_sees_a_sibling_is_caught():
    """Break the layout so the last segment's path also holds a sibling completion's tokens: the comparison with
    the unpacked rows must fail (the test above would catch a leaking mask)."""
    samples = _samples()
    packed = _packed(samples)
    model = tiny_qwen2()
    reference = _reference(model, samples)
    cu_q, cu_k = packed["tree_cu_seqlens_q"], packed["tree_cu_seqlens_k"]
    last = len(cu_q) - 2
    sibling = torch.arange(int(cu_q[last - 1]), int(cu_q[last]))  # the segment before the last one
    path = packed["tree_kv_index"][int(cu_k[last]) :]
    leaky = dict(packed)
    leaky["tree_kv_index"] = torch.cat([packed["tree_kv_index"][: int(cu_k[last])], sibling, path])
    leaky["tree_cu_seqlens_k"] = cu_k.clone()
    leaky["tree_cu_seqlens_k"][-1] += len(sibling)
    assert not torch.allclose(_tree(model, leaky), reference, atol=1e-4)


def test_the_mask_is_bounded_by_the_query_block(monkeypatch):
    """A long segment is processed in blocks: no mask larger than QUERY_BLOCK × path length is built."""
    monkeypatch.setattr(ta, "QUERY_BLOCK", 8)
    shapes = []
    real = ta.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        shapes.append(tuple(attn_mask.shape) if attn_mask is not None else None)
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(ta.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    n = 40  # one 10-token root and a 30-token child segment
    q, k, v = torch.randn(2, n, 4), torch.randn(1, n, 4), torch.randn(1, n, 4)
    kv_index = torch.cat([torch.arange(10), torch.arange(n)])  # the root's path, then the child's (root + itself)
    out = ta.tree_attention(q, k, v, kv_index, torch.tensor([0, 10, n]), torch.tensor([0, 10, 10 + n]))
    masks = [shape for shape in shapes if shape is not None]
    assert len(masks) == 4  # the child's 30 queries in blocks of 8; the root is plain causal, without a mask
    assert max(rows for rows, _ in masks) == 8 and max(cols for _, cols in masks) == n
    monkeypatch.undo()
    # Equal to causal attention over the whole chain (the root and its child form one sequence).
    full = torch.nn.functional.scaled_dot_product_attention(
        q, k.expand(2, -1, -1), v.expand(2, -1, -1), is_causal=True
    )
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)


def test_bad_layouts_are_named():
    q = k = v = torch.zeros(1, 6, 2)
    with pytest.raises(ValueError, match="cover 5 positions, the row has 6"):
        ta.tree_attention(q, k, v, torch.arange(5), torch.tensor([0, 5]), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="segment 0 has 6 tokens but a path of only 3"):
        ta.tree_attention(q, k, v, torch.arange(3), torch.tensor([0, 6]), torch.tensor([0, 3]))
