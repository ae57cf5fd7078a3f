"""`RLLossGRPOTrainer`: TRL's `GRPOTrainer` with its loss replaced by the hf_rlloss loss layer.

Generation, rewards, advantages, logging, checkpoints, PEFT and the model card are TRL's; what changes is how the loss
of an optimizer step is computed. The design (per-step normalization, log-probs, engines, sequence parallelism) is
described in `docs/design.md`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging
from trl import GRPOTrainer
from trl.models.utils import _ForwardRedirection
from trl.trainer.callbacks import SyncRefModelCallback

from ..loss.config import BaseRLLossConfig
from ..loss.context import BaseRLLossContext
from ..loss.fields import FROM_TRL
from ..loss.metrics import finalize_step_metrics
from ..parallel.layouts import model_layouts, zero_dropout
from ..parallel.packed_attention import use_packed_attention
from ..parallel.ulysses import ulysses_sequence_parallel, use_ulysses_attention
from .common.engines import activation_checkpointing_disabled, load_reference, prepare_reference, reference_source
from .common.forwards import LossLayerForwards
from .common.lm_head import (
    causal_lm,
    check_model_supported,
    load_balancing_loss_func,
    logit_scale,
    with_model_softcapping,
)
from .common.multimodal import SP_REFUSAL
from .common.overrides import overridden, trl_deprecated_aliases_silenced
from .common.packing import packing_for_device, prepare_packing
from .common.routing_replay import RoutingReplayTrainer
from .common.sp_batch import pool_over_group
from .grpo_config import RLLossGRPOConfig
from .sync.checkpoints import CompleteCheckpoints
from .sync.dynamic_sampling import DynamicSampling
from .sync.nonfinite_guard import NonFiniteGradGuard
from .sync.old_logprobs import OldLogprobs
from .sync.saving import ModelSaving
from .sync.sequence_parallel import SequenceParallelBatches
from .sync.vllm import check_vllm_logprobs_mode, prepare_vllm_engine

__all__ = ["RLLossGRPOConfig", "RLLossGRPOTrainer"]

logger = logging.get_logger(__name__)


def trl_is_ratio_per_token(ratio: torch.Tensor, labels: torch.Tensor, ignore_idx: int, absorbs: bool) -> torch.Tensor:
    """`(B, C)` rollout IS weights from TRL's `importance_sampling_ratio` (`(B, C)` or sequence-level `(B, 1)`).

    A sequence-level ratio enters a loss that absorbs the IS weights (VESPO: `Σ_t log w`) once: it is put on each
    sequence's first valid token, 1 elsewhere; otherwise it is broadcast over the tokens.
    """
    if ratio.shape[-1] == 1 and absorbs:
        valid = labels != ignore_idx
        first = valid & (valid.long().cumsum(dim=1) == 1)
        return torch.where(first, ratio, torch.ones_like(ratio))
    return ratio.expand_as(labels)


def adapted_entropy_coef(coef: float, entropy: float, args: RLLossGRPOConfig) -> float:
    """TRL's adaptive entropy control (Skywork-OR1): move the coefficient by `entropy_coef_delta` towards more bonus
    when the step's entropy is at or below `entropy_target`, less otherwise, within `[entropy_coef_min, _max]`."""
    if entropy <= args.entropy_target:
        return min(coef + args.entropy_coef_delta, args.entropy_coef_max)
    return max(coef - args.entropy_coef_delta, args.entropy_coef_min)


