"""Gradient fidelity: how far each stale-sample correction's gradient is from the on-policy gradient.

A correction for stale samples (rollout IS, a clip against the sampler, masks) promises something mechanical: with
samples from a behaviour policy μ some versions older than the current policy θ, the corrected gradient is closer to
the gradient θ would get from its own samples. This module measures that, on a user's own model and task:

1. for each prompt, it samples four groups of `G` completions from θ (the on-policy estimates, and the noise floor)
   and two from each behaviour policy (an earlier checkpoint, or recorded samples with their log-probs);
2. it scores them with the reward functions and computes group advantages as the trainers do (TRL's rule);
3. for each correction, given as an `rl_loss` configuration, it computes that estimator's gradient at θ **through the
   loss layer itself** (`GRPOLossConfig.build`, `compute_rollout_is`, `build_batches`, the loss call), with
   `old_logprobs = log π_θ` (one optimizer step per batch; log μ for the clip against the sampler) and
   `rollout_logprobs = log μ`, and sketches it (`CountSketch`);
4. it reports, per correction, with bootstrap intervals over prompts: the relative bias ‖E ĝ − g_on‖ / ‖g_on‖, the
   cosine to the on-policy gradient, the variance per group, the relative MSE at the trainer's batch, and the
   effective sample size of the IS weights, next to the noise floor (`hf_rlloss.recipe_support.fidelity_stats`).

`hf-rlloss-gradient-fidelity --policy CURRENT --behavior 8=OLDER` runs it from the command line; docs/staleness.md
("Is my run too stale?") reads its output.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ..loss.config import GRPOLossConfig
from ..loss.grpo_context import GRPOLossContext
from ..trainer.common.advantages import group_advantages, nanstd
from ..trainer.common.sampling import generate_and_cut
from .fidelity_stats import (
    DROP,
    FLOOR,
    drop_terms,
    fidelity_statistics,
    floor_terms,
    holm,
    prompt_terms,
    zero_advantage_bias_share,
)
from .grad_sketch import CountSketch

IGNORE = -100


@dataclass(frozen=True)
class Correction:
    """One way of training on stale samples, as the diagnostic applies it.

    Args:
        rl_loss (`dict`): the `rl_loss` configuration (`GRPOLossConfig` fields).
        old_policy (`str`, *optional*, defaults to `"current"`): π_old of the loss: `"current"` (recomputed by the
            trainer: the policy the gradient is taken at) or `"behavior"` (the sampler's log-probs, as TRL's
            `AsyncGRPOTrainer` clips against them).
        invert_weights (`bool`, *optional*, defaults to `False`): give the loss `2 log π_θ − log μ` as the rollout
            log-probs, so that its IS weights are μ/π instead of π/μ: the control that must come out worse.
        description (`str`, *optional*): what it is, for reports.
    """

    rl_loss: dict
    old_policy: Literal["current", "behavior"] = "current"
    invert_weights: bool = False
    description: str = ""


POLICY_LOSS = {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28}  # the demos' policy loss


def _loss(**extra: Any) -> dict:
    return {"policy_loss_cfg": POLICY_LOSS, "loss_agg_mode": "token-mean", **extra}


_TIS = {"level": "token", "mode": "truncate", "upper": 2.0}
CORRECTIONS: dict[str, Correction] = {
    "none": Correction(_loss(), description="B: π_old recomputed, no IS"),
    "sampler_clip": Correction(_loss(), "behavior", description="A: clip against the sampler (TRL's async trainer)"),
    "token_tis": Correction(_loss(rollout_is=_TIS), description="C: token IS truncated at 2 (the async default)"),
    "sequence_tis": Correction(_loss(rollout_is={**_TIS, "level": "sequence"}), description="sequence IS, at 2"),
    "geometric_tis": Correction(_loss(rollout_is={**_TIS, "level": "geometric"}), description="geometric IS, at 2"),
    "token_mis": Correction(
        _loss(rollout_is={"level": "token", "mode": "mask", "upper": 2.0}), description="token IS masked to [½, 2]"
    ),
    "veto": Correction(_loss(rollout_is={**_TIS, "veto_lower": 1e-4}), description="token IS at 2, veto below 1e-4"),
    "opsm": Correction(_loss(off_policy_mask_threshold=0.5), description="OPSM at 0.5 (TRL's example), no IS"),
    "m2po": Correction(
        _loss(rollout_is={"level": "token", "upper": 1000.0, "m2_threshold": 0.04}),
        description="M2PO: second moment ≤ 0.04, untruncated token IS",
    ),
    "inverted_tis": Correction(
        _loss(rollout_is=_TIS), invert_weights=True, description="control: token IS with μ/π weights"
    ),
}
"""The corrections measured by default, by name."""


@dataclass
class Group:
    """One prompt's `G` completions, their advantages and, for a stale group, the behaviour log-probs.

    Args:
        prompt_ids (`list[int]`): the prompt's token ids.
        completions (`list[list[int]]`): each completion's token ids (up to and including its EOS).
        rewards (`np.ndarray`): `(G,)` summed rewards (NaN where every reward function skipped).
        advantages (`np.ndarray`): `(G,)` group advantages.
        behavior_logprobs (`torch.Tensor`, *optional*): `(G, T)` log μ of the completion tokens, right-padded.
    """

    prompt_ids: list[int]
    completions: list[list[int]]
    rewards: np.ndarray
    advantages: np.ndarray
    behavior_logprobs: torch.Tensor | None = None

    def batch(self, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`input_ids` `(G, Lp + T)`, `attention_mask` `(G, Lp + T)` and the completions' `labels` `(G, T)`."""
        width = max(len(c) for c in self.completions)
        rows = [self.prompt_ids + c + [pad_token_id] * (width - len(c)) for c in self.completions]
        mask = [[1] * (len(self.prompt_ids) + len(c)) + [0] * (width - len(c)) for c in self.completions]
        labels = [c + [IGNORE] * (width - len(c)) for c in self.completions]
        return torch.tensor(rows), torch.tensor(mask), torch.tensor(labels)


