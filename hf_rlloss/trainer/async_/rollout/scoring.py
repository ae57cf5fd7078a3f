"""Group scoring in the rollout workers: each prompt's `num_generations` episodes scored as one group, their advantage
computed as TRL's `GRPOTrainer` computes it, and turned into TRL `RolloutSample`s; the rollout-error policy
(`episodes.RolloutErrorPolicy`) applied to each group.

* **Rewards.** The reward functions, summed (a completion every function skipped is unscored: advantage 0, TRL's
  rule), then an environment's `get_reward` as a column of its own per environment class. A non-finite reward is a
  `NonFiniteRewardError` of its episode.
* **Advantages** (`common.advantages.group_advantages`): `r − mean` over the group, divided by TRL's unbiased
  std + 1e-4 under `scale_rewards="group"`, the batch's under `"batch"`, not divided under `"none"`.
* **The rollout-error policy** (`episodes.RolloutErrorPolicy`): every error is counted (`rollout/errors/<kind>_total`);
  under `"raise"` the worker stops with the first, under `"drop"` the group is dropped and counted
  (`rollout/dropped_groups/<kind>_total`), under `"feed_back"` (TRL's behaviour) it is trained. A budget cut follows
  the policy only under `on_budget_cut="rollout_error"`. `max_dropped_groups` groups dropped in a row stop the worker
  (`NoRolloutSamplesError`).

`GroupScoring` is mixed into the workers' loop (`rollout/loop.py`).
"""

from __future__ import annotations

import math
import queue
from typing import Any

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ...common.advantages import group_advantages, nanstd
from .tool_calling.episodes import Episode, NonFiniteRewardError, RolloutErrorPolicy

__all__ = ["GroupScoring", "NoRolloutSamplesError", "summed_rewards"]


class NoRolloutSamplesError(RuntimeError):
    """The rollout worker makes no trainable sample: every prompt group of `max_dropped_groups` in a row was dropped
    by `on_rollout_error="drop"` (the message counts them by kind)."""


def summed_rewards(per_func: np.ndarray) -> np.ndarray:
    """`(G,)` the `(F, G)` rewards summed over the functions; NaN where every function skipped the completion."""
    rewards = np.nansum(per_func, axis=0)
    rewards[np.all(np.isnan(per_func), axis=0)] = np.nan
    return rewards


