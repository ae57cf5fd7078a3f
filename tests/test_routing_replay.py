"""MoE routing replay (`hf_rlloss.trainer.common.routing_replay`, `RLLossGRPOConfig.routing_replay`).

Tiny random MoE models of four families (Qwen3-MoE, OLMoE, Mixtral, GPT-OSS). Their routers are made near-tied
(every expert's router row is one shared row plus a 1e-3 perturbation) and their experts' outputs large, so that the
rounding of a bf16 sampler flips the top-k choice and a flip moves the log-probs: the case routing replay exists for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
from _dist import FakeSPMesh
from _models import tiny_moe
from _trainer_utils import BASE_ARGS, make_tokenizer, reward_length
from datasets import Dataset

from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer
from hf_rlloss.trainer.common.routing_replay import (
    ROUTER_FAMILIES,
    RoutingReplay,
    batch_routes,
    find_routers,
    generation_routes,
    get_batch_routes,
    layout_routes,
    routes_from_layout,
)

FAMILIES = ["qwen3_moe", "olmoe", "mixtral", "gpt_oss"]
PROMPTS = ["hello world, how", "hi", "what is 3+4?"]  # different lengths: left padding in generate
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def sample_and_record(model, tok, replay: RoutingReplay, bf16: bool):
    """Sample 8 tokens per prompt with HF generate (under bf16 autocast when `bf16`), recording the routers; returns
    the `(B, P + C)` ids, mask and positions, `P`, the `(B, C)` completion, its recorded log-probs (the raw logits'
    log-softmax, float32) and the `(B, P + C, L, k)` routes."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    torch.manual_seed(1)
    with replay.recording() as records, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model.generate(
            **enc, do_sample=True, max_new_tokens=NEW_TOKENS, top_k=0, top_p=1.0, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    prompt_length = enc["input_ids"].shape[1]
    completion = out.sequences[:, prompt_length:]
    logits = torch.stack(out.logits, dim=1).float()  # (B, C, V): the raw logits each token was sampled from
    recorded = torch.log_softmax(logits, -1).gather(2, completion[..., None])[..., 0]
    lengths = [completion.shape[1]] * completion.shape[0]
    prompts, completions = generation_routes(records, enc["attention_mask"], lengths)
    routes = batch_routes(prompts, completions, prompt_length, completion.shape[1])
    mask = torch.cat([enc["attention_mask"], torch.ones_like(completion)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as HF generate gives a left-padded batch
    return out.sequences, mask, positions, prompt_length, completion, recorded, routes


def trainer_logprobs(model, replay, ids, mask, positions, prompt_length, completion, routes=None):
    """The fp32 log-probs of the completion from one full forward, replaying `routes` (or routing live)."""
    routed = contextlib.nullcontext()  # live: whatever `replay` does around the call (e.g. record)
    if routes is not None:
        routed = replay.replay(layout_routes(routes), True)
    with routed, torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    return torch.log_softmax(logits[:, prompt_length - 1 : -1], -1).gather(2, completion[..., None])[..., 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_logprobs_equal_the_recorded_ones(tok, family):
    # Same precision (fp32): HF generate (KV cache, one token per step) and the trainer's full forward differ only
    # by the order of float32 reductions over ≤ 30 positions of O(1) values: |Δ log p| ≲ 1e-6; bound 1e-5.
    model = tiny_moe(tok, family)
    replay = RoutingReplay().attach(model)
    ids, mask, positions, p, completion, recorded, routes = sample_and_record(model, tok, replay, bf16=False)
    replayed = trainer_logprobs(model, replay, ids, mask, positions, p, completion, routes)
    counts = replay.take_counts()
    assert (replayed - recorded).abs().max() < 1e-5
    # every token but each row's last generated one has a route (that one is never forwarded during generation)
    assert counts["routing_acc/tokens"] == mask.sum() - mask.shape[0]
    assert (routes[:, -1] == -1).all() and (routes[:, :-1][mask[:, :-1].bool()] >= 0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_sampler_fp32_trainer(tok, family):
    """A bf16 sampler and an fp32 trainer: routed live, the trainer disagrees with the sampler's routing and its
    log-probs move far from the recorded ones; replayed, it routes every token through the recorded experts, and
    its log-probs differ from the recorded ones by the precision alone."""
    model = tiny_moe(tok, family)
    replay = RoutingReplay().attach(model)
    ids, mask, positions, p, completion, recorded, routes = sample_and_record(model, tok, replay, bf16=True)
    used, own = [], []  # the ids the experts receive, and the routers' own choice, spied beside the replay hook
    experts = [m for name, m in model.named_modules() if name.endswith("experts")]
    handles = [e.register_forward_pre_hook(lambda m, args: used.append(args[1].clone())) for e in experts]
    for router, _ in find_routers(model):  # prepended: sees the router's output before the replay hook replaces it
        handles.append(router.register_forward_hook(lambda m, args, out: own.append(out[2].clone()), prepend=True))
    replayed = trainer_logprobs(model, replay, ids, mask, positions, p, completion, routes)
    counts = replay.take_counts()
    for handle in handles:
        handle.remove()
    # no `replay.live()`: after a replayed forward the targets serve only a recomputation inside a backward
    live = trainer_logprobs(model, replay, ids, mask, positions, p, completion)
    # the experts used under replay are the recorded ones, except for the tokens without a route (routed live)
    targets = layout_routes(routes)  # (N, L, k)
    has_route = targets[:, 0, 0] >= 0
    for layer, ids_used in enumerate(used):
        assert torch.equal(ids_used[has_route], targets[has_route, layer].long())
    # the hook's disagreement: the recorded experts that are not among the router's own top-k (each layer given
    # the replayed layers before it)
    own_ids = torch.stack(own, dim=1)[has_route]  # (N', L, k)
    differs = ~(targets[has_route][..., :, None] == own_ids[..., None, :]).any(-1)
    assert counts["routing_acc/differing"] == differs.sum() > 0
    assert counts["routing_acc/decisions"] == differs.numel()
    # bf16 rounds each logit to 2^-8 relative: |Δ log p| a few 1e-3 here; a flipped expert moves it by far more
    mean_replayed, mean_live = (replayed - recorded).abs().mean(), (live - recorded).abs().mean()
    assert mean_replayed < 1e-2 and mean_live > 1.3 * mean_replayed, (mean_replayed, mean_live)


def _router_cases():
    """A tiny router of each family in `ROUTER_FAMILIES`, with the configs' defaults."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as ds
    import transformers.models.glm4_moe.modeling_glm4_moe as glm
    import transformers.models.gpt_oss.modeling_gpt_oss as oss
    import transformers.models.granitemoe.modeling_granitemoe as granite
    import transformers.models.mixtral.modeling_mixtral as mixtral
    import transformers.models.olmoe.modeling_olmoe as olmoe
    import transformers.models.qwen2_moe.modeling_qwen2_moe as q2
    import transformers.models.qwen3_moe.modeling_qwen3_moe as q3

    size = dict(hidden_size=16, num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2)
    group = dict(n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, n_routed_experts=8)
    return {
        "qwen3_moe": q3.Qwen3MoeTopKRouter(q3.Qwen3MoeConfig(num_experts=8, norm_topk_prob=True, **size)),
        "qwen2_moe": q2.Qwen2MoeTopKRouter(q2.Qwen2MoeConfig(num_experts=8, norm_topk_prob=False, **size)),
        "olmoe": olmoe.OlmoeTopKRouter(olmoe.OlmoeConfig(num_experts=8, **size)),
        "mixtral": mixtral.MixtralTopKRouter(mixtral.MixtralConfig(num_local_experts=8, **size)),
        "gpt_oss": oss.GptOssTopKRouter(oss.GptOssConfig(num_local_experts=8, **size)),
        "granitemoe": granite.GraniteMoeTopKRouter(granite.GraniteMoeConfig(num_local_experts=8, **size)),
        "deepseek_v3": ds.DeepseekV3TopkRouter(ds.DeepseekV3Config(**size, **group)),
        "glm4_moe": glm.Glm4MoeTopkRouter(glm.Glm4MoeConfig(**size, **group)),
    }


def test_a_router_whose_transformers_returns_another_order_is_refused_naming_the_release(monkeypatch):
    from hf_rlloss.trainer.common import routing_replay

    granite = next(f for f in ROUTER_FAMILIES if f.name == "GraniteMoeTopKRouter")
    newer = dataclasses.replace(granite, since="99.0")
    monkeypatch.setattr(
        routing_replay, "ROUTER_FAMILIES", tuple(newer if f is granite else f for f in ROUTER_FAMILIES)
    )
    with pytest.raises(ValueError, match=r"replays GraniteMoeTopKRouter from transformers 99.0 on \(.* is installed"):
        RoutingReplay().attach(_router_cases()["granitemoe"])


def test_each_family_recomputes_its_own_gate_weights():
    """Replaying a router's own choice gives exactly its own gate weights (softmax over all experts or over the
    chosen, renormalization, routed scaling; a correction bias that moves only the choice); replaying another
    choice gives weights with a gradient to the router."""
    torch.manual_seed(0)
    supported = {f.name for f in ROUTER_FAMILIES if f.supported()}
    for name, router in _router_cases().items():
        if type(router).__name__ not in supported:  # an older transformers: refused by name (the test below)
            continue
        with torch.no_grad():
            for param in router.parameters():
                param.normal_()
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.normal_()  # moves the choice, never the weights
        replay = RoutingReplay().attach(router)
        hidden = torch.randn(6, 16)
        logits, weights, ids = router(hidden)
        with replay.replay(ids[:, None, :].clone()):
            _, replayed, replayed_ids = router(hidden)
        assert torch.equal(replayed_ids, ids), name
        torch.testing.assert_close(replayed, weights, rtol=0, atol=0, msg=name)
        other = torch.stack([(ids[:, 0] + 1) % 8, (ids[:, 0] + 2) % 8], dim=-1)  # another choice, distinct experts
        router.zero_grad()
        with replay.replay(other[:, None, :]):
            _, replayed, replayed_ids = router(hidden)
        assert torch.equal(replayed_ids, other), name
        (replayed * torch.randn_like(replayed)).sum().backward()
        assert router.weight.grad.abs().sum() > 0, name


def test_router_gradient_equals_a_hand_written_moe_with_given_ids(tok):
    """Qwen3-MoE's sparse block replaying given expert ids (float64): its output and the gradients of the router,
    the experts and the input equal a hand-written MoE forward through those ids (softmax over all experts, the
    chosen ones renormalized, SwiGLU experts)."""
    model = tiny_moe(tok, "qwen3_moe", near_tied=False)
    model.set_experts_implementation("eager")  # grouped_mm has no float64
    model = model.double()
    block = model.model.layers[0].mlp
    replay = RoutingReplay().attach(block)
    torch.manual_seed(3)
    hidden = torch.randn(1, 5, 32, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 3], [7, 1], [2, 5], [4, 6], [5, 0]])
    direction = torch.randn(1, 5, 32, dtype=torch.float64)
    with replay.replay(ids[:, None, :]):
        out = block(hidden)
    params = [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, hidden]
    grads = torch.autograd.grad((out * direction).sum(), params)

    def hand_written(router_w, gate_up, down, x):
        x = x.reshape(5, 32)
        weights = torch.softmax((x @ router_w.T).float(), dim=-1).double().gather(1, ids)  # float32, as the model
        weights = weights / weights.sum(-1, keepdim=True)
        rows = []
        for t in range(5):
            row = torch.zeros(32, dtype=x.dtype)
            for slot in range(2):
                gate, up = (gate_up[ids[t, slot]] @ x[t]).chunk(2)
                row = row + weights[t, slot] * (down[ids[t, slot]] @ (torch.nn.functional.silu(gate) * up))
            rows.append(row)
        return torch.stack(rows).reshape(1, 5, 32)

    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    expected = hand_written(*leaves)
    expected_grads = torch.autograd.grad((expected * direction).sum(), leaves)
    # float64 everywhere but the router's softmax, which Qwen3-MoE takes in float32 (relative error ~6e-8, 1e-6 here)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    assert grads[0].abs().sum() > 0  # the router learns through the replayed experts' gate weights


def _grouped_batch():
    """Two prompts (left-padded) with two completions each (right-padded), one completion fully masked; routes
    `(B, P + C, 2, 2)` whose first expert id is the token's id, -1 at padding, the second prompt's second copy
    recorded with other experts (+50 in the second slot) than its first."""
    prompt_ids = torch.tensor([[0, 11, 12], [0, 11, 12], [21, 22, 23], [21, 22, 23]])
    completion_ids = torch.tensor([[13, 14, 0], [15, 0, 0], [24, 25, 26], [27, 28, 0]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    prompt_mask = (prompt_ids != 0).long()
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1).bool()
    routes = ids[..., None, None].repeat(1, 1, 2, 2).to(torch.int16)
    routes[..., 1] += 1
    routes[3, :3, 1, 1] += 50  # row 3's prompt: another route than row 2's, in the last layer
    routes[~mask] = -1
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids)
    return {**batch, "completion_mask": completion_mask}, routes


@pytest.mark.parametrize("mode", ["padding_free", "shared_prefix"])
def test_packed_layouts_and_sp_shards_replay_each_tokens_route(mode):
    """A packed row replays at each position the route of the token it forwards (`grid_position`): under
    `"shared_prefix"` a shared prompt position replays its first row's route, and the other rows' differing routes
    are counted; `routes_from_layout` gives every forwarded token its position's route; under sequence parallelism
    each rank replays the routes of exactly the tokens of its shard (`routed_forward`, as `sp_shard_inputs` splits
    the row), -1 on the SP padding."""
    from hf_rlloss.trainer.common.packing import LAYOUT_BUILDERS
    from hf_rlloss.trainer.common.routing_replay import routed_forward, set_batch_routes, shared_route_counts
    from hf_rlloss.trainer.common.sp_batch import SPMicroBatch

    batch, routes = _grouped_batch()
    layout = LAYOUT_BUILDERS[mode](
        batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"]
    )
    rows = layout_routes(routes, layout)  # (N, 2, 2)
    assert torch.equal(rows[:, 0, 0].long(), layout.input_ids[0])  # each position: its own token's route
    assert torch.equal(rows[:, 0, 1].long(), layout.input_ids[0] + 1)
    own_prompt_route = int((rows[:, 1, 1] >= 50 + 21).sum())  # row 3's prompt route (its second layer, slot 1)
    shared, differing = shared_route_counts(routes, layout)
    if mode == "shared_prefix":
        # its shared prompt tokens replay row 2's, which comes first; its last prompt token is a position of its own
        # (TRL's trie forks a token before the sequences differ: the first completion tokens differ here)
        assert own_prompt_route == 1
        assert layout.forwarded_tokens < int(torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).sum())
        # rows 1 and 3 share their prompts with rows 0 and 2 (the last prompt token too when the first completion
        # tokens agree; here they differ): 1 + 2 tokens, of which row 3's 2 recorded another route
        assert (shared, differing) == (3, 2)
    else:
        assert own_prompt_route == 3 and (shared, differing) == (0, 0)  # each row forwards its own prompt
    back = routes_from_layout(rows, layout, tuple(routes.shape[:2]))
    forwarded = layout.grid_position >= 0
    assert torch.equal(
        back[forwarded][:, 0, 0].long(), torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)[forwarded]
    )
    assert (back[~forwarded] == -1).all()
    set_batch_routes(batch, routes)
    for size in (2, 3):
        for rank in range(size):
            mesh = FakeSPMesh(size, rank)
            shard = SPMicroBatch.from_layout(layout, mesh, 0).input_ids[0]  # (N_local,)
            replay = RoutingReplay()
            with routed_forward(replay, batch, layout, sp_mesh=mesh):
                targets = replay.targets
            real = targets[:, 0, 0] >= 0
            assert targets.shape[0] == shard.shape[0]
            assert torch.equal(targets[real, 0, 0].long(), shard[real])
            padding = (rank + 1) * shard.shape[0] - layout.forwarded_tokens  # the SP padding at the row's end
            assert int((~real).sum()) == max(0, min(padding, shard.shape[0]))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("HF_RLLOSS_FULL_MATRIX") != "1", reason="2 SP processes (~110 s): set HF_RLLOSS_FULL_MATRIX=1"
)
def test_sequence_parallel_old_policy_replay_matches_one_process(tmp_path):
    """`routing_replay="old_policy"` on a tiny Qwen3-MoE with sequence parallelism (sp=2, gloo, shared-prefix rows
    sharded over the group; `dist_trainer_sp_script.py`, case `moe:old_policy`): the π_old pass's routes gathered
    from the shards and the loss forward's replayed on them give one process's parameters and routing metrics; the
    off-policy second step replays experts the updated routers would not all have chosen. `"rollout"` with HF
    generate on both ranks replays the sampler's routes on the shards: π_old matches the sampler."""
    import _launch

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_trainer_sp_script.py")
    results = {}
    for name, procs, sp, per_device, per_eval, cases in (
        ("one", 1, 1, 4, 8, ["moe:old_policy"]),
        ("sp2", 2, 2, 4, 4, ["moe:old_policy", "moe:rollout"]),
    ):
        out = tmp_path / f"{name}.pt"
        cmd = [*_launch.torchrun(procs), script, "--out", str(out), "--sp", str(sp), "--per-device-batch-size",
               str(per_device), "--eval-batch-size", str(per_eval), "--cases", *cases]  # fmt: skip
        result = _launch.run(cmd, timeout=480, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-6000:]
        results[name] = torch.load(out, weights_only=False)["cases"]
    one, sp2 = results["one"]["moe:old_policy"], results["sp2"]["moe:old_policy"]
    # float32 round-off of the Ulysses all-to-alls and of the sharded packed row: 1e-5 as the other SP parity tests
    diff = max((one["params"][k] - sp2["params"][k]).abs().max().item() for k in one["params"])
    assert diff < 1e-5, diff
    steps = [[h for h in run["history"] if "loss/total" in h] for run in (one, sp2)]
    assert len(steps[0]) == len(steps[1]) == 2
    for a, b in zip(*steps):
        for key in ("routing/disagreement", "routing/replayed_tokens", "loss/total"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
        assert a["routing/replayed_tokens"] > 0
    assert steps[0][0]["routing/disagreement"] == 0.0 and steps[0][1]["routing/disagreement"] > 0.0
    # "rollout" under SP: each rank's HF generate recorded its rows' routes, pooled over the group; π_old replaying
    # them on the shards matches the (fp32) sampler to round-off (see test_trainer_rollout_replay_*)
    for log in [h for h in results["sp2"]["moe:rollout"]["history"] if "loss/total" in h]:
        assert log["mismatch/mismatch_logprob_abs_diff"] < 1e-5 and log["routing/replayed_tokens"] > 0


def _trainer(tok, tmp_path, model, **options):
    args = RLLossGRPOConfig(
        output_dir=str(tmp_path),
        **{**BASE_ARGS, "max_steps": 2, "activation_checkpointing": True, "rl_loss": {"rollout_is": {}}, **options},
    )
    prompts = Dataset.from_dict({"prompt": [p * (1 + i % 3) for i, p in enumerate(["Q: add 1+2 ="] * 16)]})
    return RLLossGRPOTrainer(model, [reward_length], args=args, train_dataset=prompts, processing_class=tok)


def test_trainer_rollout_replay_equals_the_recorded_logprobs(tok, tmp_path):
    """`routing_replay="rollout"` in the trainer (HF generate, fp32, left-padded prompts of three lengths, packed
    with shared prompts, activation checkpointing): π_old replays the sampler's routes, so the rollout mismatch is
    float round-off, every token but the last generated one is replayed, and the loss forwards agree with the
    sampler."""
    trainer = _trainer(tok, tmp_path, tiny_moe(tok, "qwen3_moe"), routing_replay="rollout", packing="shared_prefix")
    assert trainer._packing == "shared_prefix"  # a shared prompt position replays its first row's routes
    trainer.train()
    logs = [h for h in trainer.state.log_history if "routing/disagreement" in h]
    assert len(logs) == 2
    for log in logs:
        assert log["mismatch/mismatch_logprob_abs_diff"] < 1e-5  # fp32 round-off (see the first test)
        assert log["routing/disagreement"] == 0.0  # on-policy, same precision: the trainer would route alike
        # 4 completions of 8 tokens (none ends early: no EOS is likely from a random model), each row's last one
        # without a route, plus the prompts
        assert log["routing/replayed_tokens"] >= 4 * 7
        # the G copies of a prompt were routed alike during generation (the same rows of one fp32 prefill)
        assert log["routing/shared_tokens_differing"] == 0.0


def test_trainer_old_policy_replays_the_pi_old_routes(tok, tmp_path):
    """`routing_replay="old_policy"` (R2) with 2 iterations per generation: every router call of a loss forward —
    and of its recomputation under activation checkpointing — routes through the experts the π_old pass chose, also
    after an update, when the policy's own routing has moved (`routing/disagreement` > 0)."""
    trainer = _trainer(
        tok, tmp_path, tiny_moe(tok, "qwen3_moe"), routing_replay="old_policy", num_iterations=2, learning_rate=3e-2
    )
    routers = [router for router, _ in find_routers(trainer.model)]
    seen = {"old": [[], []], "loss": [[], []]}  # per layer, each call's (N, k) ids

    def spy(router, args, output):  # generation routes live; the π_old pass records; the loss forwards replay
        state = trainer._routing.state
        if state != "live":
            seen["old" if state == "record" else "loss"][routers.index(router)].append(output[2].clone())

    handles = [r.register_forward_hook(spy) for r in routers]  # registered after the replay hook: sees its output
    trainer.train()
    for handle in handles:
        handle.remove()
    # one π_old pass (2 layers, one forward of 4 rows), then 2 loss steps each a forward and a recomputation
    assert [len(calls) for calls in seen["old"]] == [1, 1] and [len(calls) for calls in seen["loss"]] == [4, 4]

    def token_routes(layers):  # (N, k) per layer -> each token's route over all layers, as sorted codes (N,)
        # TRL shuffles the generation batch's rows before the loss steps: compare the multisets of token routes
        codes = torch.cat([ids.long() for ids in layers], dim=1) @ (8 ** torch.arange(2 * 2))
        return codes.sort().values

    old = token_routes([calls[0] for calls in seen["old"]])
    for i in range(4):  # each forward and recomputation (the backward recomputes the layers in reverse order)
        assert torch.equal(token_routes([calls[i] for calls in seen["loss"]]), old), i
    logs = [h for h in trainer.state.log_history if "routing/disagreement" in h]
    assert logs[0]["routing/disagreement"] == 0.0 and logs[1]["routing/disagreement"] > 0.0


def _loss_forward_routes(trainer) -> list[dict]:
    """Spy on the loss forwards (`count=True`) of `trainer`: per forward its batch's `(B, P + C)` attention mask and,
    per MoE layer, the router's own top-k (seen before the replay hook) and the experts it hands on (seen after)."""
    forwards, hidden_states = [], trainer._completion_hidden_states
    routers = [router for router, _ in find_routers(trainer.model)]

    def completion_hidden_states(unwrapped, batch, output_router_logits=False, count=False):
        if count:
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            forwards.append({"mask": mask.bool(), "live": {}, "replayed": {}})
        return hidden_states(unwrapped, batch, output_router_logits, count)

    def spy(key):
        def hook(router, args, output):
            if trainer._routing.counting:
                forwards[-1][key][routers.index(router)] = output[2].clone()

        return hook

    trainer._completion_hidden_states = completion_hidden_states
    for router in routers:
        router.register_forward_hook(spy("live"), prepend=True)
        router.register_forward_hook(spy("replayed"))
    return forwards


def _independent_routing_metrics(forward: dict, packing: str) -> tuple[int, float]:
    """`(replayed tokens, disagreement)` of one loss forward: over its real tokens with a route, the fraction of
    replayed experts not among the router's own top-k. A padded forward routes every position of the batch, padding
    included; a packed row forwards the real tokens only."""
    replayed, live = forward["replayed"], forward["live"]
    rows = replayed[0].shape[0]
    mask = forward["mask"].reshape(-1)
    real = mask if packing == "off" else torch.ones(rows, dtype=torch.bool)
    assert real.shape[0] == rows and (packing == "off" or rows <= int(mask.sum()))
    decisions = differing = 0
    for layer in replayed:
        ids, own = replayed[layer][real], live[layer][real]
        decisions += ids.numel()
        differing += sum(len(set(a.tolist()) - set(b.tolist())) for a, b in zip(ids, own))
    return int(real.sum()), differing / decisions


@pytest.mark.parametrize("packing", ["off", "padding_free", "shared_prefix"])
def test_routing_metrics_count_the_real_tokens_only(tok, tmp_path, packing):
    """`routing/replayed_tokens` and `routing/disagreement` count the real (attention-mask) tokens of the loss
    forwards only, in every packing layout: `routing_replay="old_policy"` (2 iterations, a large learning rate so
    that the second step's routing moves) on micro-batches of two prompts of different lengths (left padding),
    checked against a count from the routers' own top-k and the replayed experts. Under `packing="off"` the padded
    forward routes the padding too, and the π_old pass recorded a route there: it is replayed but not counted."""
    dataset = Dataset.from_dict({"prompt": [f"Q{i:02d}: add" + " 1" * (2 * i) for i in range(16)]})  # 16 lengths
    args = RLLossGRPOConfig(
        output_dir=str(tmp_path), routing_replay="old_policy", packing=packing, num_iterations=2,
        **{**BASE_ARGS, "max_steps": 2, "num_generations": 2, "learning_rate": 3e-2},
    )  # fmt: skip
    trainer = RLLossGRPOTrainer(
        tiny_moe(tok, "qwen3_moe"), [reward_length], args=args, train_dataset=dataset, processing_class=tok
    )
    assert trainer._packing == packing
    forwards = _loss_forward_routes(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "routing/disagreement" in h]
    assert len(forwards) == len(logs) == 2  # one micro-batch per step
    assert all(not forward["mask"].all() for forward in forwards)  # left padding: the prompts' lengths differ
    for forward, log in zip(forwards, logs):
        tokens, disagreement = _independent_routing_metrics(forward, packing)
        assert log["routing/replayed_tokens"] == tokens
        assert log["routing/disagreement"] == pytest.approx(disagreement, abs=1e-6)
    assert logs[1]["routing/disagreement"] > 0.0  # the update moved the routers: a vacuous comparison otherwise


def _reward_constant_for_odd(prompts, completions, **kwargs):
    """The completion's length, except one reward for every completion of the odd prompts `Q<n>: ...`."""
    return [0.5 if int(p[1 : p.index(":")]) % 2 else len(c) / 8.0 for p, c in zip(prompts, completions)]


def test_dynamic_sampling_replays_the_kept_rows_routes(tok, tmp_path):
    """`routing_replay="rollout"` with dynamic sampling (refill rounds of prompts of two lengths, the groups without
    signal dropped): every kept row's routes stay aligned with its tokens through the selection, the concatenation
    of rounds of other widths (prompts padded left, completions right, with -1) and the split into micro-batches: a
    route at every real token but the row's last generated one, none at padding, and π_old replaying them agrees with
    the sampler to float32 round-off (a route from another row would move it)."""
    dataset = Dataset.from_dict({"prompt": [f"Q{i:02d}: add" + " 1" * i for i in range(16)]})  # 16 lengths
    args = RLLossGRPOConfig(
        output_dir=str(tmp_path), routing_replay="rollout", dynamic_sampling=True, dynamic_sampling_max_rounds=4,
        **{**BASE_ARGS, "max_steps": 2, "gradient_accumulation_steps": 2, "rl_loss": {"rollout_is": {}}},
    )  # fmt: skip
    trainer = RLLossGRPOTrainer(
        tiny_moe(tok, "qwen3_moe"), [_reward_constant_for_odd], args=args, train_dataset=dataset,
        processing_class=tok,
    )  # fmt: skip
    seen, build, generate = [], trainer.build_loss_context, trainer._generate_and_score_completions
    widths = []  # each round's prompt width

    def generating(inputs):
        batch = generate(inputs)
        widths.append(batch["prompt_ids"].shape[1])
        return batch

    trainer._generate_and_score_completions = generating

    def recording(inputs):
        seen.append({k: inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_mask")})
        seen[-1]["routes"] = get_batch_routes(inputs)
        return build(inputs)

    trainer.build_loss_context = recording
    trainer.train()
    logs = [h for h in trainer.state.log_history if "routing/disagreement" in h]
    rounds = [int(log["dynamic_sampling/rounds"]) for log in logs]
    steps = [widths[sum(rounds[:i]) : sum(rounds[: i + 1])] for i in range(len(rounds))]
    assert any(len(set(step)) > 1 for step in steps), steps  # a step concatenated rounds of other prompt widths
    for micro_batch in seen:
        mask = torch.cat([micro_batch["prompt_mask"], micro_batch["completion_mask"]], dim=1).bool()
        has = micro_batch["routes"][..., 0, 0] >= 0  # (B, P + C)
        assert not (has & ~mask).any()  # no route at padding
        last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)  # each row's last real token
        missing = mask & ~has
        assert (missing.sum(1) <= 1).all() and missing[torch.arange(mask.shape[0]), last].sum() == missing.sum()
    for log in logs:
        assert log["mismatch/mismatch_logprob_abs_diff"] < 1e-5  # fp32 round-off (see the first test)
        # the trainer's own fp32 routing in another layout (padding-free rows) flips a near-tied choice now and then
        # (1 of 672 decisions in one step here); routes of another row would disagree on most (about 0.7)
        assert log["routing/disagreement"] < 0.01


def test_a_batch_without_recorded_routes_is_routed_live_and_said(caplog):
    """Under `"rollout"`, a batch whose first HF generate call did not record every row's routes is routed live (the
    π_old pass, the reference and the loss), said in a warning."""
    import types

    from transformers.utils import logging

    from hf_rlloss.trainer.common.routing_replay import RoutingReplayTrainer

    route = torch.zeros(3, 2, 2, dtype=torch.int16)
    trainer = types.SimpleNamespace(_routing_mode="rollout", _routing_generated=[([route] * 2, [route] * 2)])
    logging.get_logger("hf_rlloss").warning_once.cache_clear()  # one cache for every logger of the process
    with caplog.at_level("WARNING"):
        assert RoutingReplayTrainer._routing_rollout_routes(trainer, 4, 3, 5) is None
    assert "recorded the routes of 2 rows, not of the batch's 4: that batch is routed live" in caplog.text


def test_refusals(tok, tmp_path):
    with pytest.raises(ValueError, match=r"routing_replay='never'; expected one of 'off', 'rollout', 'old_policy'"):
        RLLossGRPOConfig(output_dir=str(tmp_path), routing_replay="never")
    with pytest.raises(ValueError, match=r"routing_replay='rollout' is not supported with use_vllm"):
        RLLossGRPOConfig(output_dir=str(tmp_path), routing_replay="rollout", use_vllm=True)
    from _trainer_utils import make_model

    with pytest.raises(ValueError, match=r"routing_replay needs an MoE model .* Qwen2ForCausalLM has no router"):
        _trainer(tok, tmp_path, make_model(tok), routing_replay="rollout")