def completion_logprobs(model: Any, group: Group, pad_token_id: int) -> torch.Tensor:
    """`(G, T)` log-probs of the completion tokens under `model` (0 at padding), with the graph when grad is on."""
    input_ids, attention_mask, labels = group.batch(pad_token_id)
    prompt_len = len(group.prompt_ids)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, prompt_len - 1 : -1]  # (G, T, V)
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels != IGNORE, logprobs, 0.0)


def trl_group_advantages(rewards: np.ndarray) -> np.ndarray:
    """`(G,)` TRL's group advantages (`scale_rewards="group"`), as the asynchronous worker scores a group."""
    return group_advantages(rewards)[0]


def step_advantages(rewards: Sequence[np.ndarray], scale_rewards: str = "group") -> list[np.ndarray]:
    """Each group's `(G,)` advantages as TRL scores one batch of groups: `r − mean` per group, divided by the group's
    std (`"group"`), by the std of every reward of the batch (`"batch"`), or not (`"none"`), + 1e-4."""
    batch_std = nanstd(np.concatenate([np.asarray(r, dtype=np.float64) for r in rewards]))
    return [group_advantages(np.asarray(r, dtype=np.float64), scale_rewards, batch_std)[0] for r in rewards]


def score(
    reward_funcs: Sequence[Callable], row: Mapping[str, Any], completions_text: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Summed rewards `(G,)` of a group (TRL's signature; `row`'s other columns as keywords) and its advantages."""
    prompt = row["prompt"]
    conversational = isinstance(prompt, list)
    completions = [[{"role": "assistant", "content": t}] if conversational else t for t in completions_text]
    columns = {k: [v] * len(completions) for k, v in row.items() if k != "prompt"}
    total = np.zeros(len(completions))
    for fn in reward_funcs:
        values = fn(prompts=[prompt] * len(completions), completions=completions, **columns)
        total += np.array([np.nan if v is None else float(v) for v in values])
    return total, trl_group_advantages(total)


@dataclass
class Settings:
    """How groups are sampled and gradients sketched (the trainer's sampling settings), and the objective.

    The objective is the loss layer's with each correction's `rl_loss`, plus, as the trainer adds them: the KL term
    to a reference policy (`kl_loss_coef` > 0, `kl_loss_type`; the asynchronous demo trains with k3 at 0.001) and
    TRL's reward scaling (`scale_rewards`: `"group"`, `"batch"` or `"none"`, over the groups of one step in
    `GradientFidelity.step_gradients`). The per-prompt estimates (`gradients`) take the token mean of each group
    and score it alone (under `"batch"`, with its own std); `step_gradients` is the trainer's objective on a step.
    """

    num_generations: int = 8
    max_completion_length: int = 24
    temperature: float = 1.0
    batch_groups: int = 2
    sketch_dim: int = 8192
    seed: int = 0
    corrections: dict[str, Correction] = field(default_factory=lambda: dict(CORRECTIONS))
    scale_rewards: Literal["group", "batch", "none"] = "group"
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k3"

    def __post_init__(self):
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"Settings.scale_rewards={self.scale_rewards!r}: one of 'group', 'batch', 'none'")
        if self.kl_loss_coef < 0:
            raise ValueError(f"Settings.kl_loss_coef={self.kl_loss_coef}: must be >= 0")


class GradientFidelity:
    """The diagnostic on one current policy: per prompt, its on-policy estimates and each correction's estimate from
    each behaviour policy's samples.

    Args:
        policy: the current policy θ (a transformers causal LM; put in eval mode, its gradients are taken).
        tokenizer: its tokenizer (a chat template for conversational prompts).
        reward_funcs (`Sequence[Callable]`): reward functions in TRL's signature.
        settings (`Settings`, *optional*): sampling, sketch, corrections and the objective.
        reference (*optional*): the reference policy of the KL term (required when `settings.kl_loss_coef` > 0).

    Example:

    ```python
    >>> fidelity = GradientFidelity(policy, tokenizer, [accuracy_reward])
    >>> per_prompt = [fidelity.measure(row, {"8": behavior}, index=i) for i, row in enumerate(rows)]
    >>> report = fidelity.report(per_prompt)  # per behaviour: every correction's statistics and the noise floor
    ```
    """

    def __init__(
        self,
        policy: Any,
        tokenizer: Any,
        reward_funcs: Sequence[Callable],
        settings: Settings | None = None,
        reference: Any = None,
    ):
        self.policy = policy.eval()
        self.tokenizer = tokenizer
        self.reward_funcs = list(reward_funcs)
        self.settings = settings or Settings()
        kl = {}
        if self.settings.kl_loss_coef:
            if reference is None:
                raise ValueError(f"Settings.kl_loss_coef={self.settings.kl_loss_coef} needs a reference model")
            kl = {"use_kl_loss": True, "kl_loss_coef": self.settings.kl_loss_coef,
                  "kl_loss_type": self.settings.kl_loss_type}  # fmt: skip
        self.reference = None if reference is None else reference.eval()
        self.configs = {name: GRPOLossConfig(**{**c.rl_loss, **kl}) for name, c in self.settings.corrections.items()}
        named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.sketch = CountSketch([(n, p.numel()) for n, p in named], self.settings.sketch_dim, self.settings.seed)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = policy.generation_config.eos_token_id if policy.generation_config.eos_token_id is not None else []
        self.eos_ids = sorted({*([eos] if isinstance(eos, int) else eos), tokenizer.eos_token_id})

    def prompt_ids(self, row: Mapping[str, Any]) -> list[int]:
        prompt = row["prompt"]
        if isinstance(prompt, list):
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        else:
            text = prompt
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def sample(self, model: Any, row: Mapping[str, Any], seed: int) -> Group:
        """`G` completions of `row`'s prompt from `model` under `seed`, scored, with their behaviour log-probs."""
        s = self.settings
        prompt_ids = self.prompt_ids(row)
        with torch.no_grad():
            completions = generate_and_cut(
                model.eval(), [prompt_ids] * s.num_generations, self.pad_token_id, self.eos_ids, seed=seed,
                do_sample=True, temperature=s.temperature, top_k=0, top_p=1.0, max_new_tokens=s.max_completion_length,
            )  # fmt: skip
            completions = [c if c else list(self.eos_ids[:1]) for c in completions]  # an empty one gets its EOS
            group = Group(prompt_ids, completions, np.zeros(len(completions)), np.zeros(len(completions)))
            group.behavior_logprobs = completion_logprobs(model, group, self.pad_token_id)
        text = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        group.rewards, _ = score(self.reward_funcs, row, text)
        group.advantages = step_advantages([group.rewards], s.scale_rewards)[0]
        return group

    def gradients(self, group: Group, names: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
        """Each named correction's sketched gradient at θ on `group` (`(k,)` float64), and the sums `[Σw, Σw², N]`
        of the IS weights it applied over the group's valid tokens (rejected tokens weigh 0): the group's own loss
        (its advantages as scored, the token mean over the group)."""
        zero = torch.zeros(self.sketch.dim, dtype=torch.float64)
        if not np.any(group.advantages) and not self.settings.kl_loss_coef:  # every estimator's gradient is 0
            return {name: zero for name in names}, {name: [0.0, 0.0, 0.0] for name in names}
        _, _, labels = group.batch(self.pad_token_id)
        advantages = torch.tensor(group.advantages, dtype=torch.float32)
        return self._through_the_loss([group], labels, advantages, names)

    def step_gradients(
        self, groups: Sequence[Group], names: Sequence[str], sketch: bool = True
    ) -> tuple[dict[str, Any], dict[str, list]]:
        """The trainer's objective on one optimizer step of `groups` (several prompts' groups): the advantages
        recomputed from the rewards as TRL scores a batch (`Settings.scale_rewards`: `"batch"` divides by the std of
        every reward of the step), one loss context over every completion of the step (the token mean over the step:
        the trainer's global normalization), and the KL term to `reference` (`Settings.kl_loss_coef`). Returns each
        named correction's gradient (sketched `(k,)`, or with `sketch=False` one tensor per trainable parameter) and
        its IS-weight sums."""
        advantages = step_advantages([g.rewards for g in groups], self.settings.scale_rewards)
        width = max(len(c) for g in groups for c in g.completions)
        labels = [g.batch(self.pad_token_id)[2] for g in groups]  # (G, T_g) each
        labels = torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1]), value=IGNORE) for x in labels])
        advantages = torch.tensor(np.concatenate(advantages), dtype=torch.float32)
        return self._through_the_loss(groups, labels, advantages, names, sketch)

    def _logprobs(self, model: Any, groups: Sequence[Group], width: int) -> torch.Tensor:
        """`(ΣG, width)` completion log-probs of `groups` under `model` (each group its own forward: its prompt)."""
        rows = [completion_logprobs(model, g, self.pad_token_id) for g in groups]
        return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows])

    def _through_the_loss(
        self, groups: Sequence[Group], labels: torch.Tensor, advantages: torch.Tensor, names: Sequence[str],
        sketch: bool = True,
    ) -> tuple[dict[str, Any], dict[str, list]]:  # fmt: skip
        """Each correction's gradient at θ of the loss layer's loss on `groups` as one batch (`labels` `(B, T)`,
        `advantages` `(B,)`), through `GRPOLossConfig.build`, `compute_rollout_is`, `build_batches` and the loss."""
        width = labels.shape[1]
        logprobs = self._logprobs(self.policy, groups, width)  # (B, T), with the graph
        current = logprobs.detach()
        behavior = torch.cat([torch.nn.functional.pad(g.behavior_logprobs, (0, width - g.behavior_logprobs.shape[1]))
                              for g in groups])  # fmt: skip
        reference = None
        if self.settings.kl_loss_coef:
            with torch.no_grad():
                reference = self._logprobs(self.reference, groups, width)
        leaf = current.clone().requires_grad_(True)
        vectors, weights, seen = {}, {}, {}
        for name in names:
            correction = self.settings.corrections[name]
            old = behavior if correction.old_policy == "behavior" else current
            rollout = 2 * current - behavior if correction.invert_weights else behavior
            data = {"shifted_labels": labels, "advantages": advantages, "old_logprobs": old,
                    "rollout_logprobs": rollout}  # fmt: skip
            if reference is not None:
                data["ref_logprobs"] = reference
            ctx = self.configs[name].build(data)
            valid = ctx.mask
            ctx.compute_rollout_is()
            GRPOLossContext.build_batches([ctx])
            loss, _ = ctx(logprobs=leaf)
            (coefficients,) = torch.autograd.grad(loss, leaf)  # ∂loss/∂log π: the loss layer's, exactly
            same = next((n for n, c in seen.items() if torch.equal(c, coefficients)), None)
            if same is not None:  # the same ∂loss/∂log π gives the same gradient: one backward per distinct one
                vectors[name] = vectors[same]
            else:
                grads = torch.autograd.grad(logprobs, self.params, coefficients, retain_graph=True, allow_unused=True)
                vectors[name] = self.sketch(grads) if sketch else [torch.zeros_like(p) if g is None else g
                                                                   for p, g in zip(self.params, grads)]  # fmt: skip
                seen[name] = coefficients
            w = ctx.loss_kwargs.rollout_is_weights
            w = torch.where(ctx.mask, torch.ones_like(current) if w is None else w, 0.0)[valid].double()
            weights[name] = [float(w.sum()), float((w * w).sum()), float(valid.sum())]
        return vectors, weights

    def on_policy(self, row: Mapping[str, Any], index: int) -> tuple[list[np.ndarray], dict[str, list]]:
        """Four on-policy groups of `row`'s prompt: their sketched gradients `(k,)` and rewards. Their seeds depend
        on the settings' seed and `index` only: a prompt's on-policy groups serve every behaviour."""
        on, rewards = [], {}
        for slot in range(4):
            group = self.sample(self.policy, row, self._seed(index) + slot)
            on.append(self.gradients(group, ["none"])[0]["none"].numpy())
            rewards[f"on{slot + 1}"] = group.rewards.tolist()
        return on, rewards

    def stale(
        self, row: Mapping[str, Any], on: Sequence[np.ndarray], label: str, behavior: Any, index: int, slot: int = 0
    ) -> dict:
        """Two stale groups of `row`'s prompt from `behavior` (a model, or two recorded `Group`s): every correction's
        per-prompt terms against the on-policy estimates `on`, its IS-weight sums `[Σw, Σw², N]` and the rewards.
        `slot` numbers the behaviour among those of a prompt (its groups' seeds)."""
        names = list(self.settings.corrections)
        stale, weights, rewards = {name: [] for name in names}, {name: np.zeros(3) for name in names}, {}
        for copy in range(2):
            seed = self._seed(index) + 10 + 2 * slot + copy
            group = behavior[copy] if isinstance(behavior, Sequence) else self.sample(behavior, row, seed)
            group_vectors, group_weights = self.gradients(group, names)
            for name in names:
                stale[name].append(group_vectors[name].numpy())
                weights[name] += group_weights[name]
            rewards[f"{label}/{copy + 1}"] = group.rewards.tolist()
        return {
            "terms": {name: prompt_terms(on, stale[name]) for name in names},
            "weights": {name: weights[name].tolist() for name in names},
            "rewards": rewards,
        }

    def measure(self, row: Mapping[str, Any], behaviors: Mapping[str, Any], index: int) -> dict:
        """One prompt: four on-policy groups and, per behaviour label, two stale groups; the per-prompt terms of
        every correction and of the noise floor (`fidelity_stats.prompt_terms`), and the IS-weight sums.

        `behaviors` maps a label to a model, or to two `Group`s of recorded samples (with `behavior_logprobs`)."""
        on, rewards = self.on_policy(row, index)
        out: dict[str, Any] = {"index": index, "floor": floor_terms(on), "terms": {}, "weights": {}}
        for slot, (label, behavior) in enumerate(behaviors.items()):
            result = self.stale(row, on, label, behavior, index, slot)
            out["terms"][label], out["weights"][label] = result["terms"], result["weights"]
            rewards.update(result["rewards"])
        out["rewards"] = rewards
        return out

    def _seed(self, index: int) -> int:
        return self.settings.seed * 1_000_003 + index * 101

    def report(self, per_prompt: Sequence[Mapping[str, Any]], resamples: int = 4000) -> dict:
        """Per behaviour label: every correction's statistics and the noise floor (`fidelity_statistics`), the
        paired differences against `none`, and each correction's ESS `(Σw)² / (N Σw²)` over all its tokens."""
        return fidelity_report(per_prompt, list(self.settings.corrections), self.settings.batch_groups, resamples)


