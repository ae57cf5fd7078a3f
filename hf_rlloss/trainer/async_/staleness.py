"""The asynchronous trainer's staleness and progress rule: which samples are trained, and when training stops.

One rule: a sample is trained only if `trained at − sampled by <= max_staleness`, in policy versions.

* **At pull.** TRL's staleness filter (`RolloutQueueDataset`, `version − sample.model_version > max_staleness`) is
  given the version the sample's micro-batch will be trained at (`_version_at_pull`), not the current one: the
  dataloader's prefetch and `num_mini_batches` train a micro-batch up to a batch later than it is pulled. The
  planners count the micro-batches they emit (`filling`) for it, and the dataset logs the share of the samples it
  dropped (`async/dropped_stale_frac`).
* **When trained.** `get_batch_samples` checks again with the same comparison (`_fresh_enough` at `_version_at`):
  the only samples it can still drop are those a token-budget micro-batch pushed into the next one. The lags of the
  trained samples are logged (`async/version_lag_mean`, `async/version_lag_max`).
* **Progress.** An optimizer step with no trained token on any rank takes no optimizer step (`_SkipEmptyStep`: its
  zero gradient would still move the parameters through Adam's momentum), counted in
  `async/skipped_empty_steps_total`; `max_consecutive_empty_steps` of them in a row, or as many samples taken from
  the queue in a row too stale to train as can be stale after a weight sync (`stale_limit`), stop training with
  `NoTrainableSamplesError`.
* **Admissible configurations.** `least_trained_lag` is the least lag a sample can have when trained;
  `check_weight_lag` refuses, at construction of the config, the workers and the trainer, a configuration under
  which it exceeds `max_staleness` (every sample would be dropped).
* **Fixed lag.** Under a worker's `fixed_lag`, batch `b` is sampled from the policy of optimizer step `b − fixed_lag`
  (`version_for_batch`); `check_fixed_lag` refuses, at the worker's construction, a lag `max_staleness` would drop,
  and `check_fixed_lag_setup`, at the trainer's, a worker whose batches are not one optimizer step each.

`AsyncStaleness` is mixed into `RLLossAsyncGRPOTrainer`; the lag rules are also imported by the config, the rollout
workers and their process' loop.
"""

from __future__ import annotations

from typing import Any

import torch
import trl.experimental.async_grpo.async_grpo_trainer as trl_async
from transformers import TrainerCallback
from trl.experimental.async_grpo.async_grpo_trainer import FixedCountBatcher, RolloutQueueDataset, TokenBudgetBatcher

from ..common.overrides import overridden
from .packed_rows import PackedRow, keep_samples, packed_row

__all__ = [
    "AsyncStaleness",
    "NoTrainableSamplesError",
    "check_fixed_lag",
    "check_fixed_lag_setup",
    "check_weight_lag",
    "least_trained_lag",
    "version_for_batch",
]


