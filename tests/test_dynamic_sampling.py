"""Dynamic sampling (`RLLossGRPOConfig.dynamic_sampling`): the keep/fill functions in closed form, and the trainer
with a reward that is constant for chosen prompts (their groups have zero variance)."""

from __future__ import annotations

import os

import _launch
import pytest
import torch
from _trainer_utils import (
    BASE_ARGS,
    StatelessCompletions,
    is_constant_prompt,
    make_dataset,
    make_model,
    make_tokenizer,
    reward_length_or_constant,
    trainable_snapshot,
)

from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer
from hf_rlloss.trainer.sync.dynamic_sampling import (
    RefillPrompts,
    balanced_sizes,
    concat_rows,
    groups_with_signal,
    replica_rows,
    select_groups,
    split_rows,
)

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
NAN = float("nan")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


# ------------------------------------------------------------------------------------------------------------------
# The pure functions


def test_groups_with_signal_closed_form():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 2.0, 2.0, NAN, 3.0, NAN, NAN])  # groups of 3
    assert groups_with_signal(rewards[:12], 3).tolist() == [False, True, False, False]
    # std over the scorable rewards only: [1, NaN, 2] has signal; [NaN, NaN, 5] has one scorable reward: none
    assert groups_with_signal(torch.tensor([1.0, NAN, 2.0, NAN, NAN, 5.0]), 3).tolist() == [True, False]
    assert groups_with_signal(torch.tensor([0.3, 0.3 + 1e-9]), 2).tolist() == [False]  # TRL's isclose test
    with pytest.raises(ValueError, match="groups of 4"):
        groups_with_signal(torch.zeros(6), 4)


def test_select_groups_takes_the_first_target_in_generation_order():
    signal = torch.tensor([[True, False, True], [True, True, False], [False, True, True]])
    assert select_groups(signal, 3).tolist() == [[True, False, True], [True, False, False], [False, False, False]]
    assert select_groups(signal, 10).tolist() == signal.tolist()  # fewer than the target: all of them
    assert not select_groups(torch.zeros(2, 3, dtype=torch.bool), 3).any()


def test_balanced_sizes_and_replica_rows():
    assert balanced_sizes(7, 3) == [3, 2, 2]
    assert balanced_sizes(2, 4) == [1, 1, 0, 0]
    assert sum(balanced_sizes(13, 5)) == 13
    groups = torch.tensor([True, False, True])  # G = 2: rows 0-1 kept, 2-3 dropped, 4-5 kept
    assert replica_rows(groups, 2, 0, 1).tolist() == [True, True, False, False, True, True]
    # 3 replicas of 2 rows; with G = 4 (2 groups, 8 rows) over 2 replicas a group spans both
    assert replica_rows(groups, 2, 1, 3).tolist() == [False, False]
    assert replica_rows(torch.tensor([True, False]), 4, 0, 4).tolist() == [True, True]
    assert replica_rows(torch.tensor([True, False]), 4, 1, 4).tolist() == [True, True]
    assert replica_rows(torch.tensor([True, False]), 4, 2, 4).tolist() == [False, False]


def test_concat_and_split_rows_pad_prompts_left_and_completions_right():
    a = {"prompt_ids": torch.tensor([[5, 6]]), "completion_ids": torch.tensor([[7]]), "n": torch.tensor(3)}
    b = {"prompt_ids": torch.tensor([[8]]), "completion_ids": torch.tensor([[9, 10, 11]]), "n": torch.tensor(4)}
    out = concat_rows([a, b], pad_token_id=0)
    assert out["prompt_ids"].tolist() == [[5, 6], [0, 8]]
    assert out["completion_ids"].tolist() == [[7, 0, 0], [9, 10, 11]]
    assert out["n"].item() == 3  # 0-dim values: the first batch's
    parts = split_rows(out, [2, 0])
    assert parts[0]["prompt_ids"].shape == (2, 2) and parts[1]["prompt_ids"].shape == (0, 2)