def fidelity_report(
    per_prompt: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    batch_groups: int = 2,
    resamples: int = 4000,
    drop: bool = True,
    seed: int = 0,
) -> dict:
    """`GradientFidelity.report` from stored per-prompt results (`GradientFidelity.measure`'s dicts). With `drop`, the
    zero update (`fidelity_stats.DROP`) is an estimator too, each correction's difference to it is reported
    (`"<name> - drop"`), and each correction gets `zero_advantage_bias_share` where the rewards were recorded."""
    report = {}
    for label in per_prompt[0]["terms"]:
        terms = {FLOOR: [r["floor"] for r in per_prompt]}
        terms.update({name: [r["terms"][label][name] for r in per_prompt] for name in names})
        differences = {f"{name} - none": (name, "none") for name in names if name != "none"}
        differences["none - noise_floor"] = ("none", FLOOR)
        if drop:
            terms[DROP] = [drop_terms(r["floor"]) for r in per_prompt]
            differences.update({f"{name} - {DROP}": (name, DROP) for name in names})
        stats = fidelity_statistics(terms, batch_groups, resamples, seed=seed, differences=differences)
        flagged = zero_advantage_prompts(per_prompt, label) if drop else None
        for name in names:
            total, squares, count = np.sum([r["weights"][label][name] for r in per_prompt], axis=0)
            stats["estimators"][name]["ess"] = total**2 / (count * squares) if squares > 0 else float("nan")
            if flagged is not None:
                b = [r["terms"][label][name]["b"] for r in per_prompt]
                stats["estimators"][name]["zero_advantage_bias_share"] = zero_advantage_bias_share(b, flagged)
        if flagged is not None:
            stats["zero_advantage_prompts"] = int(sum(flagged))
        report[label] = stats
    return report