class RLLossGRPOTrainer(
    CompleteCheckpoints,
    NonFiniteGradGuard,
    ModelSaving,
    SequenceParallelBatches,
    OldLogprobs,
    RoutingReplayTrainer,
    LossLayerForwards,
    DynamicSampling,
    GRPOTrainer,
):
    r"""
    Trainer for GRPO whose loss is computed by the hf_rlloss loss layer: TRL's [`~trl.GRPOTrainer`] with generation,
    rewards, advantages, PEFT, logging and checkpoints unchanged, and each optimizer update the gradient of the loss
    configured by `args.rl_loss` (policy loss, KL, rollout importance sampling, aggregation), normalized over all the
    micro-batches and ranks of the step. Sequence parallelism (`args.sp_size`), DDP, FSDP2 and DeepSpeed ZeRO are
    supported; how, and how the normalization differs from TRL's, is in `docs/design.md`.

    Example:

    ```python
    >>> from datasets import Dataset
    >>> from hf_rlloss import RLLossGRPOConfig, RLLossGRPOTrainer

    >>> dataset = Dataset.from_dict({"prompt": ["What is 2 + 3?", "What is 7 + 5?"] * 8})

    >>> def reward_short(completions, **kwargs):
    ...     return [-float(len(completion)) for completion in completions]

    >>> args = RLLossGRPOConfig(
    ...     output_dir="grpo-out",
    ...     rl_loss={
    ...         "policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
    ...         "loss_agg_mode": "token-mean",
    ...         "use_kl_loss": True,
    ...         "kl_loss_type": "k3",
    ...         "kl_loss_coef": 0.001,
    ...     },
    ... )
    >>> trainer = RLLossGRPOTrainer(
    ...     model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=reward_short, args=args, train_dataset=dataset
    ... )
    >>> trainer.train()
    ```

    Args:
        model (`str`, [`~transformers.PreTrainedModel`] or [`~peft.PeftModel`]):
            The policy: a model id or path (loaded with `args.model_init_kwargs`), or a causal language model whose
            backbone (`base_model`) and plain `nn.Linear` LM head the loss layer reads. Vision-language models, an
            LM head with a bias and softcapping together with a logit scale are rejected.
        reward_funcs (`RewardFunc` or `list[RewardFunc]`, *optional*):
            As in TRL: reward functions, reward model ids or models, summed with `args.reward_weights`.
        args ([`RLLossGRPOConfig`], *optional*):
            The configuration; its `rl_loss` configures the loss (without it, TRL's loss options are mapped onto
            it). Defaults to `RLLossGRPOConfig` named after the model.
        train_dataset ([`~datasets.Dataset`] or [`~datasets.IterableDataset`], *optional*):
            Prompts (a `"prompt"` column), as in TRL.
        eval_dataset ([`~datasets.Dataset`] or `dict[str, Dataset]`, *optional*):
            Evaluation prompts; `eval_loss` is the loss of each evaluation batch over all ranks, averaged.
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`], *optional*):
            The tokenizer (left padding), as in TRL.
        reward_processing_classes (`PreTrainedTokenizerBase` or `list[PreTrainedTokenizerBase]`, *optional*):
            Tokenizers of reward models, as in TRL.
        callbacks (`list[TrainerCallback]`, *optional*):
            Extra callbacks, as in TRL.
        optimizers (`tuple[Optimizer, LambdaLR]`, *optional*, defaults to `(None, None)`):
            Optimizer and scheduler, as in TRL.
        quantization_config, peft_config, tools, rollout_func, environment_factory (*optional*):
            As in TRL. With a `peft_config` the reference is the base model (the adapter disabled).
        ref_model (`str` or [`~transformers.PreTrainedModel`], *optional*):
            The reference model of `rl_loss.use_kl_loss` (a model or a path). Defaults to the policy with its adapter
            disabled under PEFT, else the model loaded from the policy's path, else a copy of the in-memory policy
            taken before training (sharded under ZeRO-3). An error when `use_kl_loss` is false.

    Subclassing: override `build_loss_data` to add keys to the data given to `rl_loss_config.build` (or
    `build_loss_context` to modify the context), set `RLLossGRPOConfig.loss_config_class` to use another loss
    configuration class, and `compute_hidden_states` / `get_head_weight` for models with an unusual layout.
    """

    _tag_names = ["trl", "grpo", "hf-rlloss"]

    def __init__(
        self,
        model: str | PreTrainedModel | nn.Module,
        reward_funcs: Any = None,
        args: RLLossGRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
        ref_model: str | PreTrainedModel | None = None,
    ):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = RLLossGRPOConfig(f"{name.split('/')[-1]}-GRPO")
        if not isinstance(args, RLLossGRPOConfig):
            raise TypeError(
                f"RLLossGRPOTrainer needs an RLLossGRPOConfig (got {type(args).__name__}): its rl_loss field "
                "configures the loss"
            )
        self.rl_loss_config: BaseRLLossConfig = args.rl_loss_config
        reference = reference_source(model, ref_model, peft_config, self.rl_loss_config.use_kl_loss)
        prepare_vllm_engine(args)  # before TRL builds a colocated engine (see sync/vllm.py)

        # TRL override: TRL must neither build a reference model (it would reload it from `config._name_or_path`,
        # which fails for in-memory models) nor compute reference log-probs: the KL is the loss layer's.
        with overridden(args, beta=0.0, sync_ref_model=False), trl_deprecated_aliases_silenced():
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                reward_processing_classes=reward_processing_classes,
                callbacks=callbacks,
                optimizers=optimizers,
                quantization_config=quantization_config,
                peft_config=peft_config,
                tools=tools,
                rollout_func=rollout_func,
                environment_factory=environment_factory,
            )
        self.beta = 0.0  # TRL's KL stays off; see rl_loss_config.use_kl_loss

        if self._is_vlm and args.sp_size > 1:  # VLM: see hf_rlloss/trainer/common/multimodal.py
            raise ValueError(SP_REFUSAL)
        self._setup_loss_layer(args, reference)
        check_vllm_logprobs_mode(self, self.rl_loss_config.rollout_is.enabled)

    # ------------------------------------------------------------------------------------------------------------
    # Setup

    def _setup_loss_layer(self, args: RLLossGRPOConfig, reference: Any) -> None:
        """Check the policy, read its head's settings, and build the state of the loss, SP and the reference."""
        if self.aux_loss_enabled and args.sp_size > 1:
            raise ValueError(
                f"sp_size={args.sp_size}: the MoE router load-balancing loss is a product of means over all tokens "
                "of a micro-batch, which one SP shard does not see; set router_aux_loss_coef=0.0 to train without it"
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        self.rl_loss_config = with_model_softcapping(self.rl_loss_config, self._causal_lm(unwrapped))
        check_model_supported(unwrapped, self.rl_loss_config.logit_softcapping)
        if self.aux_loss_enabled:
            load_balancing_loss_func(self._causal_lm(unwrapped))  # fails now, not at the first step
        self._loss_temperature = self.temperature / logit_scale(unwrapped.config.get_text_config())

        self._forward_redirection = _ForwardRedirection()
        self._rl_pending: deque[BaseRLLossContext] = deque()
        self._rl_step_remaining = 0  # micro-batches of the current optimizer step without a context yet
        self._rl_step_size = 0
        self._rl_step_metrics: list[dict[str, Any]] = []  # the metrics of each micro-batch of the step so far
        self._rl_micro_batch: int | None = None  # index in the optimizer step of the context being built
        self.sp_mesh = None
        self._setup_old_logprobs()
        self._setup_padded_forward(args, self._causal_lm(unwrapped))
        if args.sp_size > 1:
            self._setup_sequence_parallel(unwrapped)
        self._setup_packing(args, unwrapped)
        self.ref_model = self._build_reference(reference)
        self._setup_routing_replay(unwrapped)  # MoE: see common/routing_replay.py
        self._setup_dynamic_sampling()
        if args.sync_ref_model:
            if not self.rl_loss_config.use_kl_loss:
                raise ValueError("sync_ref_model=True needs a reference: set rl_loss.use_kl_loss=true")
            if self.ref_model is None:
                raise NotImplementedError("sync_ref_model=True is not supported with PEFT (the reference is the base)")
            self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))

    def _build_reference(self, source: Any) -> nn.Module | None:
        """The reference model from `reference_source`'s answer (`None` when it is the policy's adapter)."""
        if source is None or source == "adapter":
            return None
        if isinstance(source, str):
            # FSDP too: by now the state says FSDP (not MULTI_GPU), and "auto" would spread each rank's copy over
            # every GPU; `fully_shard` moves the CPU-loaded model to the rank's device.
            distributed = self.args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED", "FSDP"]
            defaults = {"dtype": self.model.dtype, "attn_implementation": self.model.config._attn_implementation}
            source = load_reference(source, self.args, defaults, {"device_map": None} if distributed else {})
        check_model_supported(source, self.rl_loss_config.logit_softcapping)
        if self.sp_mesh is not None:
            reference = causal_lm(source)
            use_ulysses_attention(reference, self.args.sp_size, "the reference model", self.args.disable_dropout)
        if self._packing != "off":
            use_packed_attention(causal_lm(source))
        return prepare_reference(source, self)

    def _setup_padded_forward(self, args: RLLossGRPOConfig, lm: nn.Module) -> None:
        """What makes the padded forward exact for `lm`, before any layout is chosen. With `disable_dropout=True`
        every dropout probability is zeroed (`zero_dropout`: the functional dropouts and `layerdrop` TRL's
        `disable_dropout` leaves, logged). `self._row_aligned`: the padded forward starts each sequence at position 0
        (`right_aligned`), for a model whose layers read the row from its start (`ModelLayouts.row_start`)."""
        if getattr(args, "disable_dropout", False):
            zeroed = ", ".join(f"{where}={p}" for where, p in zero_dropout(lm).items())
            if zeroed:
                logger.warning(f"disable_dropout=True: dropout zeroed ({zeroed})")
        row_start = model_layouts(lm).row_start
        self._row_aligned = bool(row_start) and not self._is_vlm
        if self._row_aligned:
            logger.info(f"padded forwards right-aligned: each sequence from position 0 ({', '.join(row_start)})")

    def _setup_packing(self, args: RLLossGRPOConfig, unwrapped: nn.Module) -> None:
        """`self._packing`, the layout of the training forwards (`args.packing` unless it cannot be exact for this
        model, logged), and the policy on the `"tree_or_<its attention>"` attention when a layout is packed."""
        mode, reason = args.packing, None
        if mode == "auto":
            half = bool(args.bf16 or args.fp16 or getattr(unwrapped, "dtype", None) in (torch.bfloat16, torch.float16))
            mode, why = packing_for_device(self.accelerator.device, half)
            logger.info(f"packing='auto' -> {mode!r}: {why}")
        if mode == "off" or self.sp_mesh is not None:
            mode = "off"  # under SP every micro-batch is packed, as args.packing says, by _sp_layout (SPMicroBatch)
        elif self._is_vlm:
            mode, reason = "off", "a vision-language model's forward places image features by sequence"
        else:
            if self.aux_loss_enabled and mode == "shared_prefix":
                # A shared prompt would count once in the router's token means instead of G times (docs/packing.md)
                mode, reason = "padding_free", "the MoE router loss counts every row's prompt tokens, as TRL's"
            # the model's layers, attention dropout, its attention switched (hf_rlloss.parallel.layouts)
            mode, why = prepare_packing(mode, self._causal_lm(unwrapped), getattr(args, "disable_dropout", False))
            reason = why or reason
        if reason is not None:
            logger.warning(f"packing={args.packing!r} -> {mode!r}: {reason}")
        self._packing = mode

    # ------------------------------------------------------------------------------------------------------------
    # TRL override points. Each overrides the `GRPOTrainer` (or `Trainer`) method of the same name.

    def _prepare_inputs(self, generation_batch):
        # TRL override: TRL's look-ahead buffer `_buffered_inputs` holds the generation batch's micro-batches; at an
        # optimizer step's first micro-batch the contexts of the step's micro-batches are built from it together
        # (`_build_step_contexts`), and each reaches `_compute_loss` through `inputs["rl_loss_context"]`.
        dynamic = self.args.dynamic_sampling and self.model.training  # see dynamic_sampling.py
        if self.sp_mesh is None:
            inputs = (
                self._dynamic_sampling_inputs(generation_batch)
                if dynamic
                else super()._prepare_inputs(generation_batch)
            )
        else:
            with ulysses_sequence_parallel(None):  # generation and scoring: no SP attention (see training_step)
                if dynamic:
                    inputs = self._dynamic_sampling_inputs(generation_batch)
                elif self.model.training:
                    inputs = self._sp_buffered_inputs(generation_batch)
                else:
                    inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training:
            return inputs
        if not self._rl_pending:
            self._build_step_contexts()
        inputs = dict(inputs)
        inputs["rl_loss_context"] = self._rl_pending.popleft()
        inputs["rl_loss_last_micro_batch"] = not self._rl_pending and self._rl_step_remaining == 0
        return inputs

    def _generate_and_score_completions(self, inputs):
        # TRL override: adds the recorded kept mass; under SP pools the group's batch (TRL's old log-probs wait for
        # it); computes the old log-probs rollout IS needs and the reference log-probs of the loss layer's KL.
        self._recorded_kept_logmass = []  # filled by _generate_single_turn (HF generate)
        self._stashed_kept_logmass = None  # filled with the old log-probs when TRL computes them
        self._sp_old_logps = "compute" if self.sp_mesh is None else "defer"
        try:
            with trl_deprecated_aliases_silenced():
                batch = self._add_recorded_kept_logmass(super()._generate_and_score_completions(inputs))
            batch = self._routing_add_rollout_routes(batch)  # MoE routing replay: see common/routing_replay.py
            old_logps_deferred = self._sp_old_logps == "deferred"
        finally:
            self._sp_old_logps = "compute"
        if self.sp_mesh is not None:  # every rank of the SP group now holds the group's batch
            batch = pool_over_group(batch, self.sp_mesh, self._tokenizer.pad_token_id)
        self._add_old_logps(batch, old_logps_deferred)
        batch = self._routing_add_captured(batch)
        if self.rl_loss_config.use_kl_loss:
            with activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs):
                batch["ref_per_token_logps"] = self.compute_ref_per_token_logps(batch)
        return batch

    def _compute_loss(self, model, inputs):
        # TRL override: the loss of the micro-batch's context (built in `_prepare_inputs`, or here in evaluation).
        mode = "train" if self.model.training else "eval"
        ctx = inputs.get("rl_loss_context")
        if ctx is None:  # evaluation: every batch is its own step
            ctx = self.build_loss_context(inputs)
            type(ctx).build_batches([ctx], grad_averaging_size=self.accelerator.num_processes)
        if self.use_adaptive_entropy:
            # TRL's gating: the coefficient (and whether it applies) from the end of the previous optimizer step
            ctx.entropy_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        if self.aux_loss_enabled:
            loss, metrics, aux_loss = self._call_through_wrapper(
                model, self._loss_forward_with_router_aux, inputs, ctx
            )
            loss, metrics = self._add_router_aux_loss(loss, metrics, aux_loss, mode)
        else:
            loss, metrics = self._call_through_wrapper(model, self._loss_forward, inputs, ctx)
        if mode == "train":
            self._rl_step_metrics.append(metrics)
            if inputs.get("rl_loss_last_micro_batch", True):
                self._log_rl_metrics("train", self._rl_step_metrics)
                self._rl_step_metrics = []
                self._end_of_step_entropy_control()
        else:
            self._log_rl_metrics("eval", [metrics])
        if self.accelerator.distributed_type != "DEEPSPEED":
            loss = loss * self.accelerator.gradient_accumulation_steps  # cancels accelerator.backward's division
        return loss

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        # Trainer override: Trainer averages the per-rank losses of `gather_for_metrics`, which drops the last
        # batch's values past the dataset's length (with GRPO's repeated prompts, real completions), so `eval_loss`
        # leaned towards rank 0. It is instead the mean over batches of each batch's loss over all ranks.
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        losses = self._metrics["eval"].get("loss/total")
        if losses:
            output.metrics[f"{metric_key_prefix}_loss"] = sum(losses) / len(losses)
        return output

    # ------------------------------------------------------------------------------------------------------------
    # Extension points: the loss data and context of a micro-batch (hidden states, the LM head and the log-probs
    # are `LossLayerForwards`')

    def build_loss_data(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The data of one micro-batch given to `rl_loss_config.build` (override to add keys).

        `shifted_labels` are the completion ids with `ignore_idx` where `completion_mask` (× `tool_mask`) is 0, so
        position `t` holds the token predicted from the hidden state of the position before it; `advantages` are
        per sequence; `old_logprobs`, `ref_logprobs`, `rollout_logprobs` and `rollout_is_weights` are added when
        the batch has them.
        """
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        ignore = self.rl_loss_config.ignore_idx
        labels = inputs["completion_ids"].masked_fill(mask == 0, ignore)
        data: dict[str, Any] = {"shifted_labels": labels, "advantages": inputs["advantages"]}
        for key, name in FROM_TRL.items():
            if inputs.get(key) is not None:
                data[name] = inputs[key]
        ratio = inputs.get("importance_sampling_ratio")
        if ratio is not None:
            absorbs = self.rl_loss_config.policy_loss_cfg.spec.absorbs_rollout_is
            data["rollout_is_weights"] = trl_is_ratio_per_token(ratio, labels, ignore, absorbs)
        return data

    def build_loss_context(self, inputs: dict[str, Any]) -> BaseRLLossContext:
        """The loss context of one micro-batch (before `build_batches`), after rollout IS when rollout log-probs
        exist (weights and rejected tokens per `rl_loss.rollout_is`; in any case the mismatch metrics).

        Under SP the micro-batch is packed once (`SPMicroBatch`): its loss data go to `build`, and it is kept in
        `inputs["sp_micro_batch"]` for the loss forward, whose input shard lines up with the context's labels.
        """
        data = self.build_loss_data(inputs)
        if self.sp_mesh is not None:
            shape = tuple(inputs["completion_ids"].shape)
            micro_batch = self._sp_pack_batch(inputs).with_loss_data(data, shape, self.rl_loss_config.ignore_idx)
            inputs["sp_micro_batch"], data = micro_batch, micro_batch.loss_data
        ctx = self.rl_loss_config.build(data, sp_mesh=self.sp_mesh, micro_batch=self._rl_micro_batch)
        if ctx is None:
            raise ValueError("build_loss_data must give shifted_labels and advantages")
        if ctx.loss_kwargs.rollout_logprobs is not None and ctx.loss_kwargs.old_logprobs is not None:
            ctx.compute_rollout_is()
        elif ctx.loss_kwargs.rollout_logprobs is not None and self._old_logps_from_loss:
            ctx.defer_rollout_is()  # on-policy: the mismatch metrics come from the loss's own forward
        return ctx

    # ------------------------------------------------------------------------------------------------------------
    # Optimizer steps: the contexts of a step's micro-batches, built and normalized together

    def _build_step_contexts(self) -> None:
        """The contexts of the next group of micro-batches of the optimizer step, normalized together: the rest of
        the step, or up to the end of the current generation batch if the step spans two, weighted by its share
        `k / n` of the step's micro-batches (`step_fraction`; see docs/design.md)."""
        if self._rl_step_remaining == 0:  # the first micro-batch of an optimizer step
            self._rl_step_size = self._rl_step_remaining = self.current_gradient_accumulation_steps
            self._rl_step_metrics = []
        spg = self.args.steps_per_generation
        generate_every = spg * self.num_iterations
        # TRL's `_prepare_inputs` has already handed out (and `_step` not yet counted) the current micro-batch
        k = min(self._rl_step_remaining, generate_every - self._step % generate_every)
        first = self._rl_step_size - self._rl_step_remaining  # index in the step of the group's first micro-batch
        contexts = []
        for i in range(k):
            with overridden(self, _rl_micro_batch=first + i):  # named by the errors about this micro-batch's data
                contexts.append(self.build_loss_context(self._buffered_inputs[(self._step + i) % spg]))
        type(contexts[0]).build_batches(
            contexts, grad_averaging_size=self.accelerator.num_processes, step_fraction=k / self._rl_step_size
        )
        self._rl_step_remaining -= k
        self._rl_pending = deque(contexts)

    def _end_of_step_entropy_control(self) -> None:
        """TRL's entropy bookkeeping at an optimizer step's end (`adapted_entropy_coef` from the step's entropy
        over all ranks' tokens); TRL's own checkpointing saves and restores `entropy_coef`, `_last_world_entropy`."""
        if self.use_adaptive_entropy:
            # over the tokens the entropy bonus acts on, as TRL: those top_entropy_quantile keeps, else all
            quantile = self.rl_loss_config.top_entropy_quantile < 1.0
            entropies = self._metrics["train"].get("train_policy/entropy_kept" if quantile else "train_policy/entropy")
            if not entropies:
                raise RuntimeError("use_adaptive_entropy needs the step's entropy: keep rl_loss.compute_entropy=True")
            self._last_world_entropy = entropies[-1]  # reduced over all ranks' tokens by _log_rl_metrics
            self.entropy_coef = adapted_entropy_coef(self.entropy_coef, self._last_world_entropy, self.args)
        if self._entropy_bonus_enabled:
            self._metrics["train"]["entropy_coef"].append(self.entropy_coef)

    def _log_rl_metrics(self, mode: str, micro_batches: list[dict[str, Any]]) -> None:
        """Reduce the metrics of a step's micro-batches across ranks (collective) and append them to TRL's metric
        lists: ours once per step, TRL's keys (`kl`, `entropy`, `clip_ratio/*`, `policy_loss`, ...) once per
        micro-batch, as TRL appends them (its `log` averages each list over the logging window)."""
        step, trl_per_micro_batch = finalize_step_metrics(micro_batches, device=self.accelerator.device)
        for key, value in step.items():
            self._metrics[mode][key].append(float(value))
        for trl_metrics in trl_per_micro_batch:
            for key, value in trl_metrics.items():
                self._metrics[mode][key].append(float(value))
