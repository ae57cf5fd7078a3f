"""The gradient-fidelity diagnostic's step objective (`GradientFidelity.step_gradients`) is the trainer's: on the same
groups, its gradient equals the gradient `RLLossGRPOTrainer` steps with (its aggregation over the step's groups, its
KL term to the reference, TRL's reward scaling), for every `scale_rewards`."""

from __future__ import annotations

import copy

import pytest
import torch
from _trainer_utils import BASE_ARGS, FixedCompletions, make_dataset, make_model, make_tokenizer, reward_length
from transformers import TrainerCallback

from hf_rlloss.recipe_support.gradient_fidelity import (
    CORRECTIONS,
    GradientFidelity,
    Group,
    Settings,
    completion_logprobs,
)
from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer

torch.set_num_threads(1)
KL = 0.05  # large enough that leaving the KL term out changes the gradient beyond the tolerance


def _perturbed(model, seed: int, scale: float = 0.05):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other.eval()


class _Gradients(TrainerCallback):
    """The trainable parameters' gradients at the first optimizer step (no clipping: `max_grad_norm=0`)."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _trainer_step(tok, policy, behavior, reference, scale_rewards: str, tmp_path):
    """One optimizer step of `RLLossGRPOTrainer` over 2 groups of 4 fixed completions, sampled (as recorded
    log-probs) by `behavior`, KL to `reference`: its gradient, its batch and the rewards it scored."""
    fixed, rewards, batches = FixedCompletions(tok, 6), [], []

    def rollout_func(prompts, trainer):
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        completion_ids, _ = fixed(prompt_ids, None, None, len(prompts))
        logprobs = []
        for prompt, completion in zip(prompt_ids, completion_ids):
            group = Group(prompt, [completion], torch.zeros(1).numpy(), torch.zeros(1).numpy())
            with torch.no_grad():
                logprobs.append(completion_logprobs(behavior, group, tok.pad_token_id)[0].tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    def scored_length(completions, **kwargs):
        values = reward_length(completions, **kwargs)
        rewards.extend(values)
        return values

    class Recording(RLLossGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            batches.append(batch)
            return batch

    rl_loss = {**CORRECTIONS["token_tis"].rl_loss, "use_kl_loss": True, "kl_loss_type": "k3", "kl_loss_coef": KL}
    sizes = {"per_device_train_batch_size": 8, "max_completion_length": 6}
    args = RLLossGRPOConfig(
        output_dir=str(tmp_path / "out"), **{**BASE_ARGS, **sizes}, max_steps=1, max_grad_norm=0.0, temperature=1.0,
        scale_rewards=scale_rewards, rl_loss=rl_loss,
    )  # fmt: skip
    gradients = _Gradients()
    trainer = Recording(copy.deepcopy(policy), scored_length, args=args, train_dataset=make_dataset(),
                        processing_class=tok, rollout_func=rollout_func, callbacks=[gradients],
                        ref_model=reference)  # fmt: skip
    trainer.train()
    return gradients.grads, batches[0], rewards[:8]


def _groups(batch, rewards, tok) -> list[Group]:
    """The trainer's batch as the diagnostic's groups: each prompt's 4 completions, rewards, sampler log-probs."""
    groups = []
    for k in range(2):
        rows = range(4 * k, 4 * k + 4)
        prompt = batch["prompt_ids"][rows[0]][batch["prompt_mask"][rows[0]].bool()].tolist()
        lengths = [int(batch["completion_mask"][i].sum()) for i in rows]
        completions = [batch["completion_ids"][i, :n].tolist() for i, n in zip(rows, lengths)]
        width = max(lengths)
        behavior = batch["sampling_per_token_logps"][list(rows), :width].float()
        behavior = torch.where(torch.arange(width) < torch.tensor(lengths)[:, None], behavior, 0.0)
        groups.append(Group(prompt, completions, torch.tensor(rewards[4 * k : 4 * k + 4]).double().numpy(),
                            torch.zeros(4).numpy(), behavior))  # fmt: skip
    return groups


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_step_gradients_equal_the_trainers_gradient_with_kl_and_reward_scaling(tmp_path, scale_rewards):
    tok = make_tokenizer()
    policy = make_model(tok, seed=0).eval()
    behavior, reference = _perturbed(policy, 1), _perturbed(policy, 2)
    trained, batch, rewards = _trainer_step(tok, policy, behavior, reference, scale_rewards, tmp_path)
    groups = _groups(batch, rewards, tok)
    assert len({tuple(g.rewards) for g in groups}) == 2 and all(len(set(g.rewards)) > 1 for g in groups)

    settings = Settings(corrections={"token_tis": CORRECTIONS["token_tis"]}, scale_rewards=scale_rewards,
                        kl_loss_coef=KL)  # fmt: skip
    fidelity = GradientFidelity(copy.deepcopy(policy), tok, [reward_length], settings, reference=reference)
    names = [n for n, p in fidelity.policy.named_parameters() if p.requires_grad]
    mine = fidelity.step_gradients(groups, ["token_tis"], sketch=False)[0]["token_tis"]
    for name, grad in zip(names, mine):
        torch.testing.assert_close(grad, trained[name], rtol=1e-4, atol=1e-7, msg=name)

    # what each piece of the trainer's objective weighs: without it the gradient differs beyond the tolerance
    def differs(**change) -> bool:
        other = Settings(**{**settings.__dict__, **change})
        diagnostic = GradientFidelity(copy.deepcopy(policy), tok, [reward_length], other, reference=reference)
        theirs = diagnostic.step_gradients(groups, ["token_tis"], sketch=False)[0]["token_tis"]
        return any(not torch.allclose(a, trained[n], rtol=1e-4, atol=1e-7) for n, a in zip(names, theirs))

    assert differs(kl_loss_coef=0.0)
    assert differs(scale_rewards={"group": "none", "batch": "group", "none": "group"}[scale_rewards])