def zero_advantage_prompts(per_prompt: Sequence[Mapping[str, Any]], label: str) -> list[bool] | None:
    """Per prompt: whether both stale groups of behaviour `label` have all-equal rewards (every advantage zero) while
    at least one of the four on-policy groups has not; `None` when the rewards were not recorded."""
    if any("rewards" not in r for r in per_prompt):
        return None

    def constant(rewards: Sequence[float]) -> bool:
        return len(set(rewards)) <= 1

    out = []
    for r in per_prompt:
        rewards = r["rewards"]
        stale = [rewards[f"{label}/{copy}"] for copy in (1, 2)]
        on = [rewards[f"on{slot}"] for slot in range(1, 5)]
        out.append(all(constant(x) for x in stale) and not all(constant(x) for x in on))
    return out


def format_report(report: Mapping[str, Any], corrections: Mapping[str, Correction] | None = None) -> str:
    """The report as one Markdown table per behaviour label: each estimator's statistics, its relative MSE minus the
    zero update's (`drop`: not training on the stale batch; below 0 means the correction beats dropping), and the share
    of its squared bias that comes from prompts whose stale groups had no advantage."""
    corrections = corrections or CORRECTIONS
    lines = []
    for label, stats in report.items():
        zero = stats.get("zero_advantage_prompts")
        lines += [
            f"behaviour {label} ({stats['prompts']} prompts; 95 % bootstrap intervals over prompts, "
            f"{stats['resamples']} resamples" + (f"; {zero} prompts whose stale groups had no advantage" if zero
                                                 is not None else "") + "):",
            "",
            "| estimator | relative bias | cosine to on-policy | relative MSE, batch of "
            f"{stats['batch_groups']} groups | MSE − drop | squared bias from zero-advantage groups | IS ESS |",
            "|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for name, entry in stats["estimators"].items():
            cells = [_interval(entry[key]) for key in ("relative_bias", "cosine", "relative_mse")]
            versus_drop = stats["differences"].get(f"{name} - {DROP}", {}).get("relative_mse")
            cells.append(_interval(versus_drop) if versus_drop else "")
            share = entry.get("zero_advantage_bias_share")
            cells.append("" if share is None or not math.isfinite(share) else f"{share:.2f}")
            ess = entry.get("ess")
            described = corrections[name].description if name in corrections else _REFERENCES.get(name, name)
            ess_cell = "" if ess is None or not math.isfinite(ess) else f"{ess:.3f}"
            lines.append(f"| {name} ({described}) | {' | '.join(cells)} | {ess_cell} |")
        lines.append("")
    return "\n".join(lines)


# The report's two reference rows, which are not corrections.
_REFERENCES = {FLOOR: "split-half on-policy", DROP: "the zero update: the stale batch not trained on"}


def verdicts(report: Mapping[str, Any], alpha: float = 0.05) -> dict[str, dict[str, dict]]:
    """Per behaviour label and correction: whether training on the stale batch with it is shown to beat dropping the
    batch, its relative MSE below the zero update's (`"<name> - drop"`), Holm-adjusted over every label and
    correction of the report (what the user compares). `keep`: the adjusted p is below `alpha` and the difference
    negative; otherwise the data do not show that the correction beats dropping (which is not evidence that it
    does not)."""
    tests = [(label, name[: -len(f" - {DROP}")], entry["relative_mse"])
             for label, stats in report.items() for name, entry in stats["differences"].items()
             if name.endswith(f" - {DROP}")]  # fmt: skip
    adjusted = holm([t["p"] for _, _, t in tests])
    out: dict[str, dict[str, dict]] = {}
    for (label, name, test), p in zip(tests, adjusted):
        keep = p < alpha and test["value"] < 0
        out.setdefault(label, {})[name] = {**test, "p_holm": p, "keep": keep}
    return out


def format_verdicts(verdicts: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """One line per behaviour label: the corrections shown to beat dropping the stale batch there (`verdicts`)."""
    lines = ["Beats dropping the stale batch (relative MSE below 1, Holm-adjusted over every lag and correction):"]
    for label, tests in verdicts.items():
        kept = [f"{name} ({_interval(t)}, Holm p {_p(t['p_holm'])})" for name, t in tests.items() if t["keep"]]
        lines.append(f"- {label}: " + (", ".join(kept) if kept else "no correction is shown to beat dropping"))
    return "\n".join(lines)


def _p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _interval(entry: Mapping[str, float]) -> str:
    if not math.isfinite(entry["value"]):
        return "undefined"
    return f"{entry['value']:.3f} [{entry['ci_low']:.3f}, {entry['ci_high']:.3f}]"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-rlloss-gradient-fidelity",
        description="How far each stale-sample correction's gradient is from the on-policy gradient.",
    )
    parser.add_argument("--policy", required=True, help="the current policy: a model path or builtin: name")
    parser.add_argument(
        "--behavior", action="append", required=True, metavar="LABEL=PATH",
        help="a behaviour policy (an earlier checkpoint), labelled (e.g. its lag: 8=checkpoint-32); repeatable",
    )  # fmt: skip
    parser.add_argument("--dataset", default="builtin:arithmetic", help="builtin:arithmetic (the demo task)")
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--reward-funcs", nargs="+", default=["accuracy"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-groups", type=int, default=2, help="groups per optimizer step, for the MSE")
    parser.add_argument("--sketch-dim", type=int, default=8192)
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"],
                        help="TRL's reward scaling, as the run trains with")  # fmt: skip
    parser.add_argument("--kl-loss-coef", type=float, default=0.0, help="the KL term's coefficient (--reference)")
    parser.add_argument("--kl-loss-type", default="k3")
    parser.add_argument("--reference", help="the KL term's reference policy (the run's initial model)")
    parser.add_argument("--output", help="write the report as JSON here")
    return parser