def test_refill_prompts_shard_one_stream_over_ranks():
    dataset = [{"prompt": i} for i in range(6)]
    one = RefillPrompts(dataset, group_size=2, target=2, rank=0, world_size=1, shuffle=True, seed=0)
    two = [RefillPrompts(dataset, group_size=2, target=2, rank=r, world_size=2, shuffle=True, seed=0) for r in (0, 1)]
    for _ in range(5):  # more than a pass: the stream goes on with a new permutation
        batch = next(one)
        assert len(batch) == 4 and batch[0] == batch[1] and batch[2] == batch[3]  # each prompt G times
        assert batch == next(two[0]) + next(two[1])
    with pytest.raises(ValueError, match="only 6"):
        RefillPrompts(dataset, group_size=2, target=8, rank=0, world_size=1, shuffle=True, seed=0)


@pytest.mark.parametrize("rounds", [0, -1, True, 1.5])
def test_max_rounds_is_validated(tmp_path, rounds):
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds=.* must be an integer >= 1"):
        RLLossGRPOConfig(output_dir=str(tmp_path), **BASE_ARGS, dynamic_sampling_max_rounds=rounds)


# ------------------------------------------------------------------------------------------------------------------
# The trainer


def _train(tok, tmp_path, reward=reward_length_or_constant, steps: int = 3, **overrides):
    """Train on `make_dataset()` with stateless fixed completions and `reward`; record every micro-batch the loss
    sees (`build_loss_context`). Returns the trainer, its parameters after training and the micro-batches."""
    options = {
        **BASE_ARGS,
        "max_steps": steps,
        "gradient_accumulation_steps": 2,
        "optim": "sgd",
        "learning_rate": 0.05,
        "dynamic_sampling": True,
        "rl_loss": {"policy_loss_cfg": {"loss_type": "vanilla"}},
        **overrides,
    }
    args = RLLossGRPOConfig(output_dir=str(tmp_path / "out"), **options)
    trainer = RLLossGRPOTrainer(
        make_model(tok), [reward], args=args, train_dataset=make_dataset(), processing_class=tok
    )
    trainer._generate_single_turn = StatelessCompletions(tok, trainer.max_completion_length)
    seen = []
    build = trainer.build_loss_context

    def recording(inputs):
        seen.append({k: inputs[k] for k in ("prompt_ids", "completion_mask", "advantages")})
        return build(inputs)

    trainer.build_loss_context = recording
    trainer.train()
    return trainer, trainable_snapshot(trainer.model), seen


def _prompts(tok, micro_batch) -> list[str]:
    return tok.batch_decode(micro_batch["prompt_ids"], skip_special_tokens=True)


def _step_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss/total" in h]


def test_no_zero_variance_group_reaches_the_loss(tok, tmp_path):
    trainer, _, seen = _train(tok, tmp_path, steps=4, dynamic_sampling_max_rounds=4)
    generation = trainer.args.generation_batch_size  # 8 completions: 2 groups of 4
    assert len(seen) == 4 * 2  # GA 2: two micro-batches per step
    for step in range(4):
        micro_batches = seen[2 * step : 2 * step + 2]
        prompts = [p for mb in micro_batches for p in _prompts(tok, mb)]
        assert len(prompts) == generation  # the batch is full again
        assert not any(is_constant_prompt(p) for p in prompts), prompts
        # every kept group is whole: its 4 completions are all in the step
        assert all(prompts.count(p) == 4 for p in prompts)
        # and the loss counts exactly the trained rows' tokens (global normalization over the step)
        tokens = sum(int(mb["completion_mask"].sum()) for mb in micro_batches)
        assert _step_logs(trainer)[step]["train_policy/valid_tokens"] == tokens
    logs = _step_logs(trainer)
    assert all(log["dynamic_sampling/groups_kept"] == 2 and log["dynamic_sampling/starved"] == 0 for log in logs)
    rounds = [log["dynamic_sampling/rounds"] for log in logs]
    assert all(1 <= r <= 4 for r in rounds) and max(rounds) > 1  # 6 of 16 prompts are constant: refills happen
    generated = [log["dynamic_sampling/groups_generated"] for log in logs]
    assert generated == [2 * r for r in rounds]
    consumed = [log["dynamic_sampling/prompts_consumed"] for log in logs]
    assert consumed == [sum(generated[: i + 1]) for i in range(4)]
    # TRL logs the reward and frac_reward_zero_std of every generated completion (all rounds), not only those kept
    assert any(log["frac_reward_zero_std"] > 0 for log in logs)