def test_per_group_estimates_take_each_groups_token_mean_where_the_step_takes_the_steps():
    """The per-prompt estimates (`gradients`, the diagnostic's statistics) are each group's own token mean; the sum of
    two groups' estimates weighted by their token counts over the step's equals the step objective's gradient."""
    tok = make_tokenizer()
    policy = make_model(tok, seed=0).eval()
    behavior = _perturbed(policy, 1)
    settings = Settings(corrections={"none": CORRECTIONS["none"]}, sketch_dim=64)
    fidelity = GradientFidelity(policy, tok, [reward_length], settings)
    fixed = FixedCompletions(tok, 6)
    groups = []
    for prompt in make_dataset(2)["prompt"]:
        prompt_ids = tok(prompt)["input_ids"]
        completions, _ = fixed([prompt_ids] * 4, None, None, 4)
        group = Group(prompt_ids, completions, torch.tensor([len(c) / 8 for c in completions]).double().numpy(),
                      torch.zeros(4).numpy())  # fmt: skip
        with torch.no_grad():
            group.behavior_logprobs = completion_logprobs(behavior, group, tok.pad_token_id)
        from hf_rlloss.recipe_support.gradient_fidelity import step_advantages

        group.advantages = step_advantages([group.rewards])[0]
        groups.append(group)
    tokens = torch.tensor([sum(len(c) for c in g.completions) for g in groups], dtype=torch.float64)
    per_group = [fidelity.gradients(g, ["none"])[0]["none"] for g in groups]
    weighted = sum(t / tokens.sum() * v for t, v in zip(tokens, per_group))
    step = fidelity.step_gradients(groups, ["none"])[0]["none"]
    torch.testing.assert_close(step, weighted, rtol=1e-4, atol=1e-7)  # float32 gradients
    assert not torch.allclose(step, sum(per_group) / 2, rtol=1e-3)  # the per-group mean is another objective
