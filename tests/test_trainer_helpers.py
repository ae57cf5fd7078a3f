"""The trainer's small pure helpers, moved out of the class: closed-form checks."""

from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig, MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_rlloss.parallel.sequence import on_first_sp_rank
from hf_rlloss.trainer.common.engines import head_operands
from hf_rlloss.trainer.common.rollout_recording import (
    kept_logmass_batch,
    replay_warpers,
    truncation_replay,
    unreplayable_truncation,
)
from hf_rlloss.trainer.grpo_trainer import adapted_entropy_coef, trl_is_ratio_per_token


def test_replay_warpers_in_generate_order_and_none_without_truncation():
    warpers = replay_warpers(top_k=5, top_p=0.9, min_p=0.1)
    assert [type(w) for w in warpers] == [TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper]
    assert replay_warpers(top_k=0, top_p=1.0, min_p=None) is None
    assert replay_warpers(top_k=None, top_p=None, min_p=0.0) is None


def test_truncation_replay_by_support_and_backend():
    config = GenerationConfig(do_sample=True, top_k=4, top_p=1.0)
    assert truncation_replay(True, None, config, "full", False) is None  # full vocabulary: nothing to replay
    assert [type(w) for w in truncation_replay(True, None, config, "sampled", False)] == [TopKLogitsWarper]
    # vLLM / rollout_func: always on the sampled support
    external = {"top_k": None, "top_p": 0.5, "min_p": None}
    assert [type(w) for w in truncation_replay(False, external, config, "full", False)] == [TopPLogitsWarper]
    assert truncation_replay(False, None, config, "sampled", True) is None  # no rollout log-probs at all
    typical = GenerationConfig(do_sample=True, typical_p=0.5)
    assert unreplayable_truncation(typical) == {"typical_p": 0.5}
    with pytest.raises(ValueError, match="replays top_k, top_p and min_p .* not typical_p=0.5"):
        truncation_replay(True, None, typical, "sampled", False)
    with pytest.raises(ValueError, match="rollout_is needs sampled completions.*'greedy_search'"):
        truncation_replay(True, None, GenerationConfig(do_sample=False), "full", True)


def test_kept_logmass_batch_pads_and_needs_one_call():
    completion_ids = torch.zeros(2, 3, dtype=torch.long)
    recorded = [[torch.tensor([-0.1, -0.2]), torch.tensor([-0.3, -0.4, -0.5, -0.6])]]
    kept = kept_logmass_batch(recorded, completion_ids)
    assert torch.allclose(kept, torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]))
    assert kept_logmass_batch(recorded * 2, completion_ids) is None  # tool calls: several generate calls
    assert kept_logmass_batch([recorded[0][:1]], completion_ids) is None


def test_on_first_sp_rank():
    class Mesh:
        def __init__(self, rank):
            self.rank = rank

        def get_local_rank(self):
            return self.rank

    counts = torch.tensor([2.0, 3.0])
    assert torch.equal(on_first_sp_rank(counts, None), counts)
    assert torch.equal(on_first_sp_rank(counts, Mesh(0)), counts)
    assert torch.equal(on_first_sp_rank(counts, Mesh(1)), torch.zeros(2))


def test_head_operands_dtypes():
    hidden, weight = torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(3, 4)
    h, w, dtype = head_operands(hidden, weight, cast_to_fp32=True, mixed_precision="bf16")
    assert h.dtype == w.dtype == dtype == torch.float32
    h, w, dtype = head_operands(hidden, weight, cast_to_fp32=False, mixed_precision="bf16")
    assert (h.dtype, w.dtype, dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)  # the kernel casts
    h, w, dtype = head_operands(hidden, weight, cast_to_fp32=False, mixed_precision="no")
    assert h.dtype == w.dtype == torch.float32 and dtype is None


def test_adapted_entropy_coef_moves_towards_the_target_within_bounds():
    args = SimpleNamespace(entropy_target=0.5, entropy_coef_delta=0.1, entropy_coef_min=0.0, entropy_coef_max=0.25)
    assert adapted_entropy_coef(0.1, entropy=0.4, args=args) == pytest.approx(0.2)  # too little entropy: more
    assert adapted_entropy_coef(0.2, entropy=0.4, args=args) == 0.25  # clamped
    assert adapted_entropy_coef(0.05, entropy=0.6, args=args) == 0.0  # too much: less, clamped at the minimum


def test_trl_sequence_ratio_on_the_first_valid_token_for_absorbing_losses():
    labels = torch.tensor([[-100, 5, 6], [7, 8, -100]])
    ratio = torch.tensor([[2.0], [3.0]])
    placed = trl_is_ratio_per_token(ratio, labels, -100, absorbs=True)
    assert placed.tolist() == [[1.0, 2.0, 1.0], [3.0, 1.0, 1.0]]
    assert trl_is_ratio_per_token(ratio, labels, -100, absorbs=False).tolist() == [[2.0] * 3, [3.0] * 3]