class GroupScoring:
    """The scoring half of a rollout worker's loop (mixed into `loop.WorkerLoop`).

    Reads from the loop: `s` (the `WorkerSettings`: `num_generations`, `reward_funcs`, `reward_names`,
    `scale_rewards`, `agent`, `max_dropped_groups`, `tokenizer`), `multiturn` (the `MultiTurnRollouts`, or `None`) and
    `metrics_queue`; keeps `next_group` (the samples' `group_id`) and `dropped` (groups dropped in a row, by kind).
    """

    s: Any
    multiturn: Any
    metrics_queue: Any
    next_group: int
    dropped: dict[str, int]

    @property
    def rollout_error_policy(self) -> RolloutErrorPolicy:
        """The agent's policy; without tools or environments, TRL's (nothing is dropped or raised)."""
        return self.s.agent.policy if self.s.agent is not None else RolloutErrorPolicy()

    def _report(self, metrics: dict[str, Any]) -> None:
        """Send metrics to the trainer (dropped when its queue is full)."""
        try:
            self.metrics_queue.put_nowait(metrics)
        except queue.Full:
            pass

    def _score_groups(self, rows, encoded, completions, recorded, version) -> list[RolloutSample]:
        """Single-turn: each prompt's `num_generations` completions (consecutive in `completions`) scored as one
        group."""
        s, tok = self.s, self.s.tokenizer
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        episodes = []
        for i, completion in enumerate(completions):
            row = rows[i // s.num_generations]
            prompt = encoded["input_ids"][i][encoded["attention_mask"][i].bool()].tolist()
            logps = recorded[0][i] if recorded is not None else [math.nan] * len(completion)
            shown = [{"role": "assistant", "content": texts[i]}] if isinstance(row["prompt"], list) else texts[i]
            episodes.append(Episode(row["prompt"], prompt, completion, [1] * len(completion), list(logps), shown))
        return self._score_episodes(rows, episodes, version)

    def _score_episodes(self, rows, episodes: list[Episode], version) -> list[RolloutSample]:
        """Each prompt's `num_generations` episodes (consecutive) scored as one group; the rollout-error policy
        decides which groups are trained (the module docstring). A non-finite reward (an environment's `get_reward`,
        or ±inf from a reward function) is a `NonFiniteRewardError` of its episode: counted, and under `"feed_back"`
        the completion is left unscored (advantage 0, TRL's rule for a skipped completion)."""
        s, policy, counts, kept = self.s, self.rollout_error_policy, {}, []
        for g, row in enumerate(rows):
            group = episodes[g * s.num_generations : (g + 1) * s.num_generations]
            per_func, names = self._rewards(row, group)
            errors = [e for episode in group for e in episode.errors]
            for kind in (e.kind for e in errors):
                counts[f"rollout/errors/{kind}_total"] = counts.get(f"rollout/errors/{kind}_total", 0.0) + 1.0
            dropped = policy.dropped_kinds(errors)
            if dropped:
                for kind in dropped:
                    key = f"rollout/dropped_groups/{kind}_total"
                    counts[key] = counts.get(key, 0.0) + 1.0
                    self.dropped[kind] = self.dropped.get(kind, 0) + 1
                self._check_dropped()
                continue
            self.dropped = {}
            kept.append((group, per_func, names))
        rewards = [summed_rewards(per_func) for _, per_func, _ in kept]
        batch_std = nanstd(np.concatenate(rewards)) if rewards else 0.0
        samples = []
        for (group, per_func, names), summed in zip(kept, rewards, strict=True):
            samples += self._score_group(group, per_func, names, summed, batch_std, version)
        if self.multiturn is not None:
            n = float(len(episodes))
            counts["tools/loop_exhausted_frac"] = (float(sum(e.loop_exhausted for e in episodes)), n)
            counts["rollout/turns_mean"] = (float(sum(e.turns for e in episodes)), n)
        if counts:
            self._report(counts)
        return samples

    def _check_dropped(self) -> None:
        """Stop (`NoRolloutSamplesError`) after `max_dropped_groups` groups in a row dropped by the policy: the worker
        would otherwise make empty batches for ever while the trainer waits."""
        total = max(self.dropped.values(), default=0)
        limit = self.s.max_dropped_groups
        if limit and total >= limit:
            kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.dropped.items()))
            raise NoRolloutSamplesError(
                f"the last {total} prompt groups were all dropped by on_rollout_error='drop' ({kinds}; "
                f"max_consecutive_empty_steps x groups per step = {limit}): the worker makes no trainable sample. "
                "Fix what fails (the rollout/errors/* metrics count it), or use on_rollout_error='feed_back'"
                + (", or on_budget_cut='keep' (budget_cut: conversations cut by max_completion_length in the middle "
                   "of a tool call; or raise max_completion_length)" if "budget_cut" in self.dropped else "")
            )  # fmt: skip

    def _rewards(self, row, episodes: list[Episode]) -> tuple[np.ndarray, list[str]]:
        """`(F, G)` rewards of one group, a row per reward function and then per environment class with a
        `get_reward` (TRL's rule); NaN where skipped. A non-finite reward becomes NaN and a `NonFiniteRewardError`
        of its episode."""
        s = self.s
        n = len(episodes)
        shown = [e.messages for e in episodes]
        extra = {k: [v] * n for k, v in row.items() if k != "prompt"}
        environments = [e.environment for e in episodes]
        if self.multiturn is not None and self.multiturn.factories is not None:
            extra["environments"] = environments
        columns = [
            [math.nan if r is None else float(r) for r in fn(prompts=[e.prompt for e in episodes], completions=shown,
                                                              completion_ids=[e.completion_ids for e in episodes],
                                                              **extra)]
            for fn in s.reward_funcs
        ]  # fmt: skip
        names = list(s.reward_names)
        if self.multiturn is not None:  # an environment's get_reward: a column per environment class (TRL's rule)
            for env_type in self.multiturn.reward_types:
                columns.append([float(e.get_reward()) if type(e) is env_type else math.nan for e in environments])
                names.append(env_type.__name__)
        per_func = np.array(columns, dtype=float).reshape(len(columns), n)
        types = [None] * len(s.reward_funcs) + (self.multiturn.reward_types if self.multiturn is not None else [])
        for k, j in np.ndindex(per_func.shape):
            value = per_func[k, j]  # NaN is a reward function's "skipped" (TRL's None), never an environment's
            if math.isinf(value) or (math.isnan(value) and type(environments[j]) is types[k]):
                episodes[j].errors.append(
                    NonFiniteRewardError(f"{names[k]} returned {value} for completion {j} of its group")
                )
                per_func[k, j] = math.nan
        return per_func, names

    def _score_group(self, episodes: list[Episode], per_func, names, rewards, batch_std, version) -> list:
        advantages, mean, std = group_advantages(rewards, self.s.scale_rewards, batch_std)
        group = self.next_group
        self.next_group += 1
        samples = []
        for j, e in enumerate(episodes):
            metrics = {"reward": float(rewards[j]), "reward_std": std}
            metrics.update({f"rewards/{name}": float(per_func[k, j]) for k, name in enumerate(names)})
            if self.multiturn is not None:
                metrics["tools/call_frequency"] = float(e.tool_calls)
                metrics["tools/failure_frequency"] = e.tool_failures / e.tool_calls if e.tool_calls else 0.0
            p = len(e.prompt_ids)
            samples.append(
                RolloutSample(
                    prompt=e.prompt, completion=e.messages, input_ids=np.asarray(e.prompt_ids + e.completion_ids,
                                                                                 np.int64),
                    completion_mask=np.asarray([0] * p + list(e.mask), np.int64),
                    old_log_probs=np.asarray([0.0] * p + list(e.logprobs), np.float32),
                    advantage=float(advantages[j]), model_version=version, group_id=group, metrics=metrics,
                )
            )  # fmt: skip
        self._report({"rollout/reward_mean": mean, "rollout/version": float(version)})
        return samples
