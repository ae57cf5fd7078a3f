"""The CUDA default, checked on the CPU with the code path CUDA takes: the layout `packing="auto"` chooses per device,
no host sync per layer inside the model (forward and backward), and a training step that dispatches at most 1.2× stock
TRL's operators and syncs with the host no more than TRL outside the model (benchmarks/shared/dispatch_counts.py says
what is counted; benchmarks/performance/cuda_proxies.py records the numbers)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.performance.cuda_proxies import count_step
from benchmarks.shared.dispatch_counts import DispatchCounts
from benchmarks.shared.tiny_models import make_tokenizer, tiny_config
from hf_rlloss.parallel import tree_attention
from hf_rlloss.parallel.packed_attention import packed_forward
from hf_rlloss.trainer.common.packing import build_layout, packing_for_device, prepare_packing


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _llama(tok, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config(tok, 32, layers, 4, 2), intermediate_size=64))
    model.set_attn_implementation("sdpa")
    return model


def _batch(groups: int = 2, g: int = 4, prompt: int = 6, completion: int = 10):
    """Two groups of `g` completions of varied lengths sharing their prompt; the second group's prompt left-padded."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(16, 60, (groups, prompt), generator=gen).repeat_interleave(g, 0)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[g:, :2] = 0
    lengths = torch.randint(3, completion + 1, (groups * g,), generator=gen)
    completion_mask = (torch.arange(completion)[None] < lengths[:, None]).long()
    completions = torch.randint(16, 60, (groups * g, completion), generator=gen) * completion_mask
    return prompts * prompt_mask, prompt_mask, completions, completion_mask


def _forward_backward(model, mode: str) -> tuple[DispatchCounts, torch.Tensor]:
    """The model's forward and backward on `_batch()` laid out as `mode`, counted; returns the counts and the
    completion tokens' hidden states."""
    prompts, prompt_mask, completions, completion_mask = _batch()
    if mode != "off":
        assert prepare_packing(mode, model, True)[0] == mode
    layout = build_layout(mode, prompts, prompt_mask, completions, completion_mask)  # outside the model: per step
    with DispatchCounts() as counts:
        if layout is None:
            ids, mask = torch.cat([prompts, completions], 1), torch.cat([prompt_mask, completion_mask], 1)
            out = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        else:
            with packed_forward():
                out = model.model(
                    input_ids=layout.input_ids, position_ids=layout.position_ids, **layout.attention_kwargs
                ).last_hidden_state
        out.float().pow(2).sum().backward()
    if layout is None:
        hidden = out[:, prompts.shape[1] - 1 : -1][completion_mask.bool()]
    else:
        hidden = layout.completion_hidden(out)[completion_mask.bool()]
    return counts, hidden.detach()


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1)):
    """flash-attn's `flash_attn_varlen_func` (bottom-right causal, GQA), computed with one masked SDPA call and no
    data-dependent shape: a stand-in for the CUDA kernel, so that the CUDA branch of the tree attention runs here."""
    assert causal and window_size == (-1, -1)
    cu_q, cu_k = cu_q.long(), cu_k.long()
    seg_q = torch.searchsorted(cu_q[1:], torch.arange(q.shape[0]), right=True)  # (Nq,) each query's segment
    seg_k = torch.searchsorted(cu_k[1:], torch.arange(k.shape[0]), right=True)
    depth_q = torch.arange(q.shape[0]) - cu_q[seg_q] + (cu_k.diff() - cu_q.diff())[seg_q]  # bottom-right aligned
    depth_k = torch.arange(k.shape[0]) - cu_k[seg_k]
    allowed = (seg_q[:, None] == seg_k[None, :]) & (depth_k[None, :] <= depth_q[:, None])  # (Nq, Nk)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=allowed,
        scale=softmax_scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)  # (Nq, H, D)