def test_short_batch_is_normalized_over_the_step_whatever_the_micro_batches(tok, tmp_path):
    """One round: the constant groups are dropped and the step is short (4 rows instead of 8 for some steps). Cut
    into 2 micro-batches (GA 2) or trained as one (GA 1, the same generation batch), the update is the same."""
    split, params_split, seen = _train(tok, tmp_path / "a", steps=3, dynamic_sampling_max_rounds=1)
    rows = [sum(mb["prompt_ids"].shape[0] for mb in seen[2 * s : 2 * s + 2]) for s in range(3)]
    kept = [log["dynamic_sampling/groups_kept"] for log in _step_logs(split)]
    assert rows == [4 * k if k else 8 for k in kept] and 1 in kept, (rows, kept)  # a short step happened
    whole, params_whole, _ = _train(
        tok, tmp_path / "b", steps=3, dynamic_sampling_max_rounds=1, gradient_accumulation_steps=1,
        per_device_train_batch_size=8,
    )  # fmt: skip
    assert [log["dynamic_sampling/groups_kept"] for log in _step_logs(whole)] == kept
    diff = max((params_split[k] - params_whole[k]).abs().max().item() for k in params_split)
    assert diff < 1e-6, diff


def _constant(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def test_every_group_zero_variance_for_max_rounds_still_completes_the_step(tok, tmp_path):
    trainer, _, seen = _train(tok, tmp_path, reward=_constant, steps=2, dynamic_sampling_max_rounds=3)
    logs = _step_logs(trainer)
    assert trainer.state.global_step == 2 and len(logs) == 2
    for log in logs:
        assert log["dynamic_sampling/rounds"] == 3 and log["dynamic_sampling/groups_generated"] == 6
        assert log["dynamic_sampling/groups_kept"] == 0 and log["dynamic_sampling/starved"] == 1
        assert log["frac_reward_zero_std"] == 1.0
    # the step trained on the last round as it is: zero advantages, no policy gradient
    assert all(float(mb["advantages"].abs().max()) == 0.0 for mb in seen)
    assert sum(mb["prompt_ids"].shape[0] for mb in seen[:2]) == trainer.args.generation_batch_size


def test_off_changes_nothing(tok, tmp_path):
    """dynamic_sampling=False: the same update as before the option existed (the default path), and no metric."""
    on, params_on, _ = _train(tok, tmp_path / "on", reward=_constant, steps=1, dynamic_sampling_max_rounds=1)
    off, params_off, _ = _train(tok, tmp_path / "off", reward=_constant, steps=1, dynamic_sampling=False)
    assert not any(k.startswith("dynamic_sampling/") for k in _step_logs(off)[0])
    # one round, nothing kept: the starved step trains on the generation batch as it is, as without the option
    assert _step_logs(on)[0]["dynamic_sampling/starved"] == 1
    assert max((params_on[k] - params_off[k]).abs().max().item() for k in params_on) < 1e-6


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    """2 ranks × 2 sequences × GA 2 == 1 rank × 4 sequences × GA 2 with dynamic sampling (refills, short steps)."""
    script = os.path.join(HERE, "dist_trainer_script.py")
    results = []
    for nproc, batch_size in ((1, 4), (2, 2)):
        out = tmp_path / f"{nproc}proc.pt"
        cmd = [*_launch.torchrun(nproc), script, "--per-device-batch-size", str(batch_size)]
        cmd += ["--steps", "3", "--dynamic-sampling-max-rounds", "2", "--out", str(out)]
        result = _launch.run(cmd, timeout=300, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        results.append(torch.load(out))
    one, two = results
    assert one["world_size"] == 1 and two["world_size"] == 2
    kept = [h["dynamic_sampling/groups_kept"] for h in one["history"] if "dynamic_sampling/groups_kept" in h]
    assert kept == [h["dynamic_sampling/groups_kept"] for h in two["history"] if "dynamic_sampling/groups_kept" in h]
    assert len(kept) == 3 and any(h.get("dynamic_sampling/rounds", 1) > 1 for h in one["history"])  # refills
    diff = max((one["params"][k] - two["params"][k]).abs().max().item() for k in one["params"])
    assert diff < 1e-5, diff
    for a, b in zip(one["history"], two["history"]):
        if "loss/total" in a:
            assert a["train_policy/valid_tokens"] == b["train_policy/valid_tokens"]
            assert abs(a["loss/total"] - b["loss/total"]) < 1e-5