def least_trained_lag(weight_lag: int, weight_sync_steps: int, num_mini_batches: int) -> int:
    """The least lag, in policy versions, that a sample can have when it is trained, in a steady state where the
    worker samples from the newest weights it may use (`weight_lag` versions behind the trainer's): the admissible
    region of the staleness rule is `least_trained_lag(...) <= max_staleness`.

    Every knob that ages a sample, and what it adds:

    * `weight_lag`: the worker samples from weights this many versions behind the newest it received;
    * the dataloader's prefetch (one micro-batch, Accelerate's): the first micro-batch of a batch is pulled while the
      previous batch is trained, at that batch's version, and trained `num_mini_batches` optimizer steps later;
      those steps cross up to `ceil(num_mini_batches / weight_sync_steps)` weight syncs (`weight_sync_steps`: the
      optimizer steps between two syncs). The batch's other micro-batches are pulled at the version of its first
      step, and the latest is trained `num_mini_batches - 1` steps later: no more syncs than the prefetched one;
    * `gradient_accumulation_steps`, the queue's depth (`queue_maxsize`) and the worker's batch add nothing to the
      least lag: the micro-batches of one optimizer step are trained at one version, and a sample that waited in
      the queue is dropped when pulled and replaced by a fresher one. They set how many samples may have to be
      dropped in a row before a fresh one comes, which the trainer's stale bound counts (`queue_maxsize` + the
      worker's batch + `max_consecutive_empty_steps` steps' worth).

    (`steps_per_generation` is an option of TRL's synchronous `GRPOConfig` only; its asynchronous counterpart is
    `num_mini_batches`.) A configuration outside the region trains some steps at best, then drops every sample of a
    micro-batch it can never fill and stops with `NoTrainableSamplesError`; `tests/test_async_staleness_region.py`
    checks the region against a simulation of the trainer's pulls over a grid, and against short real runs.
    """
    return weight_lag + -(-num_mini_batches // weight_sync_steps)


def check_weight_lag(weight_lag: int, args: Any) -> None:
    """Refuse a configuration under which samples can only be too stale to train (`least_trained_lag` above
    `max_staleness`), naming the knobs and the bound. Called by `RLLossAsyncGRPOConfig` (with `weight_lag` 0), by the
    rollout workers and by the trainer."""
    if not isinstance(weight_lag, int) or isinstance(weight_lag, bool) or weight_lag < 0:
        raise ValueError(f"weight_lag={weight_lag!r} must be an integer >= 0")
    staleness = getattr(args, "max_staleness", None)
    if staleness is None:
        return
    every, mini = args.weight_sync_steps, getattr(args, "num_mini_batches", 1)
    least = least_trained_lag(weight_lag, every, mini)
    if least <= staleness:
        return
    syncs = least - weight_lag
    raise ValueError(
        f"weight_lag={weight_lag}, weight_sync_steps={every}, num_mini_batches={mini} with max_staleness={staleness}: "
        f"a sample is trained at least weight_lag + ceil(num_mini_batches / weight_sync_steps) = {weight_lag} + "
        f"{syncs} = {least} versions after the policy that sampled it (the dataloader's prefetched micro-batch waits "
        f"num_mini_batches optimizer steps, across {syncs} weight sync(s)), so every such micro-batch would be "
        f"dropped as too stale and training would stop. Allowed: weight_lag + ceil(num_mini_batches / "
        f"weight_sync_steps) <= max_staleness: set max_staleness >= {least}"
        + (f", or weight_lag <= {staleness - syncs}" if staleness - syncs >= 0 else "")
        + " (gradient_accumulation_steps and queue_maxsize do not change the bound)"
    )


def version_for_batch(batch: int, fixed_lag: int, weight_sync_steps: int) -> int:
    """Under `fixed_lag`, the policy version batch `batch` (0-based, one optimizer step's samples) is sampled from:
    the version of the policy after optimizer step `batch − fixed_lag` (the cold sync's, version 1, for the first
    ones). TRL bumps the version after every `weight_sync_steps`-th step."""
    return 1 + max(0, batch - fixed_lag) // weight_sync_steps


def check_fixed_lag(fixed_lag: int, weight_lag: int, args: Any) -> None:
    """Refuse, at the worker's construction, a `fixed_lag` that a batch cannot wait for, that is set with `weight_lag`,
    or whose samples `max_staleness` would drop (`ceil(fixed_lag / weight_sync_steps)` versions old when trained)."""
    if not isinstance(fixed_lag, int) or fixed_lag < 1:
        raise ValueError(
            f"fixed_lag={fixed_lag!r} must be an integer >= 1: the trainer's dataloader fetches the next step's first "
            "micro-batch before it steps, so a batch cannot wait for the policy of the step before it is trained"
        )
    if weight_lag:
        raise ValueError(f"weight_lag={weight_lag} and fixed_lag={fixed_lag}: set one of the two")
    needed = -(-fixed_lag // args.weight_sync_steps)
    staleness = getattr(args, "max_staleness", None)
    if staleness is not None and staleness < needed:
        raise ValueError(
            f"fixed_lag={fixed_lag} with weight_sync_steps={args.weight_sync_steps} trains samples up to {needed} "
            f"versions old: max_staleness={staleness} would drop them; set max_staleness >= {needed}"
        )


def check_fixed_lag_setup(worker: Any, transfer: Any, args: Any, num_processes: int) -> None:
    """Refuse, at the trainer's construction, a `fixed_lag` worker whose batches are not one optimizer step each,
    whose pipeline is shallower than the steps' pull, or whose weight transfer keeps no versions."""
    lag = getattr(worker, "fixed_lag", None)
    if lag is None:
        return
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * num_processes
    per_batch = worker.groups_per_batch * args.num_generations
    if per_batch != per_step:
        raise ValueError(
            f"fixed_lag needs one rollout batch per optimizer step: the worker's batch has groups_per_batch × "
            f"num_generations = {per_batch} samples, a step per_device_train_batch_size × gradient_accumulation_steps"
            f" × processes = {per_step}"
        )
    if lag < args.num_mini_batches:
        raise ValueError(
            f"fixed_lag={lag} < num_mini_batches={args.num_mini_batches}: a step pulls {args.num_mini_batches} "
            "batches ahead, before the policy their sampling waits for exists; set fixed_lag >= num_mini_batches"
        )
    if not callable(getattr(transfer, "keep", None)):
        raise ValueError(
            f"fixed_lag needs QueueWeightTransfer (it keeps the versions a checkpoint saves); got {type(transfer)}"
        )


class NoTrainableSamplesError(RuntimeError):
    """Training cannot progress: too many consecutive samples too stale to train, or consecutive optimizer steps with
    no trained token (`RLLossAsyncGRPOConfig.max_consecutive_empty_steps`)."""


class _CountingQueue:
    """The rollout queue, counting the samples taken from it and keeping the last one (for `_VersionedDataset`).

    `limit`: raise `NoTrainableSamplesError` instead of taking another sample when the last `limit` taken were all
    dropped by the staleness filter (`kept` is the count when the dataset last kept one)."""

    def __init__(self, queue, limit: int | None = None, describe=None):
        self._queue = queue
        self.taken = 0
        self.kept = 0
        self.last = None
        self.limit = limit
        self.describe = describe or (lambda: "")

    def get(self, *args, **kwargs):
        if self.limit is not None and self.taken - self.kept >= self.limit:
            raise NoTrainableSamplesError(
                f"the last {self.taken - self.kept} samples taken from the rollout queue were all too stale to train "
                f"{self.describe()}: the rollout worker samples from policies too far behind the trainer. Lower the "
                "worker's weight_lag or queue_maxsize, raise max_staleness, or raise max_consecutive_empty_steps if "
                "this is a transient"
            )
        self.last = self._queue.get(*args, **kwargs)
        self.taken += 1
        return self.last

    def __getattr__(self, name):
        return getattr(self._queue, name)


class _VersionedDataset(RolloutQueueDataset):
    """TRL's `RolloutQueueDataset` whose items also carry their sample's `model_version`, and which logs the share of
    the samples taken from the queue that its staleness filter dropped (`async/dropped_stale_frac`).

    The trainer sets `model_version_fn` to the version the micro-batch being filled (`filling`, counted by the
    planner) will be trained at, so that TRL's filter (`version - sample.model_version > max_staleness`) is the
    trainer's rule, applied when the sample is pulled; and `stale_limit`, the consecutive dropped samples after which
    training stops (`NoTrainableSamplesError`)."""

    filling = 0  # the index of the micro-batch the planner is filling (micro-batches emitted so far)
    stale_limit: int | None = None

    def _describe_last(self) -> str:
        last = self.queue.last
        if last is None:
            return ""
        return (
            f"(the last sampled by policy version {last.model_version}, to be trained at version "
            f"{self.model_version_fn()}: more than max_staleness={self.max_staleness} behind)"
        )

    def __iter__(self):
        if not isinstance(self.queue, _CountingQueue):
            self.queue = _CountingQueue(self.queue, self.stale_limit, self._describe_last)
        counting = self.queue
        taken = counting.taken
        for item in super().__iter__():
            dropped = counting.taken - taken - 1  # taken since the previous item, less this one
            taken = counting.kept = counting.taken
            self.metrics["async/dropped_stale_frac"].append((float(dropped), float(dropped + 1)))
            item["model_version"] = counting.last.model_version
            routes = getattr(counting.last, "routed_experts", None)  # MoE routing replay (async_/routing_replay.py)
            if routes is not None:
                item["routed_experts"] = routes
            yield item


class _CountingFixedCountBatcher(FixedCountBatcher):
    """TRL's fixed-count planner, counting the micro-batches it emits into its dataset's `filling`."""

    def __iter__(self):
        for rows in super().__iter__():
            self.dataset.filling += 1
            yield rows


class _CountingTokenBudgetBatcher(TokenBudgetBatcher):
    """TRL's token-budget planner, counting the micro-batches it emits into its dataset's `filling`. (The sample that
    closes a micro-batch, by not fitting in it, was pulled while that one was filled and opens the next: it is judged
    at pull against the version of the first, and again when trained, by `get_batch_samples`.)"""

    def __iter__(self):
        for rows in super().__iter__():
            self.dataset.filling += 1
            yield rows


class _SkipEmptyStep(TrainerCallback):
    """Skip the optimizer step of an optimizer step with no trained token on any rank (`_rl_empty_step`): its gradient
    is zero, but Adam's momentum and weight decay would still move the parameters. Done as Accelerate marks a step
    skipped for a gradient overflow, so the trainer does not step the learning-rate schedule either."""

    def __init__(self, trainer: AsyncStaleness):
        self.trainer = trainer
        self.marked = False
        self.replaced = None  # the optimizer's own `step` attribute while it is replaced (the LR scheduler wraps it)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        optimizer = self.trainer.optimizer
        if self.trainer._rl_empty_step:
            self.replaced = vars(optimizer).get("step", _CLASS_STEP)
            optimizer.step = _no_optimizer_step  # this call only
            optimizer._is_overflow = self.marked = True  # accelerator.optimizer_step_was_skipped: no LR step
        elif self.marked:
            optimizer._is_overflow = self.marked = False

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.replaced is None:
            return
        optimizer = self.trainer.optimizer
        if self.replaced is _CLASS_STEP:
            del optimizer.step
        else:
            optimizer.step = self.replaced
        self.replaced = None


_CLASS_STEP = object()  # the optimizer had no `step` of its own (its class')


def _no_optimizer_step(closure=None) -> None:
    return None


class AsyncStaleness:
    """The staleness and progress rule of `RLLossAsyncGRPOTrainer` (an `AsyncGRPOTrainer` mixin; see the module
    docstring). Put it before `AsyncGRPOTrainer` in the bases: it overrides `get_train_dataloader`. The trainer calls
    `_setup_staleness` once, `_reset_staleness` at the start of every run, `_pull_batches` and `_trainable_rows` when
    it takes a batch, and `_check_progress` before each optimizer step."""

    def _setup_staleness(self, rollout_worker: Any) -> None:
        """Refuse a worker whose `weight_lag` leaves no sample fresh enough to train (`check_weight_lag` with the
        trainer's arguments), and skip the optimizer step of a step without a trained token (`_SkipEmptyStep`)."""
        if rollout_worker is not None and getattr(rollout_worker, "weight_lag", 0):
            check_weight_lag(rollout_worker.weight_lag, self.args)
        self.add_callback(_SkipEmptyStep(self))

    def _reset_staleness(self) -> None:
        """The rule's counters, at construction and at the start of every training loop."""
        # (step, its first micro-batch, micro-batches per step) of the last pull: `_version_at_pull`
        self._rl_pull_plan = (self.state.global_step, 0, self.args.gradient_accumulation_steps)
        self._rl_consumed = 0  # micro-batches taken from the dataloader (the planner's count, on the main process)
        self._rl_empty_run = 0  # consecutive optimizer steps without a trained token
        self._rl_empty_step = False  # the optimizer step about to be trained has none (`_SkipEmptyStep` skips it)

    def get_train_dataloader(self):
        """TRL override: TRL's dataloader, its dataset and planners swapped for the counting ones (same samples, same
        rows), its staleness filter comparing with the version a sample will be trained at."""
        with overridden(
            trl_async,
            RolloutQueueDataset=_VersionedDataset,
            FixedCountBatcher=_CountingFixedCountBatcher,
            TokenBudgetBatcher=_CountingTokenBudgetBatcher,
        ):
            dataloader = super().get_train_dataloader()
        if self.accelerator.is_main_process:
            dataset = self._rollout_dataset
            # TRL's staleness filter compares with the version the sample will be trained at, not the current one
            dataset.model_version_fn = self._version_at_pull
            per_step = (
                self.args.per_device_train_batch_size
                * self.args.gradient_accumulation_steps
                * self.accelerator.num_processes
            )
            # the samples that may be stale in a row after a weight sync in a run that trains: the queue's, the
            # worker's batch being put (sampled before the sync), then `max_consecutive_empty_steps` steps' worth
            batch = getattr(self.rollout_worker, "samples_per_batch", self.args.num_generations)
            dataset.stale_limit = self.args.queue_maxsize + batch + self.args.max_consecutive_empty_steps * per_step
        return dataloader

    def _version_at_pull(self) -> int:
        """The policy version the micro-batch the planner is filling will be trained at: the `k`-th micro-batch
        taken by the `get_batch_samples` call of step `g` (counted from 0; the call's `num_batches × num_mini_batches`
        and then the next call's first, fetched ahead by the dataloader) is trained in step `g + k // num_batches`."""
        step, first, per_step = self._rl_pull_plan
        ahead = (self._rollout_dataset.filling - first) // per_step
        every = self.args.weight_sync_steps
        return self.model_version + (step + ahead) // every - step // every

    def _pull_batches(self, epoch_iterator, num_batches: int, device: torch.device) -> list[dict[str, Any]]:
        """TRL's `get_batch_samples` for `num_mini_batches` optimizer steps of `num_batches` micro-batches each, the
        pulls planned (`_version_at_pull`: the micro-batches from the `_rl_consumed`-th train from this step on) and
        counted."""
        self._rl_pull_plan = (self.state.global_step, self._rl_consumed, num_batches)
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches * self.args.num_mini_batches, device)
        self._rl_consumed += len(batches)
        return batches

    def _trainable_rows(self, groups: list[list[dict[str, Any]]]) -> tuple[list[list[PackedRow]], list[int], list]:
        """The packed rows of each mini-batch's micro-batches (`groups`: mini-batch `j` is trained `j` optimizer steps
        from now) without the samples too stale when trained, each mini-batch's trained tokens summed over the ranks,
        and the samples dropped per micro-batch (`(dropped, kept)`); the lags and drops logged."""
        metrics: dict[str, list] = {"lag": [], "dropped": []}
        rows = [
            [self._fresh_enough(packed_row(batch), self._version_at(j), metrics) for batch in group]
            for j, group in enumerate(groups)
        ]
        tokens = self._trained_tokens(rows)
        self._log_lags(metrics)
        return rows, tokens, metrics["dropped"]

    def _trained_tokens(self, rows: list[list[PackedRow]]) -> list[int]:
        """The trained tokens of each mini-batch's micro-batches, summed over the ranks."""
        counts = torch.tensor(
            [sum(int(row.num_tokens.sum()) for row in group) for group in rows],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        return [int(c) for c in counts.tolist()]

    def _check_progress(self, tokens: int, dropped: list[tuple[float, float]]) -> None:
        """Mark the optimizer step about to be trained empty (no trained token on any rank: `_SkipEmptyStep` skips
        its optimizer step), count it, and stop after `max_consecutive_empty_steps` empty steps in a row."""
        self._rl_empty_step = tokens == 0
        self._metrics["train"]["async/skipped_empty_steps_total"].append(float(self._rl_empty_step))
        self._rl_empty_run = self._rl_empty_run + 1 if self._rl_empty_step else 0
        limit = self.args.max_consecutive_empty_steps
        if self._rl_empty_run >= limit:
            stale = sum(d for d, _ in dropped)
            cause = (
                f"{stale:.0f} samples of the last batch dropped as more than max_staleness={self.args.max_staleness} "
                "versions old when trained"
                if stale
                else "every completion of the last batch is empty"
            )
            raise NoTrainableSamplesError(
                f"{self._rl_empty_run} consecutive optimizer steps without a trained token "
                f"(max_consecutive_empty_steps={limit}; {cause}): training makes no progress. Check the rollout "
                "worker's completions and lag (weight_lag, queue_maxsize) against max_staleness"
            )

    def _version_at(self, mini_batch: int) -> int:
        """The policy version the trainer will have when it trains mini-batch `mini_batch` of the batch taken now
        (TRL syncs, and bumps the version, after every `weight_sync_steps`-th optimizer step)."""
        step, every = self.state.global_step, self.args.weight_sync_steps
        return self.model_version + (step + mini_batch) // every - step // every

    def _fresh_enough(self, row: PackedRow, version: int, metrics: dict[str, list]) -> PackedRow:
        """`row` without the samples more than `max_staleness` versions behind `version`; their lags recorded."""
        if row.sample_versions is None:
            return row
        lag = version - row.sample_versions  # (S,)
        keep = lag <= self.args.max_staleness
        metrics["lag"] += lag[keep].tolist()
        metrics["dropped"].append((float((~keep).sum()), float(keep.numel())))
        return keep_samples(row, keep)

    def _log_lags(self, metrics: dict[str, list]) -> None:
        """`async/version_lag_*`: the lags of the samples as they are trained (gathered over the ranks); the samples
        dropped here join `async/dropped_stale_frac` (their pull was counted by the dataset)."""
        stats = torch.tensor(
            [sum(metrics["lag"]), float(len(metrics["lag"])), sum(d for d, _ in metrics["dropped"])],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        top = torch.tensor([max(metrics["lag"], default=-1.0)], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            stats = self.accelerator.reduce(stats, reduction="sum")
            top = self.accelerator.reduce(top, reduction="max")
        lag_sum, lag_count, dropped = stats.tolist()
        train = self._metrics["train"]
        if lag_count:
            train["async/version_lag_mean"].append((lag_sum, lag_count))
            train["async/version_lag_max"].append(float(top.item()))
        if dropped:
            train["async/dropped_stale_frac"].append((dropped, 0.0))