def test_the_counter_counts_host_syncs_and_nothing_else():
    x = torch.arange(6.0)
    with DispatchCounts() as counts:
        y = x * 2 + 1  # device work only
        _ = y[torch.tensor([0, 2])]  # integer indexing: no sync
    assert counts.total_syncs == 0 and counts.total_ops >= 3
    tolist = torch.Tensor.tolist
    with DispatchCounts() as counts:
        float(x.sum()), x[x > 2], x.nonzero(), x.tolist(), bool(x[0]), torch.repeat_interleave(torch.tensor([1, 2]))
    # each a read of device memory by the host: float and bool, boolean indexing, nonzero, tolist, repeat_interleave
    assert counts.syncs == {"aten._local_scalar_dense.default": 2, "aten.index.Tensor": 1, "aten.nonzero.default": 1,
                            "Tensor.tolist": 1, "aten.repeat_interleave.Tensor": 1}  # fmt: skip
    assert torch.Tensor.tolist is tolist  # the patched methods are restored
    with DispatchCounts() as again:
        pass
    assert again.total_syncs == 0


@pytest.mark.parametrize(
    "device, half, flash, expected",
    [
        ("cpu", False, False, "shared_prefix"),
        ("cpu", True, True, "shared_prefix"),
        ("cuda", True, False, "off"),
        ("cuda", False, False, "off"),
        ("cuda", True, True, "shared_prefix"),
        ("cuda", False, True, "off"),  # flash-attn takes bf16/fp16 only
    ],
)
def test_auto_packing_is_the_padded_forward_on_cuda_without_the_varlen_kernel(device, half, flash, expected):
    mode, why = packing_for_device(device, half_precision=half, flash_varlen=flash)
    assert mode == expected and why


def test_the_cuda_default_forward_has_no_host_sync_per_layer(tok):
    """`packing="auto"` on CUDA without flash-attn: the padded forward. Its syncs (transformers' mask builder, once per
    forward) do not grow with depth."""
    mode = packing_for_device("cuda", half_precision=True, flash_varlen=False)[0]
    shallow, _ = _forward_backward(_llama(tok, 2), mode)
    deep, _ = _forward_backward(_llama(tok, 4), mode)
    assert deep.total_syncs == shallow.total_syncs, (shallow.syncs, deep.syncs)


def test_the_cuda_default_with_flash_attn_packs_with_no_host_sync_per_layer(tok, monkeypatch):
    """`packing="auto"` on CUDA with flash-attn's varlen kernel: `shared_prefix`, the packed row in one kernel call per
    layer. The kernel is replaced by a CPU stand-in of its semantics: the tree attention's CUDA branch then gives the
    segment-by-segment result, and no sync grows with depth (the old CUDA default synced in every layer)."""
    mode = packing_for_device("cuda", half_precision=True, flash_varlen=True)[0]
    assert mode == "shared_prefix"
    _, expected = _forward_backward(_llama(tok, 2), mode)  # the SDPA path, segment by segment
    segment_sdpa = (_forward_backward(_llama(tok, 2), mode)[0], _forward_backward(_llama(tok, 4), mode)[0])
    assert segment_sdpa[1].total_syncs > segment_sdpa[0].total_syncs  # the old path: a `.tolist()` per layer
    monkeypatch.setattr(tree_attention, "_varlen_kernel_for", lambda *args: _varlen_reference)
    shallow, hidden = _forward_backward(_llama(tok, 2), mode)
    deep, _ = _forward_backward(_llama(tok, 4), mode)
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    assert deep.total_syncs == shallow.total_syncs, (shallow.syncs, deep.syncs)


@pytest.fixture(scope="module")
def steps():
    return {(variant, layers): count_step(variant, layers) for variant in ("trl", "cuda_default") for layers in (2, 4)}


@pytest.mark.parametrize("layers", [2, 4])
def test_the_cuda_default_step_dispatches_at_most_1_2x_trl_and_syncs_no_more(steps, layers):
    ours, trl = steps[("cuda_default", layers)], steps[("trl", layers)]
    assert ours["ops"] <= 1.2 * trl["ops"], (ours["ops"], trl["ops"])
    outside = ours["syncs"] - ours["syncs_in_model"], trl["syncs"] - trl["syncs_in_model"]
    assert outside[0] <= outside[1], (outside, ours["syncs_by_kind"], trl["syncs_by_kind"])
    assert ours["syncs_in_model"] == steps[("cuda_default", 2)]["syncs_in_model"]  # none per layer
