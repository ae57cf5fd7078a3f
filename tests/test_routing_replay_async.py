"""MoE routing replay in `RLLossAsyncGRPOTrainer` (`async_/routing_replay.py`, `RLLossAsyncGRPOConfig.routing_replay`).

A tiny Qwen3-MoE with near-tied routers (`_models.tiny_moe`: every expert's router row one shared row plus a 1e-3
perturbation, experts' outputs × 10), saved to disk (the async trainer loads its policy from a path).
"""

from __future__ import annotations

import types

import pytest
import torch
from _async import ASYNC_ARGS, FixedRolloutWorker, NoWeightTransfer, fixed_samples, prompts_dataset
from _models import tiny_moe
from _trainer_utils import make_dataset, make_tokenizer, reward_length
from trl.experimental.async_grpo.packing import TreeRow

from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
from hf_rlloss.trainer.async_.rollout import HFGenerateLoop, HFGenerateRolloutWorker
from hf_rlloss.trainer.async_.routing_replay import tree_routes
from hf_rlloss.trainer.async_grpo_trainer import portable_async_trl
from hf_rlloss.trainer.common.packing import tree_positions
from hf_rlloss.trainer.common.routing_replay import find_routers

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("moe")
    tiny_moe(tok, "qwen3_moe").save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _worker_samples(moe_path, tok, tmp_path, dtype: str):
    """One batch (2 prompts × 4 completions of ≤ 8 tokens) of `HFGenerateRolloutWorker`'s loop, run in-process, its
    policy copy in `dtype`, recording the routes (`routing_replay="rollout"`)."""
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), routing_replay="rollout", **ASYNC_ARGS)
    worker = HFGenerateRolloutWorker(moe_path, make_dataset(), [reward_length], tok, args, groups_per_batch=2)
    assert worker.records_routes
    worker._settings.dtype = dtype
    loop = HFGenerateLoop(worker._settings, None, worker.metrics_queue, None, None, types.SimpleNamespace(value=0.0))
    loop.load()
    loop.version = 0
    torch.manual_seed(0)
    return loop._generate_batch()


def _train(moe_path, tok, tmp_path, samples, steps: int = 1, **options):
    """`RLLossAsyncGRPOTrainer` fed `samples` (a fixed in-process worker; one group of 4 per step, the next
    prefetched), trained `steps` steps; its step logs."""
    args = RLLossAsyncGRPOConfig(
        output_dir=str(tmp_path),
        **{**ASYNC_ARGS, "max_steps": steps, **options},
    )  # fmt: skip
    worker = FixedRolloutWorker(samples)
    worker.records_routes = options.get("routing_replay") == "rollout"
    with portable_async_trl():
        trainer = RLLossAsyncGRPOTrainer(
            moe_path, [], args, prompts_dataset(), tok, rollout_worker=worker, weight_transfer=NoWeightTransfer()
        )
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss/total" in h]


def test_worker_routes_follow_the_packed_row(moe_path, tok, tmp_path):
    """The worker's samples carry `(T, L, k)` routes (each prompt token and each completion token but the last), and
    a `TreeRow` of them replays at each packed position the route of the first sample holding that token: unshared
    tokens their own, the shared prompt the first completion's."""
    samples = _worker_samples(moe_path, tok, tmp_path, "float32")
    row = TreeRow()
    for sample in samples[:4]:  # one group: a shared prompt
        row.add({"input_ids": torch.as_tensor(sample.input_ids), "completion_mask": sample.completion_mask,
                 "old_log_probs": sample.old_log_probs, "advantage": 0.0, "group_id": 0,
                 "routed_experts": sample.routed_experts})  # fmt: skip
    packed = row.pack()
    routes, shared, differing = tree_routes(row, packed["input_ids"])
    positions = tree_positions(row)
    first_owner = {}
    for i, (sample, nodes) in enumerate(zip(samples[:4], row.sample_nodes)):
        own = torch.as_tensor(sample.routed_experts)
        assert own.shape == (len(sample.input_ids), 2, 2)
        assert (own[:-1] >= 0).all() and (own[-1] == -1).all()  # the last generated token was never forwarded
        for p, node in enumerate(nodes):
            first_owner.setdefault(node, (i, own[p]))
            assert torch.equal(routes[positions[node]], first_owner[node][1]), (i, p)
    prompt = int((samples[0].completion_mask == 0).sum())
    # the other 3 completions' prompt tokens replay the first one's (the last prompt token too where the first
    # completion tokens agree: TRL's trie shares a token when the next one agrees)
    assert shared >= 3 * (prompt - 1)
    assert 0 <= differing <= shared


