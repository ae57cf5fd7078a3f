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
  logits). The row's format is `async_/packed_rows.py`'s; its attention, TRL's FA3 tree kernel or the portable SDPA
  one, `async_/attention.py`'s.
* **Staleness when trained.** `max_staleness` bounds the lag a sample has when it is trained (the dataloader's
  prefetch adds a version to the lag at pull): TRL's filter is given the version the sample's micro-batch will be
  trained at (`_version_at_pull`), and `get_batch_samples` checks again with the same comparison. A step with no
  trained token takes no optimizer step (`async/skipped_empty_steps_total`); `max_consecutive_empty_steps` of them,
  or as many steps' worth of samples too stale, stop training (`NoTrainableSamplesError`). The whole rule is
  `async_/staleness.py`'s (`AsyncStaleness`). `num_mini_batches` trains a batch in several optimizer steps against
  one π_old (AReaL's mini-batches), so that the PPO clip binds.
* **Resume** with hf_rlloss' rollout workers: the prompt position and the policy version counter are saved in the
  checkpoint and restored before the worker starts (`async_/resume.py`; TRL restores them for its own worker only).
* **Metrics**: the loss layer's (`train_policy/*`, `mismatch/*`, `rollout_is/*`), plus `async/version_lag_mean`,
  `async/version_lag_max` (policy versions between a trained sample's sampler and the trainer, when it is trained)
  and `async/dropped_stale_frac` (the share of samples pulled from the queue that were dropped as too stale, when
  pulled or when trained). The MoE router loss is added as in TRL's async trainer.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import torch
import trl.experimental.async_grpo.async_grpo_trainer as trl_async
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.models.utils import _ForwardRedirection
from trl.trainer.utils import use_adapter

from ..loss.config import BaseRLLossConfig
from ..loss.context import BaseRLLossContext
from ..loss.metrics import accumulate_metrics, finalize_train_policy_metrics
from .async_ import resume as rollout_resume
from .async_.attention import portable_async_trl, tree_attention_name, use_tree_attention
from .async_.packed_rows import PackedRow, VersionedCollator, packed_row
from .async_.routing_replay import AsyncRoutingReplay
from .async_.staleness import AsyncStaleness, NoTrainableSamplesError, check_fixed_lag_setup
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


class RLLossAsyncGRPOTrainer(AsyncStaleness, AsyncRoutingReplay, LossLayerForwards, AsyncGRPOTrainer):
    r"""
    TRL's [`~trl.experimental.async_grpo.AsyncGRPOTrainer`] (rollout worker and queue, staleness filter, weight sync,
    prefix-trie packing unchanged) whose loss is the hf_rlloss loss layer, configured by `args.rl_loss` as in
    `RLLossGRPOTrainer`, with the decoupled objective for stale samples (see the module docstring and docs/async.md).

    Example (CPU, no vLLM: the rollout worker generates with HF `generate` in its own process):

    ```python
    >>> from hf_rlloss import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
    >>> from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker, QueueWeightTransfer

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
        self._reset_run_counters()
        self._setup_staleness(rollout_worker)
        if self.accelerator.is_main_process:
            check_fixed_lag_setup(rollout_worker, weight_transfer, args, self.accelerator.num_processes)
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
        """TRL override: TRL's dataloader with the versioned collator (`async_/packed_rows.py`: the same rows, with
        each sample's policy version and group), and the counting dataset and planners of `AsyncStaleness`."""
        with overridden(trl_async, DataCollatorForRollout=VersionedCollator):
            return super().get_train_dataloader()

    def _reset_run_counters(self) -> None:
        """The counters of a training run, at construction and at the start of every training loop: the staleness
        rule's (`AsyncStaleness`), the prompt groups trained (a checkpoint's rollout state) and the cold sync's."""
        self._reset_staleness()
        self._rl_trained_groups: set[int] = set()  # the worker's group ids trained by the optimizer steps
        # a resumed run's cold sync: "skip" (the worker resumes with its saved policy versions), "resend" (the
        # checkpoint's weights, as the saved version), None (a new version)
        self._rl_resumed_weights: str | None = None

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
        self._reset_run_counters()
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
        The staleness rule (`AsyncStaleness`) takes out the samples too old when their step trains them
        (`_trainable_rows`), and marks a step without a trained token on any rank to take no optimizer step, or stops
        training after too many such steps in a row (`_check_progress`).
        """
        if not self._rl_stash:
            batches = self._pull_batches(epoch_iterator, num_batches, device)
            if not batches:
                return batches, None
            groups = [batches[i : i + num_batches] for i in range(0, len(batches), num_batches)]
            rows, tokens, dropped = self._trainable_rows(groups)
            for group, group_rows, group_tokens in zip(groups, rows, tokens):
                contexts = [self.build_loss_context(row, i) for i, row in enumerate(group_rows)]
                type(contexts[0]).build_batches(contexts, grad_averaging_size=self.accelerator.num_processes)
                self._rl_stash.append((group, contexts, group_tokens, dropped))
        batches, contexts, tokens, dropped = self._rl_stash.popleft()
        self._check_progress(tokens, dropped)
        for batch in batches:
            groups = batch["micro_batch_groups"][0]
            self._rl_trained_groups.update(groups[groups >= 0].tolist())
        self._rl_pending = deque(contexts)
        self._rl_step_metrics = {}
        return batches, None

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
