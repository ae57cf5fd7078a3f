"""`RLLossAsyncGRPOTrainer`: TRL's asynchronous GRPO trainer with its loss replaced by the hf_rlloss loss layer.

TRL's data path is kept as it is: the rollout worker and its queue, the staleness filter (`max_staleness`), the
weight-sync cadence (`weight_sync_steps`), the planner and TRL's prefix-trie packing (`TreeRow`). What changes is the
loss of an optimizer step (see docs/async.md):

* **Decoupled objective.** π_behavior is the sampler's log-probs (TRL's `old_log_probs`); π_old is the trainer's own
  no-grad pass over the step's micro-batches before the first backward (`get_batch_samples`), the PPO clip is taken
  against it, and rollout IS weighs by π_old / π_behavior with every level, mode and veto of the loss layer.
  `behavior_as_old_policy=True` keeps TRL's choice (π_old = π_behavior, one forward fewer).
* **Exact normalization** of the step's micro-batches on all ranks (`build_batches`), KL to a reference model, every
  policy loss, OPSM and the entropy bonus: the loss layer's.
* **Packed rows.** A row's trained tokens are TRL's loss terms (`token_index`: the packed position whose hidden state
  predicts each target); the loss layer sees them as one packed row `(1, M)` split into sequences by `segment_id`,
  and projects the backbone's hidden states at `token_index` through the LM head in chunks (no `(tokens, vocab)`
  logits).
* **Staleness when trained.** `max_staleness` bounds the lag a sample has when it is trained (the dataloader's
  prefetch adds a version to the lag at pull): TRL's filter is given the version the sample's micro-batch will be
  trained at (`_version_at_pull`), and `get_batch_samples` checks again with the same comparison. A step with no
  trained token takes no optimizer step (`async/skipped_empty_steps_total`); `max_consecutive_empty_steps` of them,
  or as many steps' worth of samples too stale, stop training (`NoTrainableSamplesError`). `num_mini_batches` trains
  a batch in several optimizer steps against one π_old (AReaL's mini-batches), so that the PPO clip binds.
* **Resume** with hf_rlloss' rollout workers: the prompt position and the policy version counter are saved in the
  checkpoint and restored before the worker starts (`async_/resume.py`; TRL restores them for its own worker only).
* **Metrics**: the loss layer's (`train_policy/*`, `mismatch/*`, `rollout_is/*`), plus `async/version_lag_mean`,
  `async/version_lag_max` (policy versions between a trained sample's sampler and the trainer, when it is trained)
  and `async/dropped_stale_frac` (the share of samples pulled from the queue that were dropped as too stale, when
  pulled or when trained). The MoE router loss is added as in TRL's async trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import trl.experimental.async_grpo.async_grpo_trainer as trl_async
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
)
from trl.experimental.async_grpo.packing import TREE_ATTENTION
from trl.models.utils import _ForwardRedirection
from trl.trainer.utils import use_adapter

from ..loss.config import BaseRLLossConfig
from ..loss.context import BaseRLLossContext
from ..loss.metrics import accumulate_metrics, finalize_train_policy_metrics
from ..parallel.layouts import model_layouts, switch_attention, zero_dropout
from ..parallel.tree_attention import register_tree_attention
from .async_ import resume as rollout_resume
from .async_.cpu_rollout import check_weight_lag
from .async_.routing import AsyncRoutingReplay, collate_routes
from .async_grpo_config import RLLossAsyncGRPOConfig
from .common.engines import activation_checkpointing_disabled, load_reference, prepare_reference, reference_source
from .common.forwards import LossLayerForwards
from .common.lm_head import (
    causal_lm,
    check_model_supported,
    load_balancing_loss_func,
    logit_scale,
    with_model_softcapping,
)
from .common.overrides import overridden
from .common.rollout_recording import replay_warpers

logger = logging.get_logger(__name__)

__all__ = [
    "NoTrainableSamplesError",
    "PackedRow",
    "RLLossAsyncGRPOConfig",
    "RLLossAsyncGRPOTrainer",
    "packed_row",
    "portable_async_trl",
    "tree_attention_name",
    "use_tree_attention",
]


def use_tree_attention(lm: nn.Module, name: str, what: str) -> None:
    """Put the causal LM `lm` on the tree attention `name`, which every forward of the async trainer runs (TRL packs
    each micro-batch into one prefix-trie row; there is no padded forward to fall back to). Refuses, before the first
    step, a model whose layers a packed row is not exact for (`hf_rlloss.parallel.layouts`: state-space, linear
    attention, convolutions, ...) or whose attention cannot be switched; zeroes every dropout it has, logged (TRL's
    async trainer has no `disable_dropout`, the tree attention has no dropout, and a functional dropout left on would
    make the trained policy differ from the one whose log-probs the loss uses)."""
    layouts = model_layouts(lm)
    if not layouts.allows("shared_prefix"):
        raise ValueError(
            f"RLLossAsyncGRPOTrainer forwards every micro-batch as one packed row, which is not exact for {what} "
            f"({layouts.model_type}): {layouts.reason}. Train it with RLLossGRPOTrainer (packing='off')."
        )
    zeroed = zero_dropout(lm)  # the functional dropouts and layerdrop too (OPT, BioGPT, Seed-OSS, ...)
    if zeroed:
        logger.warning(f"{what}: dropout zeroed for the packed rows ({zeroed})")
    switch_attention(lm, name, f"RLLossAsyncGRPOTrainer: {what}")


def tree_attention_name(backend: str, device_type: str) -> str:
    """The attention implementation the packed rows use: TRL's `"tree_fa3"` (its CUDA kernel) or hf_rlloss'
    portable `"tree_sdpa"` (registered here). `"auto"` picks FA3 on CUDA when the `kernels` package is installed."""
    if backend == "auto":
        try:
            import kernels  # noqa: F401

            has_kernels = True
        except ImportError:
            has_kernels = False
        backend = "fa3" if device_type == "cuda" and has_kernels else "sdpa"
        if device_type == "cuda" and not has_kernels:
            logger.warning(
                "tree_attention='auto' on CUDA: the kernels package is not installed, so the packed rows use the "
                "portable SDPA tree attention instead of TRL's FlashAttention-3 kernel (pip install kernels)"
            )
    if backend == "fa3":
        if device_type != "cuda":
            raise ValueError(
                f"tree_attention='fa3' needs CUDA (TRL's FlashAttention-3 kernel); the device is {device_type}: use "
                "'sdpa'"
            )
        return TREE_ATTENTION
    return register_tree_attention()


@contextlib.contextmanager
def portable_async_trl(device_type: str = "cpu") -> Iterator[None]:
    """TRL's `AsyncGRPOTrainer` constructed off CUDA: its two CUDA-only calls replaced while inside the block.

    TRL's constructor registers its FlashAttention-3 tree attention (`register_tree_attention`) and asks CUDA for the
    device's name (`get_peak_flops_per_device`, for MFU). Off CUDA the first registers hf_rlloss' exact SDPA tree
    attention under TRL's name `"tree_fa3"` instead, and the second gives `None` (no MFU metric), so a stock
    `AsyncGRPOTrainer` built in the block trains on CPU. On CUDA nothing is replaced.
    """
    if device_type == "cuda":
        yield
        return
    with overridden(
        trl_async,
        register_tree_attention=lambda: register_tree_attention(TREE_ATTENTION),
        get_peak_flops_per_device=lambda accelerator, dtype: None,
    ):
        yield


@dataclass
class PackedRow:
    """One rank's packed row of a micro-batch, its inter-rank padding stripped (as TRL's `compute_loss` strips it).

    `N` forwarded tokens, `M` trained tokens (loss terms), `S` samples.
    """

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    tree_kwargs: dict[str, Any]  # TRL's tree_* layout keywords for the attention
    token_index: torch.Tensor  # (M,) packed position whose hidden state predicts each target
    labels: torch.Tensor  # (M,) the target tokens
    behavior_logprobs: torch.Tensor  # (M,) the sampler's log-probs of the targets
    advantages: torch.Tensor  # (M,)
    num_tokens: torch.Tensor  # (S,) trained tokens of each sample (the loss terms are grouped by sample)
    sample_versions: torch.Tensor | None = None  # (S,) the policy version that sampled each sample
    routed_experts: torch.Tensor | None = None  # (N, L, k) MoE routes replayed per packed position (routing_replay)


def keep_samples(row: PackedRow, keep: torch.Tensor) -> PackedRow:
    """`row` with the loss terms of the samples where `keep` `(S,)` is False taken out (their tokens are still
    forwarded, as context of the samples sharing a prefix with them, but trained on by no loss term)."""
    if bool(keep.all()):
        return row
    terms = torch.repeat_interleave(keep, row.num_tokens)  # (M,) the loss terms are grouped by sample, in order
    return dataclasses.replace(
        row,
        token_index=row.token_index[terms],
        labels=row.labels[terms],
        behavior_logprobs=row.behavior_logprobs[terms],
        advantages=row.advantages[terms],
        num_tokens=row.num_tokens[keep],
        sample_versions=None if row.sample_versions is None else row.sample_versions[keep],
    )


def packed_row(inputs: dict[str, torch.Tensor]) -> PackedRow:
    """The `PackedRow` of a rank's slice of a batch from TRL's `DataCollatorForRollout` (see its `TreeRow.pack`)."""
    mask = inputs["attention_mask"].bool()
    selected = inputs["token_index"] >= 0
    token_index = inputs["token_index"][selected]
    segment_id = inputs["segment_id"][selected]
    tree_kwargs = {
        key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
    }
    tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    # TRL's collator does not send the samples of a row; the versioned collator below does (an empty one has none)
    if "num_samples" in inputs:
        samples = int(inputs["num_samples"][0])
    else:
        samples = int(segment_id.max()) + 1 if segment_id.numel() else 0
    versions = inputs["sample_versions"][0, :samples] if "sample_versions" in inputs else None
    routes = inputs["routed_experts"][mask] if "routed_experts" in inputs else None  # (N, L, k)
    return PackedRow(
        input_ids=inputs["input_ids"][mask].unsqueeze(0),
        position_ids=inputs["position_ids"][mask].unsqueeze(0),
        tree_kwargs=tree_kwargs,
        token_index=token_index,
        labels=inputs["shift_labels"][mask][token_index],
        behavior_logprobs=inputs["old_log_probs"][selected].float(),
        advantages=inputs["advantages"][selected].float(),
        num_tokens=torch.bincount(segment_id, minlength=samples),
        sample_versions=versions,
        routed_experts=routes,
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
            routes = getattr(counting.last, "routed_experts", None)  # MoE routing replay (async_/routing.py)
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

    def __init__(self, trainer: RLLossAsyncGRPOTrainer):
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


@dataclass
class _VersionedCollator(DataCollatorForRollout):
    """TRL's collator, also sending each row's sample count (`num_samples`), the policy version of each of its
    samples (`sample_versions`, padded with -1): the trainer measures their lag when it trains them, and on every row
    the group ids of the whole micro-batch (`micro_batch_groups`, padded with -1): every rank counts the prompts
    trained (the rollout state of a checkpoint)."""

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        batch = super().torch_call(examples)
        (rows,) = examples
        batch["num_samples"] = torch.tensor([len(row.samples) for row in rows])
        width = max(1, max(len(row.samples) for row in rows))
        versions = torch.full((len(rows), width), -1, dtype=torch.long)
        for r, row in enumerate(rows):
            for i, sample in enumerate(row.samples):
                versions[r, i] = int(sample.get("model_version", -1))
        batch["sample_versions"] = versions
        groups = sorted({int(sample["group_id"]) for row in rows for sample in row.samples})
        batch["micro_batch_groups"] = torch.tensor([groups or [-1]] * len(rows), dtype=torch.long)
        mask = batch["attention_mask"].bool()
        ids = [batch["input_ids"][r][mask[r]] for r in range(len(rows))]
        routes = collate_routes(rows, ids, mask.shape[1], self.metrics)  # MoE routing replay: (R, N, L, k)
        if routes is not None:
            batch["routed_experts"] = routes
        return batch


class RLLossAsyncGRPOTrainer(AsyncRoutingReplay, LossLayerForwards, AsyncGRPOTrainer):
    r"""
    TRL's [`~trl.experimental.async_grpo.AsyncGRPOTrainer`] (rollout worker and queue, staleness filter, weight sync,
    prefix-trie packing unchanged) whose loss is the hf_rlloss loss layer, configured by `args.rl_loss` as in
    `RLLossGRPOTrainer`, with the decoupled objective for stale samples (see the module docstring and docs/async.md).

    Example (CPU, no vLLM: the rollout worker generates with HF `generate` in its own process):

    ```python
    >>> from hf_rlloss import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
    >>> from hf_rlloss.trainer.async_.cpu_rollout import HFGenerateRolloutWorker, QueueWeightTransfer

    >>> args = RLLossAsyncGRPOConfig("out", use_cpu=True, bf16=False, max_staleness=2, token_budget=512,
    ...                              rl_loss={"rollout_is": {"level": "token", "upper": 2.0}})
    >>> worker = HFGenerateRolloutWorker("path/to/model", dataset, [reward_fn], tokenizer, args)
    >>> trainer = RLLossAsyncGRPOTrainer("path/to/model", [reward_fn], args, dataset, tokenizer,
    ...                                  rollout_worker=worker, weight_transfer=QueueWeightTransfer(worker))
    >>> trainer.train()
    ```

    Args:
        model (`str`): the policy's path or Hub id (TRL's async trainer loads it itself, with tree attention).
        args ([`RLLossAsyncGRPOConfig`], *optional*): the training arguments, with the `rl_loss` block.
        reward_funcs, train_dataset, processing_class, callbacks, optimizers (*optional*):
            As in TRL's `AsyncGRPOTrainer`.
        peft_config, tools, environment_factory, rollout_worker, weight_transfer (*optional*):
            As in TRL's `AsyncGRPOTrainer`.
        ref_model (`str` or [`~transformers.PreTrainedModel`], *optional*): the reference of
            `rl_loss.use_kl_loss`; defaults to the model loaded again from `model` (the base model under PEFT).
    """

    _tag_names = ["trl", "async-grpo", "hf-rlloss"]

    def __init__(
        self,
        model: str,
        reward_funcs: Any = None,
        args: RLLossAsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: Any = None,
        environment_factory: Any = None,
        rollout_worker: Any = None,
        weight_transfer: Any = None,
        ref_model: Any = None,
    ):
        if args is None:
            args = RLLossAsyncGRPOConfig(f"{str(model).split('/')[-1]}-AsyncGRPO")
        if not isinstance(args, RLLossAsyncGRPOConfig):
            raise TypeError(
                f"RLLossAsyncGRPOTrainer needs an RLLossAsyncGRPOConfig (got {type(args).__name__}): its rl_loss "
                "field configures the loss"
            )
        self.rl_loss_config: BaseRLLossConfig = args.rl_loss_config
        if rollout_worker is not None and (tools or environment_factory):
            raise ValueError(
                "tools/environment_factory with a rollout_worker: the worker runs the conversations, so pass them to "
                f"the rollout worker ({type(rollout_worker).__name__}(..., tools=[...], environment_factory=...)) "
                "instead of the trainer"
            )
        _check_worker_logprobs(rollout_worker)
        self._check_routes_source(args.routing_replay, rollout_worker)
        reference = reference_source(model, ref_model, peft_config, self.rl_loss_config.use_kl_loss)
        with portable_async_trl("cpu" if args.use_cpu or not torch.cuda.is_available() else "cuda"):
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
                peft_config=peft_config,
                tools=tools,
                environment_factory=environment_factory,
                rollout_worker=rollout_worker,
                weight_transfer=weight_transfer,
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        # TRL loaded the model with its FA3 kernel's name; the portable attention gets a name of its own, so that a
        # stock trainer built later in the process (which re-registers "tree_fa3") cannot swap it back.
        self._attn_implementation = tree_attention_name(args.tree_attention, self.accelerator.device.type)
        use_tree_attention(causal_lm(unwrapped), self._attn_implementation, "the policy")
        self.rl_loss_config = with_model_softcapping(self.rl_loss_config, causal_lm(unwrapped))
        check_model_supported(unwrapped, self.rl_loss_config.logit_softcapping)
        self._loss_temperature = self.temperature / logit_scale(unwrapped.config.get_text_config())
        self._forward_redirection = _ForwardRedirection()
        self.sp_mesh = None
        self._rl_pending: deque[BaseRLLossContext] = deque()
        self._rl_stash: deque[tuple[list, list[BaseRLLossContext]]] = deque()  # the batch's later mini-batches
        self._rl_step_metrics: dict[str, Any] = {}
        self._truncation = (
            replay_warpers(args.top_k, args.top_p, args.min_p) if args.rollout_logprobs_support == "sampled" else None
        )
        self.ref_model = self._build_reference(reference)
        self._rl_trained_groups: set[int] = set()  # the worker's group ids trained by the optimizer steps
        # a resumed run's cold sync: "skip" (the worker resumes with its saved policy versions), "resend" (the
        # checkpoint's weights, as the saved version), None (a new version)
        self._rl_resumed_weights: str | None = None
        self._rl_pull_plan = (0, 0, args.gradient_accumulation_steps)  # (step, first micro-batch, per step)
        self._rl_consumed = 0
        self._rl_empty_run = 0
        self._rl_empty_step = False
        if rollout_worker is not None and getattr(rollout_worker, "weight_lag", 0):
            check_weight_lag(rollout_worker.weight_lag, args)
        self.add_callback(_SkipEmptyStep(self))
        if self.accelerator.is_main_process:
            rollout_resume.check_fixed_lag_setup(rollout_worker, weight_transfer, args, self.accelerator.num_processes)
        reference_lm = None if self.ref_model is None else causal_lm(self.accelerator.unwrap_model(self.ref_model))
        self._setup_routing_replay(args.routing_replay, causal_lm(unwrapped), reference_lm)

    def _build_reference(self, source: Any) -> nn.Module | None:
        """The reference model (`None` without KL, or when it is the policy with its adapter disabled)."""
        if source is None or source == "adapter":
            return None
        if isinstance(source, str):
            source = load_reference(source, self.args, {"dtype": self.args.dtype}, {"device_map": None})
        use_tree_attention(causal_lm(source), self._attn_implementation, "the reference model")
        check_model_supported(source, self.rl_loss_config.logit_softcapping)
        return prepare_reference(source, self)

    # ------------------------------------------------------------------------------------------------------------
    # TRL's data path, with the samples' policy versions

    def get_train_dataloader(self):
        """TRL's dataloader, its dataset and collator swapped for the versioned ones (same samples, same rows)."""
        with overridden(
            trl_async,
            RolloutQueueDataset=_VersionedDataset,
            DataCollatorForRollout=_VersionedCollator,
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

    def _sync_weight(self):
        """TRL's weight sync; the policy version is also counted on the ranks other than the main process (TRL counts
        it there only), as every rank measures the lag of the samples it trains.

        The cold sync of a resumed run: skipped when the worker resumes with its saved policy versions (`fixed_lag`:
        it has the last version sent); otherwise it sends the checkpoint's weights as the version they already are
        (the saved `model_version`, the one the last sync before the save sent), not as a new one: TRL's bump after
        the send is compensated, so the counter continues the interrupted run's exactly."""
        resumed, self._rl_resumed_weights = self._rl_resumed_weights, None
        if resumed == "skip":
            return
        if resumed == "resend":
            self.model_version -= 1  # TRL's sync tags the weights model_version + 1, then bumps the counter to it
            if self.accelerator.is_main_process and self.rollout_worker is not None:
                self.rollout_worker.update_model_version(self.model_version)
        super()._sync_weight()
        if not self.accelerator.is_main_process:
            self.model_version += 1

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints: the rollout state of hf_rlloss' workers (async_/resume.py)

    def _save_checkpoint(self, model, trial):
        if self.accelerator.is_main_process and rollout_resume.resumable(self.rollout_worker):
            checkpoint_dir = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            rollout_resume.save_rollout_state(
                checkpoint_dir, self.rollout_worker, self.weight_transfer, self._rl_trained_groups, self.model_version
            )
        super()._save_checkpoint(model, trial)

    def _inner_training_loop(self, *args, **kwargs):
        """Before TRL's loop (whose train-begin callback syncs the weights, then starts the worker): restore the
        rollout state of the checkpoint resumed from, on every rank (the version counter) and in the worker."""
        self._rl_trained_groups = set()
        self._rl_resumed_weights = None
        self._rl_pull_plan = (self.state.global_step, 0, self.args.gradient_accumulation_steps)
        self._rl_consumed = 0  # micro-batches taken from the dataloader (the planner's count, on the main process)
        self._rl_empty_run = 0  # consecutive optimizer steps without a trained token
        self._rl_empty_step = False
        checkpoint = kwargs.get("resume_from_checkpoint")
        worker = self.rollout_worker if self.accelerator.is_main_process else None
        if checkpoint is not None and (worker is None or rollout_resume.resumable(worker)):
            state = rollout_resume.load_rollout_state(checkpoint)
            if state is not None:
                self.model_version = int(state["model_version"])
                self._groups_before_resume = int(state["prompt_index"])
                self._rl_resumed_weights = "skip" if state.get("rollout_weights") else "resend"
                if worker is not None:
                    rollout_resume.restore_rollout(state, checkpoint, worker, self.weight_transfer)
        return super()._inner_training_loop(*args, **kwargs)

    # ------------------------------------------------------------------------------------------------------------
    # Optimizer steps: every micro-batch's context built and normalized before the first backward

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Trainer override: also build the loss contexts of the optimizer step's micro-batches (π_old and reference
        log-probs from no-grad passes, rollout IS), normalized together over all ranks.

        With `num_mini_batches` > 1 the first step of a batch takes `num_mini_batches` steps' worth of micro-batches,
        builds all their contexts with the current weights (π_old), and the next steps train the stashed rest.
        One staleness rule: a sample is trained only if `trained at − sampled by <= max_staleness` in policy
        versions. TRL's filter applies it when the sample is pulled, with the version its micro-batch will be trained
        at (`_version_at_pull`); it is checked again here (`_fresh_enough`), where the only samples it can still drop
        are those a token-budget micro-batch pushed into the next one (see `_CountingTokenBudgetBatcher`).

        An optimizer step with no trained token on any rank (every sample dropped as too stale, or every completion
        empty) is not taken (`_SkipEmptyStep`: its zero gradient would still move the parameters through Adam's
        momentum), and is counted in `async/skipped_empty_steps_total`; `max_consecutive_empty_steps` of them in a row
        stop training with `NoTrainableSamplesError`.
        """
        if not self._rl_stash:
            n = self.args.num_mini_batches
            self._rl_pull_plan = (self.state.global_step, self._rl_consumed, num_batches)
            batches, _ = super().get_batch_samples(epoch_iterator, num_batches * n, device)
            self._rl_consumed += len(batches)
            if not batches:
                return batches, None
            groups = [batches[i : i + num_batches] for i in range(0, len(batches), num_batches)]
            metrics: dict[str, list] = {"lag": [], "dropped": []}
            rows = [
                [self._fresh_enough(packed_row(batch), self._version_at(j), metrics) for batch in group]
                for j, group in enumerate(groups)
            ]
            tokens = self._trained_tokens(rows)
            for group, group_rows, group_tokens in zip(groups, rows, tokens):
                contexts = [self.build_loss_context(row, i) for i, row in enumerate(group_rows)]
                type(contexts[0]).build_batches(contexts, grad_averaging_size=self.accelerator.num_processes)
                self._rl_stash.append((group, contexts, group_tokens, metrics["dropped"]))
            self._log_lags(metrics)
        batches, contexts, tokens, dropped = self._rl_stash.popleft()
        self._check_progress(tokens, dropped)
        for batch in batches:
            groups = batch["micro_batch_groups"][0]
            self._rl_trained_groups.update(groups[groups >= 0].tolist())
        self._rl_pending = deque(contexts)
        self._rl_step_metrics = {}
        return batches, None

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

    def build_loss_data(self, row: PackedRow) -> dict[str, Any]:
        """The data of one micro-batch given to `rl_loss_config.build`: its loss terms as one packed row `(1, M)`
        (`num_tokens` per sample), the sampler's log-probs as π_behavior, or as π_old under `behavior_as_old_policy`,
        and the reference's log-probs for the KL."""
        data: dict[str, Any] = {
            "shifted_labels": row.labels.unsqueeze(0),
            "advantages": row.advantages.unsqueeze(0),
            "num_tokens": row.num_tokens,
        }
        behavior = row.behavior_logprobs.unsqueeze(0)
        missing = int((~torch.isfinite(behavior)).sum())
        if missing:
            raise ValueError(
                f"the sampler's log-probs of {missing} trained tokens of this micro-batch are missing (non-finite): "
                "they are π_behavior (rollout IS, the mismatch metrics) or, with behavior_as_old_policy, π_old, and "
                "the loss layer would drop every such token. Make the rollout worker record them "
                "(HFGenerateRolloutWorker(record_logprobs=True); vLLM reports them)"
            )
        if self.args.behavior_as_old_policy:
            data["old_logprobs"] = behavior
        else:
            data["rollout_logprobs"] = behavior
            old = self._no_grad_logprobs(self.model, row, self._truncation, role="old")
            if self._truncation is None:
                data["old_logprobs"] = old.unsqueeze(0)
            else:
                data["old_logprobs"], data["old_kept_logmass"] = (t.unsqueeze(0) for t in old.unbind(-1))
        if self.rl_loss_config.use_kl_loss:
            data["ref_logprobs"] = self._reference_logprobs(row).unsqueeze(0)
        return data

    def build_loss_context(self, row: PackedRow, micro_batch: int) -> BaseRLLossContext:
        """The loss context of one micro-batch (before `build_batches`); in the decoupled objective rollout IS (and
        the mismatch metrics) compare π_old with π_behavior."""
        ctx = self.rl_loss_config.build(self.build_loss_data(row), micro_batch=micro_batch)
        if ctx.loss_kwargs.rollout_logprobs is not None and ctx.loss_kwargs.old_logprobs is not None:
            ctx.compute_rollout_is()
        ctx.packed_row = row
        return ctx

    # ------------------------------------------------------------------------------------------------------------
    # Forwards of packed rows

    def tree_hidden_states(self, unwrapped: nn.Module, row: PackedRow, output_router_logits: bool = False):
        """`(1, M, H)`: the backbone's last hidden states at the row's loss terms (`token_index`); with
        `output_router_logits`, also the MoE routers' logits over the row's forwarded tokens."""
        backbone = causal_lm(unwrapped).base_model
        router = {"output_router_logits": True} if output_router_logits else {}
        with self.accelerator.autocast():
            out = backbone(
                input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False, **router, **row.tree_kwargs
            )
        hidden = out.last_hidden_state[:, row.token_index]
        return (hidden, out.router_logits) if output_router_logits else hidden

    @torch.no_grad()
    def _no_grad_logprobs(self, model: nn.Module, row: PackedRow, truncation=None, role="reference") -> torch.Tensor:
        """`(M,)` float32 log-probs of the row's targets under `model` (`(M, 2)` with the kept log-mass under
        `truncation`), without gradient and without activation checkpointing; `role` (`"old"`: the π_old pass, or
        `"reference"`) says what an MoE model's routers replay (`AsyncRoutingReplay._routed_pass`)."""

        def forward(unwrapped):
            hidden = self.tree_hidden_states(unwrapped, row)[0]
            valid = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
            return self._valid_logps(unwrapped, hidden, row.labels, valid, truncation)

        with activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs):
            with self._routed_pass(row, role):
                out = self._call_through_wrapper(model, forward)
        return out[:, 0] if truncation is None else out

    def _reference_logprobs(self, row: PackedRow) -> torch.Tensor:
        if self.ref_model is not None:
            return self._no_grad_logprobs(self.ref_model, row)
        peft_model = self.accelerator.unwrap_model(self.model)
        with use_adapter(peft_model, adapter_name=None):
            return self._no_grad_logprobs(self.model, row)

    def _packed_loss(self, unwrapped: nn.Module, ctx: BaseRLLossContext):
        """The micro-batch's `(loss, metrics)`; for an MoE policy whose router loss is trained (`aux_loss_enabled`,
        as TRL's async trainer) plus `router_aux_loss_coef` × the model's own load-balancing loss over the packed
        row's forwarded tokens (TRL's `aux_loss` over the same row)."""
        with self._routed_pass(ctx.packed_row, "loss", count=True):  # MoE routing replay
            out = self.tree_hidden_states(unwrapped, ctx.packed_row, output_router_logits=self.aux_loss_enabled)
        hidden, router_logits = out if self.aux_loss_enabled else (out, None)
        loss, metrics = self._head_loss(unwrapped, hidden, ctx)
        metrics = {**metrics, **self._routing_loss_metrics(loss.device)}
        if not self.aux_loss_enabled:
            return loss, metrics
        lm = causal_lm(unwrapped)
        aux_loss = load_balancing_loss_func(lm)(router_logits, lm.num_experts, lm.num_experts_per_tok, None)
        return self._add_router_aux_loss(loss, metrics, aux_loss, "train")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL override: the loss layer's loss of this micro-batch, from the context `get_batch_samples` built."""
        if not self._rl_pending:
            raise RuntimeError("compute_loss without a prepared loss context: get_batch_samples builds them per step")
        ctx = self._rl_pending.popleft()
        start = time.perf_counter()
        loss, metrics = self._call_through_wrapper(model, self._packed_loss, ctx)
        self._step_forward_s += time.perf_counter() - start  # TRL's perf/fwd_s
        self._rl_step_metrics = accumulate_metrics(self._rl_step_metrics, metrics)
        if not self._rl_pending:  # the step's last micro-batch: reduce its metrics over the ranks
            for key, value in finalize_train_policy_metrics(self._rl_step_metrics, device=loss.device).items():
                self._metrics["train"][key].append(float(value))
            self._rl_step_metrics = {}
        self._count_step_tokens(inputs)
        if self.accelerator.distributed_type != "DEEPSPEED":
            loss = loss * self.accelerator.gradient_accumulation_steps  # cancels accelerator.backward's division
        return loss

    def _count_step_tokens(self, inputs: dict[str, torch.Tensor]) -> None:
        """TRL's per-step token accounting (its `perf/*` and `batch/*_per_step` metrics read it)."""
        forward_tokens = float(inputs["global_n_forward_tokens"][0])
        mean_seq_len = float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += forward_tokens
        self._step_trained_tokens += float(inputs["global_n_tokens"][0])
        self._step_seq_len_weighted += mean_seq_len * forward_tokens
        self._step_samples += forward_tokens / mean_seq_len


def _check_worker_logprobs(worker: Any) -> None:
    """Refuse a rollout worker that says it records no log-probs of its samples: every objective of this trainer
    needs them (π_behavior, or π_old under `behavior_as_old_policy`)."""
    if worker is not None and getattr(worker, "records_logprobs", True) is False:
        raise ValueError(
            "RLLossAsyncGRPOTrainer needs the sampler's log-probs of every trained token (π_behavior for rollout IS "
            "and the mismatch metrics, or π_old with behavior_as_old_policy), but the rollout worker records none "
            f"({type(worker).__name__}.records_logprobs is False): build it with record_logprobs=True"
        )