def test_rollout_replay_in_the_async_trainer(moe_path, tok, tmp_path):
    """`routing_replay="rollout"` with a bf16 sampler and an fp32 trainer on near-tied routers: replaying the
    sampler's routes in π_old, the trainer's routers would have chosen otherwise (`routing/disagreement` > 0: replay
    changes the experts) and the rollout mismatch is the precision's alone; routed live the mismatch is larger. With
    an fp32 sampler, the replayed π_old equals the sampler's log-probs to float32 round-off."""
    bf16 = _worker_samples(moe_path, tok, tmp_path / "w16", "bfloat16")
    _, replayed = _train(moe_path, tok, tmp_path / "r", bf16, routing_replay="rollout")
    _, live = _train(moe_path, tok, tmp_path / "l", bf16, routing_replay="off")
    replayed, live = replayed[0], live[0]
    assert replayed["routing/disagreement"] > 0.0
    assert replayed["routing/replayed_tokens"] > 0
    # bf16 rounds each logit to 2^-8 relative: mean |Δ log p| a few 1e-3 here; a flipped expert moves it by far more
    mean_replayed, mean_live = (
        replayed["mismatch/mismatch_logprob_abs_diff"],
        live["mismatch/mismatch_logprob_abs_diff"],
    )
    assert mean_replayed < 1e-2 and mean_live > 3 * mean_replayed, (mean_replayed, mean_live)  # 4e-4, 2e-2 here
    fp32 = _worker_samples(moe_path, tok, tmp_path / "w32", "float32")
    _, exact = _train(moe_path, tok, tmp_path / "e", fp32, routing_replay="rollout")
    # the same fp32 weights, KV-cache decode vs one tree-attention forward: float32 reduction order over ≤ 30
    # positions of O(1) values, |Δ log p| ≲ 1e-6; bound 1e-5 (as the synchronous trainer's test)
    assert exact[0]["mismatch/mismatch_logprob_abs_diff"] < 1e-5
    assert exact[0]["routing/disagreement"] == 0.0
    # every forwarded token has a route but each sample's last one (a leaf of the trie): 8 samples
    assert exact[0]["routing/replayed_tokens"] > 0
    assert "routing/shared_tokens_differing" in exact[0]


def test_old_policy_replay_in_the_async_trainer(moe_path, tok, tmp_path):
    """`routing_replay="old_policy"` with `num_mini_batches=2`: the loss forward of each mini-batch routes every token
    through the experts its π_old pass chose (computed for both mini-batches before the first update); the first
    is on-policy (disagreement 0), the second trains after an update, which the routers' own choice has moved
    away from (disagreement > 0). The `routing/*` metrics count the packed row's tokens (its padding stripped), as
    an independent count from the routers' own top-k says."""
    samples = fixed_samples(4)
    seen = {"record": [[], []], "loss": [[], []], "live": [[], []]}
    trainer_box = {}

    def spy(router, args, output):  # registered after the replay hook: sees the experts it hands on
        state = trainer_box["t"]._routing.state
        if state in ("record", "replay"):
            seen["record" if state == "record" else "loss"][routers.index(router)].append(output[2].clone())

    def live_spy(router, args, output):  # registered before the replay hook: the router's own top-k
        if trainer_box["t"]._routing.counting:
            seen["live"][routers.index(router)].append(output[2].clone())

    args = RLLossAsyncGRPOConfig(
        output_dir=str(tmp_path), routing_replay="old_policy", num_mini_batches=2,
        **{**ASYNC_ARGS, "max_steps": 2, "learning_rate": 3e-2},
    )  # fmt: skip
    with portable_async_trl():
        trainer = RLLossAsyncGRPOTrainer(moe_path, [], args, prompts_dataset(), tok,
                                         rollout_worker=FixedRolloutWorker(samples),
                                         weight_transfer=NoWeightTransfer())  # fmt: skip
    trainer_box["t"] = trainer
    routers = [router for router, _ in find_routers(trainer.model)]
    handles = [r.register_forward_hook(spy) for r in routers]
    handles += [r.register_forward_hook(live_spy, prepend=True) for r in routers]
    trainer.train()
    for handle in handles:
        handle.remove()
    assert [len(c) for c in seen["record"]] == [2, 2] and [len(c) for c in seen["loss"]] == [2, 2]
    for layer in range(2):
        for mini_batch in range(2):  # the same packed row: position by position the same experts
            assert torch.equal(seen["loss"][layer][mini_batch], seen["record"][layer][mini_batch])
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    assert logs[0]["routing/disagreement"] == 0.0 and logs[1]["routing/disagreement"] > 0.0
    for step, log in enumerate(logs):  # one loss forward per step, of one packed row: every position a real token
        replayed = [seen["loss"][layer][step] for layer in range(2)]
        live = [seen["live"][layer][step] for layer in range(2)]
        differing = sum(len(set(a.tolist()) - set(b.tolist())) for r, o in zip(replayed, live) for a, b in zip(r, o))
        assert log["routing/replayed_tokens"] == replayed[0].shape[0]
        assert log["routing/disagreement"] == pytest.approx(differing / sum(r.numel() for r in replayed), abs=1e-6)


def test_async_refusals(moe_path, tok, tmp_path):
    with pytest.raises(ValueError, match=r"routing_replay='never'; expected one of 'off', 'rollout', 'old_policy'"):
        RLLossAsyncGRPOConfig(output_dir=str(tmp_path), routing_replay="never")
    with pytest.raises(ValueError, match=r"routing_replay='old_policy' .* behavior_as_old_policy=True skips"):
        RLLossAsyncGRPOConfig(output_dir=str(tmp_path), routing_replay="old_policy", behavior_as_old_policy=True)
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), routing_replay="rollout", **ASYNC_ARGS)
    with pytest.raises(ValueError, match=r"routing_replay='rollout' .* FixedRolloutWorker does not record them"):
        RLLossAsyncGRPOTrainer(moe_path, [], args, prompts_dataset(), tok, rollout_worker=FixedRolloutWorker([]),
                               weight_transfer=NoWeightTransfer())  # fmt: skip
    from hf_rlloss.trainer.async_.rollout import VLLMRolloutWorker

    with pytest.raises(ValueError, match=r"routing_replay='rollout' with VLLMRolloutWorker: .* enable_return_routed"):
        VLLMRolloutWorker(moe_path, make_dataset(), [reward_length], tok, args)