def main(argv: list[str] | None = None) -> None:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .assets import resolve_model
    from .rewards import get_reward_funcs
    from .tasks import ARITHMETIC, arithmetic_dataset

    args = build_parser().parse_args(argv)
    if args.dataset != ARITHMETIC:
        raise SystemExit(f"--dataset {args.dataset!r}: only {ARITHMETIC} is built in; use GradientFidelity in Python")
    if "none" not in args.corrections:
        args.corrections = ["none", *args.corrections]  # the on-policy estimates are the plain loss's
    hf_logging.set_verbosity_error()
    policy_path = resolve_model(args.policy)
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
    behaviors = {}
    for spec in args.behavior:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"--behavior {spec!r}: expected LABEL=PATH")
        behaviors[label] = AutoModelForCausalLM.from_pretrained(resolve_model(path), dtype=torch.float32)
    settings = Settings(
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        temperature=args.temperature, batch_groups=args.batch_groups, sketch_dim=args.sketch_dim, seed=args.seed,
        corrections={name: CORRECTIONS[name] for name in args.corrections}, scale_rewards=args.scale_rewards,
        kl_loss_coef=args.kl_loss_coef, kl_loss_type=args.kl_loss_type,
    )  # fmt: skip
    reference = None
    if args.reference:
        reference = AutoModelForCausalLM.from_pretrained(resolve_model(args.reference), dtype=torch.float32)
    fidelity = GradientFidelity(policy, tokenizer, get_reward_funcs(args.reward_funcs), settings, reference)
    rows = list(arithmetic_dataset(args.num_prompts, seed=args.seed, max_operand=args.max_operand))
    per_prompt = [fidelity.measure(row, behaviors, i) for i, row in enumerate(tqdm(rows, desc="prompts"))]
    report = fidelity.report(per_prompt)
    print(format_report(report, settings.corrections))
    print(format_verdicts(verdicts(report)))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "report": report}, f, indent=1)


if __name__ == "__main__":
    main()
